// AVX-512 helpers shared by the compiled CPU ops (header-only; compiled where the including
// translation unit has AVX-512F).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace radixlm_cpu {

// Input rows sharing one weight expansion in the low-bit kernels (int4_gemm.cpp, int8_gemm.cpp).
constexpr int64_t kMaxPassRows = 8;

// fn(std::integral_constant<int, R>{}, t0) for T input rows in balanced passes of at most
// kMaxPassRows (12 rows -> 6 + 6): rows t0 .. t0 + R - 1, R a compile-time constant.
template <typename Fn>
inline void row_passes(int64_t T, Fn&& fn) {
  const int64_t passes = (T + kMaxPassRows - 1) / kMaxPassRows;
  for (int64_t i = 0, t0 = 0; i < passes; ++i) {
    const int64_t r = (T - t0 + (passes - i) - 1) / (passes - i);
    switch (r) {
      case 1: fn(std::integral_constant<int, 1>{}, t0); break;
      case 2: fn(std::integral_constant<int, 2>{}, t0); break;
      case 3: fn(std::integral_constant<int, 3>{}, t0); break;
      case 4: fn(std::integral_constant<int, 4>{}, t0); break;
      case 5: fn(std::integral_constant<int, 5>{}, t0); break;
      case 6: fn(std::integral_constant<int, 6>{}, t0); break;
      case 7: fn(std::integral_constant<int, 7>{}, t0); break;
      default: fn(std::integral_constant<int, 8>{}, t0); break;
    }
    t0 += r;
  }
}

// r[j] = sum of the 16 lanes of a[j], j < 16 (a transpose-and-add tree: 45 vector ops).
inline __m512 hsum16x16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e0, e1, _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace radixlm_cpu
#endif  // __AVX512F__
