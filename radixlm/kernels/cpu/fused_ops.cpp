// Fused elementwise ops of the CPU decoder layer: RMSNorm (optionally with the residual add),
// RoPE in place, SiLU-and-mul, and the K/V store into the paged cache.
//
// Each op replaces a chain of 5-12 eager ATen calls (and their dtype round trips) with one
// dispatch; their torch twins are in radixlm/kernels/reference.py and their numerics are those of
// the eager model (radixlm/runtime/models/llama.py, i.e. Hugging Face transformers): statistics in
// fp32, and every value the eager model rounds to the activation dtype is rounded here at the
// same point, so in float32 the results match the twins to the last bit or close to it.
//
// NOTE: no floating-point contraction in this file (a fused multiply-add rounds differently from
// the eager model's separate multiply and add).
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

// Rows per parallel chunk: below this, one thread does all (a decode step has 1-64 rows).
constexpr int64_t GRAIN_ROWS = 16;

template <typename T>
void rms_norm_rows(const T* x, int64_t xs, T* res, int64_t rs, const T* w, T* y, int64_t ys,
                   int64_t rows, int64_t h, float eps, bool add) {
  at::parallel_for(0, rows, GRAIN_ROWS, [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(h);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * xs;
      T* rr = add ? res + r * rs : nullptr;
      float* b = buf.data();
      auto load = [&](int64_t i, int64_t n) {  // x (plus the residual, stored) -> buf
        vf v = load_v(xr + i, n);
        if (add) {  // residual <- round(x + residual); normalize the residual
          v = round_v<T>(v + load_v(rr + i, n));
          store_v(rr + i, v, n);
        }
        store_v(b + i, v, n);
        return v;
      };
      Sum16 acc;
      int64_t i0 = 0;
      for (; i0 + 16 <= h; i0 += 16) {
#pragma GCC unroll 2
        for (int j = 0; j < Sum16::kVecs; ++j) {
          const vf v = load(i0 + j * W, W);
          acc.v[j] += v * v;
        }
      }
      for (int j = 0; i0 + j * W < h; ++j) {
        const vf v = load(i0 + j * W, std::min<int64_t>(W, h - i0 - j * W));
        acc.v[j] += v * v;
      }
      const float ss = acc.total();
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      T* yr = y + r * ys;
      for (int64_t i = 0; i < h; i += W) {
        const int64_t n = std::min<int64_t>(W, h - i);
        store_v(yr + i, load_v(w + i, n) * round_v<T>(load_v(b + i, n) * inv), n);
      }
    }
  });
}

template <typename F>
void dispatch_float(at::ScalarType t, const char* name, F f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": dtype must be float32, bfloat16 or float16");
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, ": CPU tensor expected");
  TORCH_CHECK(t.dim() == dim, name, ": expected ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.stride(-1) == 1, name, ": last dim must be contiguous");
}

}  // namespace

namespace {

// y = weight * normalize(x), or with `residual`: residual <- x + residual, y = weight *
// normalize(residual). One validation and dispatch for both ops.
at::Tensor rms_norm_impl(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight,
                         double eps, const char* name) {
  check_rows(x, "x", 2);
  if (residual != nullptr) {
    check_rows(*residual, "residual", 2);
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                name, ": residual must have x's shape and dtype");
  }
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be [H], contiguous, x's dtype");
  at::Tensor y = at::empty(x.sizes(), x.options());
  dispatch_float(x.scalar_type(), name, [&](auto tag) {
    using T = decltype(tag);
    T* res = residual != nullptr ? residual->data_ptr<T>() : nullptr;
    const int64_t rs = residual != nullptr ? residual->stride(0) : 0;
    rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), res, rs, weight.data_ptr<T>(),
                     y.data_ptr<T>(), y.stride(0), x.size(0), x.size(1), (float)eps,
                     residual != nullptr);
  });
  return y;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_impl(x, nullptr, weight, eps, "rms_norm");
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  return rms_norm_impl(x, &residual, weight, eps, "add_rms_norm");
}

// In place: x[t, h] <- x * cos[pos[t]] + rotate_half(x) * sin[pos[t]] for q and k (neox style),
// cos/sin rounded to x's dtype first and each product rounded, as the eager model computes it.
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin) {
  check_rows(q, "q", 3);
  check_rows(k, "k", 3);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rope: q and k must have one dtype");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2), "rope: q/k shapes do not match");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.dim() == 1 && positions.size(0) == q.size(0),
              "rope: positions must be int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(1) == q.size(2),
              "rope: cos/sin must be float32 [P, D] contiguous");
  const int64_t t = q.size(0), d = q.size(2), half = d / 2, p = cos.size(0);
  TORCH_CHECK(d % 2 == 0, "rope: head dim must be even");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < p, "rope: position ", pos[i], " outside the table");
  dispatch_float(q.scalar_type(), "rope", [&](auto tag) {
    using T = decltype(tag);
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    // W pairs (i, i + half) of a head at a time; the position's cos / sin rounded to the
    // activation dtype once per row for all its heads, as the eager model's cast tables are.
    auto rotate = [&](at::Tensor& x, int64_t r) {
      T* base = x.data_ptr<T>() + r * x.stride(0);
      const float* c = cp + pos[r] * d;
      const float* s = sp + pos[r] * d;
      for (int64_t i = 0; i < half; i += W) {
        const int64_t n = std::min<int64_t>(W, half - i);
        const vf cl = round_v<T>(load_v(c + i, n)), sl = round_v<T>(load_v(s + i, n));
        const vf ch = round_v<T>(load_v(c + half + i, n));
        const vf sh = round_v<T>(load_v(s + half + i, n));
        for (int64_t hh = 0; hh < x.size(1); ++hh) {
          T* v = base + hh * x.stride(1);
          const vf a = load_v(v + i, n), b = load_v(v + half + i, n);
          // rotate_half(x) = (-x2, x1)
          store_v(v + i, round_v<T>(a * cl) + round_v<T>(-b * sl), n);
          store_v(v + half + i, round_v<T>(b * ch) + round_v<T>(a * sh), n);
        }
      }
    };
    at::parallel_for(0, t, GRAIN_ROWS, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        rotate(q, r);
        rotate(k, r);
      }
    });
  });
}

