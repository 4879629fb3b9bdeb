// radixlm's int8 weight-only linear on CPUs with AVX512_BF16: y[T, N] = (x[T, K] @ q^T) * s[N],
// q int8 [N, K] in plain rows (the same storage an int8 embedding gathers rows of: no second
// copy), s bf16 [N] one scale per output row, x and y bf16. Made for the few-row regime (decode,
// and the LM head of every quantized mode) where torch's `_weight_int8pack_mm` is compute-bound.
//
// Math, exact in the weights: each int8 is split into nibbles, q = 16 * hi + lo (hi signed in
// [-8, 7], lo in [0, 15]); a 64-byte chunk of a weight row (64 inputs), shifted by 0 / 4 / 8 / 12
// bits and mapped through a 32-entry `vpermw` table (word i -> bf16(i & 15), or bf16(16 *
// sext4(i & 15)) for the high nibbles: all exact in bf16), gives four `vdpbf16ps` operands whose
// 32-bit lane j pairs the inputs (4j, 4j + 2) (low bytes of each word) or (4j + 1, 4j + 3) (high
// bytes). x is reordered to match once per call (`xa` / `xb` per chunk, zero past K). Products
// and sums fp32; one multiply by the row scale and one rounding to bf16 at the end; a row's result
// does not depend on the other rows of x. Lanes are input positions, so each output needs a
// horizontal sum: 16 output rows are reduced together (`hsum16x16`). Each weight chunk is
// expanded once per 8 input rows. Twin: `x.float() @ (q.float() * s.float()[:, None]).T`.
//
// int8_mm_logits(x, q, s, bitmask, rows) -> float32 [T, N]: the LM head's variant, the same bf16
// results widened to float32 as they are stored (exactly `int8_mm(...).float()`), and in each
// row r of `rows` -inf wherever bit n of bitmask[r] is 0 (a grammar's token mask, xgrammar's
// layout: apply_token_bitmask_'s result). The logits leave the kernel as the sampler reads them:
// no conversion pass and no mask pass after it over 8 rows of 49152 read back from memory
// (~80 + ~80 us of a batch-8 decode step here).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "logits_masks.h"
#include "simd.h"

