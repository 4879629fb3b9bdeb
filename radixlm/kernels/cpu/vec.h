// Float vectors of W lanes (GCC vector extensions: 16 lanes, one AVX-512 register, where the
// translation unit has AVX-512F; 8 lanes, one AVX2 register, elsewhere: GCC lowers a 64-byte
// vector without AVX-512 through the stack) and the elementwise numerics the fused CPU ops share:
// loads / stores converting from / to the activation dtype, rounding to it where the eager model
// materializes a tensor, e^x, and sums whose order (and so bits) is the same for every W.
// Header-only, inside an anonymous namespace of each including translation unit.
// NOTE: include after `#pragma GCC optimize("fp-contract=off")`: the eager model rounds its
// multiplies and adds separately, and every op sharing these must compute them alike.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

// Round an fp32 value to T and back: where the eager model materializes a T tensor.
template <typename T>
inline float round_t(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float round_t<float>(float x) {
  return x;
}

// ---- W-float vectors. Loads and stores go through memcpy (no alignment assumed).
#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));
// Unaligned views for direct vector loads / stores (a memcpy through a stack temporary stalls
// store-to-load forwarding).
typedef float vf_u __attribute__((vector_size(4 * W), aligned(4)));
typedef uint16_t vh_u __attribute__((vector_size(2 * W), aligned(2)));

inline vf splat(float x) { return vf{} + x; }

// W elements as fp32; `n < W` reads only n (the rest are 0).
template <typename T>
inline vf load_v(const T* p, int64_t n = W) {
  if constexpr (std::is_same_v<T, float>) {
    vf v{};
    if (n == W) return *reinterpret_cast<const vf_u*>(p);
    std::memcpy(&v, p, n * sizeof(float));
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vh h{};
    if (n == W) h = *reinterpret_cast<const vh_u*>(p);
    else std::memcpy(&h, p, n * sizeof(uint16_t));
    return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
  } else {
    vf v{};
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(p[i]);
    return v;
  }
}

// bf16 round-to-nearest-even of each lane, kept as fp32 bits (NaN payloads are not preserved).
inline vu bf16_bits(vf v) {
  const vu u = reinterpret_cast<vu>(v);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

template <typename T>
inline void store_v(T* p, vf v, int64_t n = W) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == W) *reinterpret_cast<vf_u*>(p) = v;
    else std::memcpy(p, &v, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const vh h = __builtin_convertvector(bf16_bits(v), vh);
    if (n == W) *reinterpret_cast<vh_u*>(p) = h;
    else std::memcpy(p, &h, n * sizeof(uint16_t));
  } else {
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(v[i]);
  }
}

// Vector round_t: each lane rounded to T and back to fp32.
template <typename T>
inline vf round_v(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return reinterpret_cast<vf>(bf16_bits(v) << 16);
  } else {
    for (int i = 0; i < W; ++i) v[i] = round_t<T>(v[i]);
    return v;
  }
}

// e^x, Cephes' single-precision polynomial (relative error ~1e-7), x clamped to fp32's range.
inline vf exp_v(vf x) {
  x = x < -87.33654f ? splat(-87.33654f) : x;
  x = x > 88.72283f ? splat(88.72283f) : x;
  const vf t = x * 1.44269504088896341f + 12582912.f;  // round(x / ln 2) by the 1.5 * 2^23 trick
  const vf n = t - 12582912.f;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return y * reinterpret_cast<vf>(e);
}

// 16 running sums as 16 / W vectors: lane l of every 16-float block of a row goes to sum l
// (vector v[j] holds the block's floats j * W .. j * W + W - 1), and `total` adds the 16 in lane
// order, so a sum's order, and its bits, are the same for W = 8 and W = 16. Loop over a row in
// blocks of 16 with an inner loop over j < kVecs (unrolled: the vectors stay in registers).
struct Sum16 {
  static constexpr int kVecs = 16 / W;
  vf v[kVecs] = {};
  template <typename Acc = float>
  Acc total() const {
    Acc s = 0;
    for (int j = 0; j < kVecs; ++j)
      for (int k = 0; k < W; ++k) s += v[j][k];
    return s;
  }
};

}  // namespace
