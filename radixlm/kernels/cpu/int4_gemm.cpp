// radixlm's int4 weight-only linear for the decode regime (1..16 input rows) on CPUs with
// AVX512_BF16: y[T, N] = x[T, K] @ W^T, W[n, k] = s[n, g] * q[n, k] + m[n, g], g = k / 32,
// q in [0, 15], s and m fp16 (Q4_1's own storage: a GGUF Q4_0 / Q4_1 / Q4_K maps in exactly).
//
// Layout (written by `pack_int4_g32` in radixlm/runtime/quantization/kernels.py): output rows in
// blocks of 16 (the last block holds the N % 16 tail, `nr` rows); a block's weight is K * nr / 2
// contiguous bytes, group after group (32 inputs), each group 4 chunks of 4 * nr bytes (8
// inputs). In a chunk, 16-bit word j (j < 2 nr) holds four nibbles: nibble c (bits 4c..4c+3) is
// q[n0 + j / 2, 32 g + 8 chunk + 2 c + j % 2]. So a 64-byte chunk load, shifted by 0 / 4 / 8 / 12
// bits, gives through one vpermw (a 32-entry table: word i -> bf16(i & 15), which ignores the
// higher bits) four vdpbf16ps operands whose lane i is row i's pair of inputs (k, k + 1): the
// input pair is one 32-bit broadcast of x. Scales and mins: `[N, K / 32, 2]` fp16, blocked the
// same way (a block's groups one after the other, each its nr scales then its nr mins).
//
// Math: y[t, n] = sum_g s[n, g] * (sum_{k in g} x[t, k] q[n, k]) + m[n, g] * sum_{k in g} x[t, k]:
// the integer weights are exact in bf16, the products and sums fp32, the scale and min applied
// once per group in fp32, one rounding to bf16 at the end. Each weight chunk is expanded once per
// 8 input rows (kept in registers across them). Twin: `dequantize_int4_g32` (kernels.py), the
// weights in fp32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kBlock = 16;  // output rows per block (lanes of an fp32 accumulator)
constexpr int64_t kGroup = 32;  // inputs per scale / min

void check_int4_g32(const at::Tensor& w, const at::Tensor& sm, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op,
              ": w must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(sm.scalar_type() == at::kHalf && sm.dim() == 3 && sm.size(2) == 2 &&
                  sm.is_contiguous(),
              op, ": scales_mins must be contiguous float16 [N, K / 32, 2]");
  TORCH_CHECK(sm.size(0) == w.size(0) && sm.size(1) * kGroup == 2 * w.size(1) && w.size(1) > 0,
              op, ": scales_mins [N, K / 32, 2] do not match w [N, K / 2] (K a multiple of 32)");
}

// fn(n0, nr, block weight bytes, block scales) for each block of output rows, in parallel.
template <typename Fn>
void for_each_block(const at::Tensor& w, const at::Tensor& sm, int64_t grain, const Fn& fn) {
  const int64_t N = w.size(0), K = 2 * w.size(1), G = K / kGroup;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const c10::Half* sp = sm.data_ptr<c10::Half>();
  at::parallel_for(0, (N + kBlock - 1) / kBlock, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock;
      fn(n0, std::min<int64_t>(kBlock, N - n0), wp + n0 * K / 2, sp + n0 * G * 2);
    }
  });
}

#if defined(__AVX512BF16__)

// Four vdpbf16ps operands of one 64-byte chunk (first 4 * nr bytes; nr < 16: masked).
template <bool Full>
inline void expand_chunk(const uint8_t* p, int64_t nr, __m512i table, __m512bh* out) {
  const __m512i c = Full ? _mm512_loadu_si512(p)
                         : _mm512_maskz_loadu_epi8((1ull << (4 * nr)) - 1, p);
  out[0] = (__m512bh)_mm512_permutexvar_epi16(c, table);
  out[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(c, 4), table);
  out[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(c, 8), table);
  out[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(c, 12), table);
}

