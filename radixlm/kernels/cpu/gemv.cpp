// y[1, N] = x[1, K] @ w[N, K]^T (+ b) for bf16 on CPUs with AVX512_BF16: the one-row product of
// a batch-1 decode step, which only streams the weight. Each task takes 16 output rows at a
// time: 16 fp32 accumulators of vdpbf16ps over K (32 bf16 a step), then one transpose-and-add
// tree for their 16 horizontal sums; the 16 rows are one contiguous run of memory. fp32
// accumulation, the bias added in fp32, one rounding to bf16 (as oneDNN's bf16 linear does).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

#if defined(__AVX512BF16__)
constexpr int64_t ROWS = 16;  // output rows per group

// Output rows [n0, n0 + nr) (nr <= 16); K tail by masked loads. The next group's rows are
// prefetched while this one is multiplied (a group is one contiguous run of 16 K-row weights).
template <bool Full>
inline void gemv_group(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y,
                       int64_t n0, int64_t nr, int64_t K, const uint16_t* next) {
  __m512 acc[ROWS];
  for (int j = 0; j < ROWS; ++j) acc[j] = _mm512_setzero_ps();
  const uint16_t* wg = w + n0 * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + 16 * k), _MM_HINT_T0);
    for (int j = 0; j < ROWS; ++j)
      if (Full || j < nr)
        acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_loadu_si512(wg + j * K + k));
  }
  if (k < K) {
    const __mmask32 mk = static_cast<__mmask32>((1ull << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + k);
    for (int j = 0; j < ROWS; ++j)
      if (Full || j < nr)
        acc[j] = _mm512_dpbf16_ps(acc[j], xv,
                                  (__m512bh)_mm512_maskz_loadu_epi16(mk, wg + j * K + k));
  }
  const __mmask16 mr = static_cast<__mmask16>((1u << nr) - 1);
  __m512 r = radixlm_cpu::hsum16x16(acc);
  if (bias) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(mr, bias + n0));
  _mm256_mask_storeu_epi16(y + n0, mr, (__m256i)_mm512_cvtneps_pbh(r));
}
#endif

}  // namespace

// y [1, N] bf16 = x [1, K] bf16 @ w [N, K] bf16 ^T + b (fp32 [N] or bf16 [N], optional).
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "gemv_bf16: bf16 x and w");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "gemv_bf16: x must be [1, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "gemv_bf16: w must be contiguous [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor y = at::empty({1, N}, x.options());
#if defined(__AVX512BF16__)
  at::Tensor bf;
  if (b.has_value()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == N, "gemv_bf16: b must be [N]");
    bf = b->to(at::kFloat).contiguous();
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const float* bp = b.has_value() ? bf.data_ptr<float>() : nullptr;
  const int64_t groups = (N + ROWS - 1) / ROWS;
  at::parallel_for(0, groups, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * ROWS, nr = std::min<int64_t>(ROWS, N - n0);
      // NOTE: prefetching 16 K-row bytes per 32 columns covers the next group's 16 rows.
      const uint16_t* next = g + 1 < g1 ? wp + (n0 + ROWS) * K : nullptr;
      if (nr == ROWS) {
        gemv_group<true>(xp, wp, bp, yp, n0, nr, K, next);
      } else {
        gemv_group<false>(xp, wp, bp, yp, n0, nr, K, nullptr);
      }
    }
  });
#else
  TORCH_CHECK(false, "gemv_bf16: this build has no AVX512_BF16");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? b=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