namespace {

constexpr int64_t kOut = 16;     // output rows reduced together (lanes of one hsum16x16)
constexpr int64_t kChunk = 64;   // inputs per weight chunk (one 64-byte load)

#if defined(__AVX512BF16__)

inline __m512bh dp_operand(__m512i words, __m512i table) {
  return (__m512bh)_mm512_permutexvar_epi16(words, table);
}

// Where block_rows stores: bf16 `y16`, or float32 `y32` with a row's mask bits (`masks`, per
// input row the bitmask word holding the block's 16 columns, nullptr: not masked) from `shift`.
struct Store {
  uint16_t* y16;
  float* y32;
  int64_t ldy;
  const uint32_t* const* masks;
  int shift;
};

// Rows [0, R) of the reordered x (row stride kp words) times output rows [0, nr) of w (row
// stride K): y rows t (stride ldy), columns 0 .. nr - 1. Per (input row, output row) two
// accumulators, the b0 + b1 products in one and b2 + b3 in the other, added at the end: the same
// order for every R, so a row's result does not depend on the other rows (batch-invariant).
template <int R>
void block_rows(const uint16_t* xr, int64_t kp, const int8_t* w, int64_t K, int64_t nr,
                const uint16_t* s, const Store& y, __m512i lo_tab, __m512i hi_tab) {
  alignas(64) __m512 sums[R][kOut];
  const int64_t chunks = kp / kChunk, full = K / kChunk;
  for (int64_t n = 0; n < nr; ++n) {
    const int8_t* wr = w + n * K;
    __m512 acc[R][2];
    for (int t = 0; t < R; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i v = c < full ? _mm512_loadu_si512(wr + c * kChunk)
                                 : _mm512_maskz_loadu_epi8((~0ull) >> (kChunk - (K - c * kChunk)),
                                                           wr + c * kChunk);
      const __m512bh b0 = dp_operand(v, lo_tab);
      const __m512bh b1 = dp_operand(_mm512_srli_epi16(v, 4), hi_tab);
      const __m512bh b2 = dp_operand(_mm512_srli_epi16(v, 8), lo_tab);
      const __m512bh b3 = dp_operand(_mm512_srli_epi16(v, 12), hi_tab);
      for (int t = 0; t < R; ++t) {
        const uint16_t* xc = xr + t * kp + c * kChunk;
        const __m512bh xa = (__m512bh)_mm512_loadu_si512(xc);
        const __m512bh xb = (__m512bh)_mm512_loadu_si512(xc + 32);
        acc[t][0] = _mm512_dpbf16_ps(acc[t][0], b0, xa);
        acc[t][1] = _mm512_dpbf16_ps(acc[t][1], b2, xb);
        acc[t][0] = _mm512_dpbf16_ps(acc[t][0], b1, xa);
        acc[t][1] = _mm512_dpbf16_ps(acc[t][1], b3, xb);
      }
    }
    for (int t = 0; t < R; ++t) sums[t][n] = _mm512_add_ps(acc[t][0], acc[t][1]);
  }
  for (int t = 0; t < R; ++t)
    for (int64_t i = nr; i < kOut; ++i) sums[t][i] = _mm512_setzero_ps();
  const __mmask16 mr = static_cast<__mmask16>((1u << nr) - 1);
  const __m512 scale = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mr, s));
  for (int t = 0; t < R; ++t) {
    const __m512 out = _mm512_mul_ps(radixlm_cpu::hsum16x16(sums[t]), scale);
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(out);
    if (y.y32 == nullptr) {
      _mm256_mask_storeu_epi16(y.y16 + t * y.ldy, mr, rounded);
      continue;
    }
    // bf16 -> float32 is exact: the bits shifted up
    __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    if (y.masks[t] != nullptr) {
      const auto keep = static_cast<__mmask16>(*y.masks[t] >> y.shift);
      wide = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), keep,
                                wide);
    }
    _mm512_mask_storeu_ps(y.y32 + t * y.ldy, mr, wide);
  }
}

// All T input rows, in balanced passes (`row_passes`), times the block of output rows from n0:
// y16 (bf16) or y32 (float32, row t masked by its bitmask row `row_masks[t]`, nullptr: not).
void block_all_rows(const uint16_t* xr, int64_t kp, int64_t T, const int8_t* w, int64_t K,
                    int64_t n0, int64_t nr, const uint16_t* s, uint16_t* y16, float* y32,
                    int64_t N, const uint32_t* const* row_masks, __m512i lo_tab,
                    __m512i hi_tab) {
  radixlm_cpu::row_passes(T, [&](auto R, int64_t t0) {
    const uint32_t* masks[8] = {};
    for (int t = 0; t < decltype(R)::value; ++t)
      if (row_masks != nullptr && row_masks[t0 + t] != nullptr)
        masks[t] = row_masks[t0 + t] + n0 / 32;
    const Store y{y16 == nullptr ? nullptr : y16 + t0 * N + n0,
                  y32 == nullptr ? nullptr : y32 + t0 * N + n0, N, masks,
                  static_cast<int>(n0 % 32)};
    block_rows<decltype(R)::value>(xr + t0 * kp, kp, w + n0 * K, K, nr, s + n0, y, lo_tab,
                                   hi_tab);
  });
}