// Rows [0, R) of x (row stride K) times one block of nr output rows: y rows t, columns n0 ...
// xsum[t * G + g]: the sum of x[t] over group g (fp32).
template <int R, bool Full>
void block_rows(const uint16_t* x, const float* xsum, const uint8_t* w, const c10::Half* sm,
                uint16_t* y, int64_t ldy, int64_t K, int64_t nr, __m512i table) {
  const int64_t G = K / kGroup;
  const __mmask16 mr = static_cast<__mmask16>((1u << nr) - 1);
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t chunk = 4 * nr;  // bytes
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * 4 * chunk;
    const c10::Half* sg = sm + g * 2 * nr;
    __m512 part[R];
    for (int t = 0; t < R; ++t) part[t] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      __m512bh b[4];
      expand_chunk<Full>(wg + c * chunk, nr, table, b);
      for (int j = 0; j < 4; ++j) {
        const int64_t k = g * kGroup + c * 8 + 2 * j;
        for (int t = 0; t < R; ++t) {
          int32_t pair;
          __builtin_memcpy(&pair, x + t * K + k, sizeof(pair));
          part[t] = _mm512_dpbf16_ps(part[t], (__m512bh)_mm512_set1_epi32(pair), b[j]);
        }
      }
    }
    const __m256i sb = Full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg))
                            : _mm256_maskz_loadu_epi16(mr, sg);
    const __m256i mb = Full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + nr))
                            : _mm256_maskz_loadu_epi16(mr, sg + nr);
    const __m512 s = _mm512_cvtph_ps(sb), m = _mm512_cvtph_ps(mb);
    for (int t = 0; t < R; ++t) {
      acc[t] = _mm512_fmadd_ps(part[t], s, acc[t]);
      acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[t * G + g]), acc[t]);
    }
  }
  for (int t = 0; t < R; ++t)
    _mm256_mask_storeu_epi16(y + t * ldy, mr, (__m256i)_mm512_cvtneps_pbh(acc[t]));
}

template <bool Full>
void block_all_rows(const uint16_t* x, const float* xsum, const uint8_t* w, const c10::Half* sm,
                    uint16_t* y, int64_t T, int64_t N, int64_t K, int64_t nr, __m512i table) {
  const int64_t G = K / kGroup;
  radixlm_cpu::row_passes(T, [&](auto R, int64_t t0) {
    block_rows<decltype(R)::value, Full>(x + t0 * K, xsum + t0 * G, w, sm, y + t0 * N, N, K, nr,
                                         table);
  });
}

#endif  // __AVX512BF16__

}  // namespace

// y [T, N] bf16 = x [T, K] bf16 @ W^T, W packed as above (w uint8 [N, K / 2], scales_mins fp16
// [N, K / 32, 2]). Any T: made for small T, it also beat a dequantized copy + GEMM up to 512 rows
// (each 8 rows re-expand W).
at::Tensor int4_g32_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_mins) {
  check_int4_g32(w, scales_mins, "int4_g32_mm");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2,
              "int4_g32_mm: x must be bf16 [T, K]");
  const int64_t T = x.size(0), N = w.size(0), K = 2 * w.size(1);
  TORCH_CHECK(x.size(1) == K, "int4_g32_mm: x has ", x.size(1), " columns, the weight K = ", K);
  at::Tensor y = at::empty({T, N}, x.options());
#if defined(__AVX512BF16__)
  if (T == 0) return y;
  const at::Tensor xc = x.contiguous();
  const int64_t G = K / kGroup;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  std::vector<float> xsum(T * G);  // [T, G]: each group's input sum, once per call
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const __m512 lo = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(xp + t * K + g * kGroup)));
      const __m512 hi = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(xp + t * K + g * kGroup + 16)));
      xsum[t * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  alignas(64) uint16_t tab[32];
  for (int i = 0; i < 32; ++i) tab[i] = c10::BFloat16(static_cast<float>(i & 15)).x;
  const __m512i table = _mm512_load_si512(tab);
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  for_each_block(w, scales_mins, 4, [&](int64_t n0, int64_t nr, const uint8_t* wb,
                                        const c10::Half* sb) {
    if (nr == kBlock) {
      block_all_rows<true>(xp, xsum.data(), wb, sb, yp + n0, T, N, K, nr, table);
    } else {
      block_all_rows<false>(xp, xsum.data(), wb, sb, yp + n0, T, N, K, nr, table);
    }
  });
#else
  TORCH_CHECK(false, "int4_g32_mm: this build has no AVX512_BF16");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("int4_g32_mm(Tensor x, Tensor w, Tensor scales_mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("int4_g32_mm", &int4_g32_mm);
}
