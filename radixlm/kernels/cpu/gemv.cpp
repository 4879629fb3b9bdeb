// y[M, N] = x[M, K] @ w[N, K]^T (+ b) for bf16 on CPUs with AVX512_BF16, for the few rows of a
// decode step (M up to `kGemvMaxRows` in the callers), where the product only streams the weight:
// every weight byte is read from memory once for all M rows.
// - One row: each task takes 16 output rows at a time: 16 fp32 accumulators of vdpbf16ps over K
//   (32 bf16 a step), then one transpose-and-add tree for their 16 horizontal sums; the 16 rows
//   are one contiguous run of memory.
// - M > 1 rows: tiles of R inputs x G outputs (R * G <= 16 accumulators; per 32 columns G weight
//   loads and R input loads for R * G vdpbf16ps), the same transpose-and-add tree: G = 8 for two
//   rows, else G = 2 (measured no slower than 16 / R, noisy), up to 8 inputs a tile; past 8 rows
//   a group of 2 output rows is streamed once and read again from L1 for the next 8 inputs.
// fp32 accumulation, the bias added in fp32, one rounding to bf16 (as oneDNN's bf16 linear does).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Rows [m0, m0 + R) of x against output rows [n0, n0 + nr) (nr <= G) of w, in one pass over the
// weight: accumulator r * G + g holds (input m0 + r, output n0 + g), so the tree's lane r * G + g
// is y[m0 + r, n0 + g]. Per 32 columns: G weight loads and R input loads for R * G vdpbf16ps.
template <int R, int G>
inline void gemm_tile(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y,
                      int64_t m0, int64_t n0, int64_t nr, int64_t N, int64_t K,
                      const uint16_t* next) {
  static_assert(R * G <= 16, "16 accumulators");
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  const uint16_t* xr = x + m0 * K;
  const uint16_t* wr[G];
  for (int g = 0; g < G; ++g) wr[g] = w + (n0 + std::min<int64_t>(g, nr - 1)) * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if (next) {
      for (int g = 0; g < G; ++g)
        _mm_prefetch(reinterpret_cast<const char*>(next + G * k + 32 * g), _MM_HINT_T0);
    }
    __m512bh wv[G];
    for (int g = 0; g < G; ++g) wv[g] = (__m512bh)_mm512_loadu_si512(wr[g] + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + r * K + k);
      for (int g = 0; g < G; ++g) acc[r * G + g] = _mm512_dpbf16_ps(acc[r * G + g], xv, wv[g]);
    }
  }
  if (k < K) {
    const __mmask32 mk = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[G];
    for (int g = 0; g < G; ++g) wv[g] = (__m512bh)_mm512_maskz_loadu_epi16(mk, wr[g] + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, xr + r * K + k);
      for (int g = 0; g < G; ++g) acc[r * G + g] = _mm512_dpbf16_ps(acc[r * G + g], xv, wv[g]);
    }
  }
  __m512 s = radixlm_cpu::hsum16x16(acc);
  if (bias) {
    alignas(64) float bl[16] = {};
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < nr; ++g) bl[r * G + g] = bias[n0 + g];
    s = _mm512_add_ps(s, _mm512_load_ps(bl));
  }
  uint16_t out[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(s));
  for (int r = 0; r < R; ++r)
    std::memcpy(y + (m0 + r) * N + n0, out + G * r, nr * sizeof(uint16_t));
}

using TileFn = void (*)(const uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t,
                       int64_t, int64_t, int64_t, int64_t, const uint16_t*);

// The tile for `r` (1..8, r * G <= 16) inputs against G outputs.
template <int R, int G>
TileFn tile_if_fits() {
  if constexpr (R * G <= 16) {
    return &gemm_tile<R, G>;
  } else {
    return nullptr;
  }
}

template <int G>
TileFn tile_for(int64_t r) {
  switch (r) {
    case 1: return tile_if_fits<1, G>();
    case 2: return tile_if_fits<2, G>();
    case 3: return tile_if_fits<3, G>();
    case 4: return tile_if_fits<4, G>();
    case 5: return tile_if_fits<5, G>();
    case 6: return tile_if_fits<6, G>();
    case 7: return tile_if_fits<7, G>();
    default: return tile_if_fits<8, G>();
  }
}

// Inputs are taken up to 8 at a time: tiles of min(M, 8) x G (and a tail tile), all of one
// group of G output rows before the next group, so that the group's weight is streamed from
// memory once and read again from L1.
constexpr int64_t PASS_ROWS = 8;

template <int G>
void gemm_groups(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t M,
                 int64_t N, int64_t K) {
  const int64_t groups = (N + G - 1) / G;
  const TileFn full = tile_for<G>(std::min<int64_t>(PASS_ROWS, M));
  const TileFn tail = tile_for<G>(M % PASS_ROWS == 0 ? PASS_ROWS : M % PASS_ROWS);
  TORCH_CHECK(full && tail, "gemv_bf16: no tile for ", M, " rows x ", G, " outputs");
  at::parallel_for(0, groups, 64 / G, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * G, nr = std::min<int64_t>(G, N - n0);
      const uint16_t* next = g + 1 < g1 && n0 + 2 * G <= N ? w + (n0 + G) * K : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += PASS_ROWS) {
        const TileFn tile = m0 + PASS_ROWS <= M ? full : tail;
        tile(x, w, bias, y, m0, n0, nr, N, K, m0 == 0 ? next : nullptr);
      }
    }
  });
}

void gemm_few_rows(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y,
                   int64_t M, int64_t N, int64_t K) {
  switch (M) {
    case 2: return gemm_groups<8>(x, w, bias, y, M, N, K);
    default: return gemm_groups<2>(x, w, bias, y, M, N, K);
  }
}
#endif

}  // namespace

// The callers (`layer_linear`, `PackedLinear`) send inputs of at most this many rows here and the
// rest to oneDNN: the crossover measured on SmolLM2-135M's linears (README).
constexpr int64_t kGemvMaxRows = 8;
int64_t gemv_max_rows() { return kGemvMaxRows; }

// y [M, N] bf16 = x [M, K] bf16 @ w [N, K] bf16 ^T + b (fp32 [N] or bf16 [N], optional).
at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "gemv_bf16: bf16 x and w");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "gemv_bf16: x must be a contiguous [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "gemv_bf16: w must be contiguous [N, K]");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;  // a step with no rows to project (e.g. no logits wanted)
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
  if (M == 1) {
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
  } else {
    gemm_few_rows(xp, wp, bp, yp, M, N, K);
  }
#else
  TORCH_CHECK(false, "gemv_bf16: this build has no AVX512_BF16");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, Tensor? b=None) -> Tensor");
  m.def("gemv_max_rows() -> int", &gemv_max_rows);
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