// x [T, K] bf16 -> [T, kp] words, kp = K rounded up to 64: per chunk c, xa (words 0..31) then xb
// (words 32..63), xa word 2j = x[64c + 4j], 2j + 1 = x[64c + 4j + 2]; xb the same + 1. Zero past K.
void reorder_x(const uint16_t* x, int64_t T, int64_t K, int64_t kp, uint16_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* xt = x + t * K;
    uint16_t* o = out + t * kp;
    for (int64_t c = 0; c < kp / kChunk; ++c)
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t h = 0; h < 2; ++h)      // xa / xb
          for (int64_t e = 0; e < 2; ++e) {  // first / second input of the pair
            const int64_t k = c * kChunk + 4 * j + h + 2 * e;
            o[c * kChunk + 32 * h + 2 * j + e] = k < K ? xt[k] : 0;
          }
  }
}

#endif  // __AVX512BF16__

}  // namespace

namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(),
              "int8_mm: w must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 1 &&
                  scales.is_contiguous() && scales.size(0) == w.size(0),
              "int8_mm: scales must be contiguous bf16 [N]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "int8_mm: x must be bf16 [T, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "int8_mm: x has ", x.size(1), " columns, the weight K = ",
              w.size(1));
}

// y = (x @ w^T) * scales into y16 (bf16) or y32 (float32, masked rows: see block_all_rows).
void run(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, uint16_t* y16,
         float* y32, const uint32_t* const* row_masks) {
#if defined(__AVX512BF16__)
  const int64_t T = x.size(0), N = w.size(0), K = w.size(1);
  const at::Tensor xc = x.contiguous();
  const int64_t kp = (K + kChunk - 1) / kChunk * kChunk;
  at::Tensor xr = at::empty({T, kp}, x.options());
  auto* xrp = reinterpret_cast<uint16_t*>(xr.data_ptr<c10::BFloat16>());
  reorder_x(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()), T, K, kp, xrp);
  alignas(64) uint16_t lo[32], hi[32];
  for (int i = 0; i < 32; ++i) {
    const int v = i & 15;
    lo[i] = c10::BFloat16(static_cast<float>(v)).x;
    hi[i] = c10::BFloat16(static_cast<float>(16 * (v >= 8 ? v - 16 : v))).x;
  }
  const __m512i lo_tab = _mm512_load_si512(lo), hi_tab = _mm512_load_si512(hi);
  const int8_t* wp = w.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  at::parallel_for(0, (N + kOut - 1) / kOut, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kOut;
      block_all_rows(xrp, kp, T, wp, K, n0, std::min<int64_t>(kOut, N - n0), sp, y16, y32, N,
                     row_masks, lo_tab, hi_tab);
    }
  });
#else
  TORCH_CHECK(false, "int8_mm: this build has no AVX512_BF16");
#endif
}

}  // namespace

// y [T, N] bf16 = (x [T, K] bf16 @ w^T) * scales, w int8 [N, K], scales bf16 [N].
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  check_inputs(x, w, scales);
  const int64_t T = x.size(0), N = w.size(0), K = w.size(1);
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  run(x, w, scales, reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()), nullptr, nullptr);
  return y;
}

// int8_mm(x, w, scales).float() [T, N] with bitmask row r's -inf in each row r of `rows`.
at::Tensor int8_mm_logits(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                          const std::optional<at::Tensor>& bitmask, const at::Tensor& rows) {
  check_inputs(x, w, scales);
  const int64_t T = x.size(0), N = w.size(0), K = w.size(1);
  const auto masks = radixlm_cpu::logits_masks("int8_mm_logits", bitmask, rows, T, N);
  at::Tensor y = at::empty({T, N}, x.options().dtype(at::kFloat));
  if (T == 0 || N == 0) return y;
  if (K == 0) {  // every product 0, then the masks
    y.zero_();
    float* yp = y.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N && masks[t] != nullptr; ++n)
        if (!((masks[t][n / 32] >> (n % 32)) & 1u))
          yp[t * N + n] = -std::numeric_limits<float>::infinity();
    return y;
  }
  run(x, w, scales, nullptr, y.data_ptr<float>(), masks.data());
  return y;
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("int8_mm(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("int8_mm_logits(Tensor x, Tensor w, Tensor scales, Tensor? bitmask, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_mm_logits", &int8_mm_logits);
}