// [T, 2I] -> [T, I]: silu(x[:, :I]) * x[:, I:], silu rounded to x's dtype before the product.
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x", 2);
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: last dim must be even");
  const int64_t t = x.size(0), n = x.size(1) / 2;
  at::Tensor y = at::empty({t, n}, x.options());
  dispatch_float(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const int64_t xs = x.stride(0);
    at::parallel_for(0, t, GRAIN_ROWS, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* g = xp + r * xs;
        const T* u = g + n;
        T* o = yp + r * n;
        for (int64_t i = 0; i < n; i += W) {
          const int64_t m = std::min<int64_t>(W, n - i);
          const vf a = load_v(g + i, m);
          store_v(o + i, round_v<T>(a / (1.f + exp_v(-a))) * load_v(u + i, m), m);
        }
      }
    });
  });
  return y;
}

// k_buf[slots[t]] <- k[t], v_buf[slots[t]] <- v[t] (converted to the cache's dtype), in the
// cache's layout: kv_layout 0 flat [S, Hkv, D]; 1 the pairs16 blocks of paged_attention.cpp
// (K element (s, h, d) at (s / 16) * 16 * Hkv * D + h * 16 * D + (d / 2) * 32 + 2 * (s % 16) +
// d % 2; V at ... + ((s % 16) / 2) * 2 * D + 2 * d + s % 2).
void store_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v, int64_t kv_layout) {
  TORCH_CHECK(kv_layout == 0 || kv_layout == 1, "store_kv: kv_layout must be 0 or 1");
  check_rows(k, "k", 3);
  check_rows(v, "v", 3);
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3 &&
                  k_buf.sizes() == v_buf.sizes() && k_buf.scalar_type() == v_buf.scalar_type(),
              "store_kv: k_buf/v_buf must be contiguous [S, Hkv, D] of one dtype");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == k_buf.size(1) && k.size(2) == k_buf.size(2),
              "store_kv: k/v must be [T, Hkv, D] matching the cache");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "store_kv: k and v must have one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.size(0) == k.size(0),
              "store_kv: slots must be int64 [T]");
  const int64_t t = k.size(0), hkv = k.size(1), d = k.size(2), s = k_buf.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sl[i] >= 0 && sl[i] < s, "store_kv: slot ", sl[i], " outside the cache");
  dispatch_float(k_buf.scalar_type(), "store_kv", [&](auto ctag) {
    using C = decltype(ctag);
    dispatch_float(k.scalar_type(), "store_kv", [&](auto xtag) {
      using X = decltype(xtag);
      auto copy = [&](at::Tensor& buf, const at::Tensor& x, bool is_k) {
        C* bp = buf.data_ptr<C>();
        const X* xp = x.data_ptr<X>();
        if (kv_layout == 1) {
          for (int64_t i = 0; i < t; ++i) {
            const int64_t o = sl[i] % 16;
            C* blk = bp + (sl[i] - o) * hkv * d;
            for (int64_t hh = 0; hh < hkv; ++hh) {
              const X* src = xp + i * x.stride(0) + hh * x.stride(1);
              C* dst = blk + hh * 16 * d;
              if constexpr (std::is_same_v<C, X> && sizeof(C) == 2) {
                if (is_k) {  // (d, d + 1) pairs: one 32-bit copy each, 16 words apart
                  uint32_t* dk = reinterpret_cast<uint32_t*>(dst) + o;
                  for (int64_t p = 0; p < d / 2; ++p)
                    std::memcpy(dk + 16 * p, src + 2 * p, sizeof(uint32_t));
                } else {  // one half of each (key 2i, key 2i + 1) pair
                  C* dv = dst + (o / 2) * 2 * d + o % 2;
                  for (int64_t j = 0; j < d; ++j) dv[2 * j] = src[j];
                }
                continue;
              }
              for (int64_t j = 0; j < d; ++j) {
                const int64_t at = is_k ? (j / 2) * 32 + 2 * o + j % 2 : (o / 2) * 2 * d + 2 * j + o % 2;
                if constexpr (std::is_same_v<C, X>) {
                  dst[at] = src[j];
                } else {
                  dst[at] = static_cast<C>(to_f(src[j]));
                }
              }
            }
          }
          return;
        }
        for (int64_t i = 0; i < t; ++i) {
          C* dst = bp + sl[i] * hkv * d;
          for (int64_t hh = 0; hh < hkv; ++hh) {
            const X* src = xp + i * x.stride(0) + hh * x.stride(1);
            if constexpr (std::is_same_v<C, X>) {
              std::memcpy(dst + hh * d, src, d * sizeof(C));
            } else {
              for (int64_t j = 0; j < d; ++j) dst[hh * d + j] = static_cast<C>(to_f(src[j]));
            }
          }
        }
      };
      copy(k_buf, k, true);
      copy(v_buf, v, false);
    });
  });
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def(
      "store_kv(Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slots, Tensor k, Tensor v, "
      "int kv_layout=0) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("store_kv", &store_kv);
}
