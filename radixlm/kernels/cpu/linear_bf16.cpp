// y[M, N] = x[M, K] @ w[N, K]^T (+ b) in bf16 on CPUs with AVX512_BF16: radixlm's bf16 linear,
// over a copy of the weight packed once (`pack_bf16_linear`) into the operand layout of
// vdpbf16ps, for any number of rows.
//
// Packed layout: tiles of 32 outputs; per tile and per K pair (k, k + 1) one run of 64 bf16,
// output n's pair at 2 * n: w_packed [NT, KP, 64], NT = ceil(N / 32), KP = ceil(K / 2), padding
// zero. One tile is one contiguous stream of memory, the tiles in output order.
// Kernel: per tile and per 8 input rows, 2 x R fp32 accumulators whose 16 lanes are 16 outputs;
// per K pair two 64-byte weight loads and, per row, the row's (x[k], x[k + 1]) broadcast into
// R x 2 vdpbf16ps. No horizontal sums, no transposes: the weight is read once per tile for
// every row of the pass (from memory by the first 8 rows, from L1 / L2 by the next), the inputs
// from L1 / L2.
// - Every output is one fp32 sum over K pairs in order, the bias added in fp32, one rounding to
//   bf16 (as oneDNN's bf16 linear does): a row's output is bit-identical whatever the other rows
//   of the call are (batch invariance).
// - Faster than oneDNN on its own prepacked layout (`mkldnn::_linear_pointwise`, the path this
//   replaces) at every row count measured, 1 to 512, and at 512 rows about the 2-core vdpbf16ps
//   peak (figures and command: README, "The CPU compiled forward").
//   NOTE: on CPUs with AMX-BF16 oneDNN's tile kernels have ~8x the MACs per cycle; there inputs
//   of more than `kAmxMaxRows` rows stay with oneDNN (not measured here: no AMX machine).
// - Gated (`gated`, a SiLU MLP's gate_up): tile t holds gate rows [16 t, 16 t + 16) in its first
//   16 lanes and the matching up rows in the next 16, and the epilogue writes
//   silu(gate) * up for those 16 outputs: SiLU-and-mul fused into the projection, with the
//   numerics of `silu_and_mul` (fused_ops.cpp) on the bf16-rounded projection: bit-identical to
//   the two ops in sequence (tested).
//
// - fp32 activations (CPUs without native bf16, which compute in fp32: `matmul_dtype` "auto"),
//   on any AVX2 + FMA CPU, at every row count (with AVX-512F, few rows only:
//   `linear_bf16_fp32_max_rows()`): the same packed weight, each K pair widened to
//   fp32 exactly (w[n, k] = pair << 16, w[n, k + 1] = pair & 0xffff0000), fp32 out. Few rows
//   (decode): widened in registers, streaming half the bytes of an fp32 weight, which is what
//   they are bound by. More rows (prefill, compute-bound): each half tile widened once per K
//   block into an L1 buffer and multiplied by 6-row x 16-output register blocks, faster than
//   oneDNN's fp32 GEMM on its own packed fp32 copy (measured on an AVX2 EPYC, README), which
//   is then not kept at all. Every output is one fp32 FMA chain over k in order in both
//   kernels: batch-invariant like the bf16 path; gated, silu(g) * u in fp32 (the numerics of
//   `silu_and_mul` on fp32).
//
// - The LM head's variant (`linear_bf16_logits`, bf16 x): the same bf16 results widened to fp32
//   as they are stored (exactly `linear_bf16(...).float()`), with a grammar's token masks in the
//   rows asked for (-inf where bit n of bitmask[r] is 0, xgrammar's layout): the logits leave
//   the kernel as the sampler reads them, with no conversion pass and no mask pass after it
//   over rows read back from memory (8 rows of 49152: ~80 + ~80-190 us of a batch-8 decode
//   step here).
//
// NOTE: no floating-point contraction in the epilogue (the shared numerics of vec.h).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "logits_masks.h"
#include "vec.h"

namespace {

constexpr int64_t TILE_N = 32;             // outputs per tile: two vectors of 16 fp32 lanes
constexpr int64_t TILE_PAIR = 2 * TILE_N;  // bf16 per K pair of a tile
constexpr int64_t PASS_ROWS = 8;           // input rows per pass: 16 accumulators

// Where the LM head's variant stores: fp32 logits `y` [M, N] and per row the bitmask row to mask
// it with (`masks[r]`, W words; nullptr: not masked).
struct LogitsOut {
  float* y;
  const uint32_t* const* masks;
};

#if defined(__AVX512BF16__)
// Rows [0, R) of x (K pairs as uint32, row stride xs) against one tile `w` ([KP, 64]); writes
// y[r, n0 + j] for j < 32 and n0 + j < N (row stride N), or with `lo` (not gated) lo->y's
// fp32 rows, masked.
template <int R, bool Gated>
inline void tile_rows(const uint32_t* x, int64_t xs, const uint16_t* w, int64_t KP,
                      const float* bias, uint16_t* y, int64_t N, int64_t n0,
                      const LogitsOut* lo) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * TILE_PAIR);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kp * TILE_PAIR + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * xs + kp]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
    }
  }
  if constexpr (Gated) {  // outputs [n0, n0 + 16): gate in acc[r][0], up in acc[r][1]
    const __mmask16 mk = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n0)) - 1);
    const __m512 bg = bias ? _mm512_maskz_loadu_ps(mk, bias + n0) : _mm512_setzero_ps();
    const __m512 bu = bias ? _mm512_maskz_loadu_ps(mk, bias + N + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const vf g = round_v<c10::BFloat16>(vf(_mm512_add_ps(acc[r][0], bg)));
      const vf u = round_v<c10::BFloat16>(vf(_mm512_add_ps(acc[r][1], bu)));
      const vf out = round_v<c10::BFloat16>(g / (1.f + exp_v(-g))) * u;
      _mm256_mask_storeu_epi16(y + r * N + n0, mk,
                               (__m256i)__builtin_convertvector(bf16_bits(out), vh));
    }
    return;
  }
  for (int j = 0; j < 2; ++j) {
    const int64_t n = n0 + 16 * j;
    if (n >= N) break;
    const __mmask16 mk = static_cast<__mmask16>((1u << std::min<int64_t>(16, N - n)) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], bv));
      if (lo == nullptr) {
        _mm256_mask_storeu_epi16(y + r * N + n, mk, out);
        continue;
      }
      // bf16 -> fp32 is exact: the bits shifted up
      __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(out), 16));
      if (lo->masks[r] != nullptr) {
        const auto keep = static_cast<__mmask16>(lo->masks[r][n / 32] >> (n % 32));
        wide = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                  keep, wide);
      }
      _mm512_mask_storeu_ps(lo->y + r * N + n, mk, wide);
    }
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, const float*,
                        uint16_t*, int64_t, int64_t, const LogitsOut*);

template <bool Gated>
TileFn tile_for(int64_t rows) {
  switch (rows) {
    case 1: return &tile_rows<1, Gated>;
    case 2: return &tile_rows<2, Gated>;
    case 3: return &tile_rows<3, Gated>;
    case 4: return &tile_rows<4, Gated>;
    case 5: return &tile_rows<5, Gated>;
    case 6: return &tile_rows<6, Gated>;
    case 7: return &tile_rows<7, Gated>;
    default: return &tile_rows<8, Gated>;
  }
}

// Work items are (tile, chunk of rows), tile-major, so that a thread takes consecutive tiles (one
// stream of weight memory) and, for one tile, its row chunks back to back (the tile read from
// memory once). Rows are split into chunks only when the tiles alone are too few to share out.
// Gated: N outputs of 16 per tile. With `logits` (not gated): fp32 masked rows there, not `y`
// (row r masked by bitmask row `masks[r]`, nullptr: not masked).
template <bool Gated>
void linear_packed(const uint32_t* x, const uint16_t* w, const float* bias, uint16_t* y,
                   int64_t M, int64_t N, int64_t KP, float* logits = nullptr,
                   const uint32_t* const* masks = nullptr) {
  constexpr int64_t tile_out = Gated ? TILE_N / 2 : TILE_N;
  const int64_t NT = (N + tile_out - 1) / tile_out;
  const int64_t passes = (M + PASS_ROWS - 1) / PASS_ROWS;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t chunks = 1;
  while (NT * chunks < want && chunks < passes) chunks *= 2;
  const int64_t per_chunk = (passes + chunks - 1) / chunks;  // passes per chunk
  const TileFn full = tile_for<Gated>(PASS_ROWS), tail = tile_for<Gated>(M % PASS_ROWS);
  at::parallel_for(0, NT * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, c = i % chunks;
      const uint16_t* wt = w + t * KP * TILE_PAIR;
      const int64_t p1 = std::min(passes, (c + 1) * per_chunk);
      for (int64_t p = c * per_chunk; p < p1; ++p) {
        const int64_t m0 = p * PASS_ROWS;
        const TileFn fn = m0 + PASS_ROWS <= M ? full : tail;
        const LogitsOut lo{logits == nullptr ? nullptr : logits + m0 * N,
                          masks == nullptr ? nullptr : masks + m0};
        fn(x + m0 * KP, KP, wt, KP, bias, y == nullptr ? nullptr : y + m0 * N, N, t * tile_out,
           logits == nullptr ? nullptr : &lo);
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The fp32-activation path (see the header). Every output is one FMA chain over k in order
// (w[n, k] * x[k] added to the running sum), whichever kernel computes it, so a row's output is
// the same bits at every row count of the call:
// - few rows (`kFewRowsF32`): each K pair widened in registers; 4 rows or more in passes of 3-6
//   rows over a half tile (16 outputs: 6-12 accumulators, each advanced by two dependent FMAs
//   per pair; 8 chains are exactly what 2 FMAs a cycle of latency 4 need, 12 leave slack; 4
//   widening ops per 12-24 FMAs), so a half tile's later passes read it from L1; 1-3 rows in
//   one pass over the whole tile (32 outputs: 3 rows in 12 accumulators, 1-2 in 4 or 8);
// - more rows: per K block, one half tile widened once into an L1 buffer [KC_F32, 16] fp32,
//   then a 6-row x 16-output register block (12 accumulators) per 6 rows, each accumulator
//   loaded from and stored to the item's running sums between K blocks (the chain continues
//   unchanged).
// A vector of 8 K pairs (k, k + 1) of bf16 widened exactly to fp32: the k values, the k + 1
// values. The one copy of the widening all the fp32 kernels below use.
inline __m256 pair_lo(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 pair_hi(__m256i v) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  return _mm256_castsi256_ps(_mm256_and_si256(v, hi));
}

constexpr int64_t kFewRowsF32 = 32;  // at most this many rows: the few-row passes (measured)
constexpr int64_t KC_F32 = 256;      // k per block: a [256, 16] fp32 buffer is 16 KB
// Rows per work item (their running sums: 32 KB, touched once per K block). Each item widens
// its tile once per K block, so fewer, larger items widen less: 96 -> 256 rows measured 5-7%
// faster at 128-512 rows in one process (AVX2 EPYC, 120 linears, alternated, median of 8-10);
// commit against commit, alternated, 512 rows ~5% (median), 128 rows unchanged.
constexpr int64_t MC_F32 = 256;

// Rows [0, R) of x (row stride xs) against one whole tile w ([KP, 64]); acc[r][j]: output j of
// the tile (no bias). `pf` (or null): the next tile, prefetched line by line meanwhile.
template <int R>
inline void tile_rows_f32(const float* x, int64_t xs, const uint16_t* w, int64_t K,
                          float (*acc)[TILE_N], const uint16_t* pf) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
  const int64_t full = K / 2;  // pairs with both k and k + 1 inside x's row
  const uint16_t* wp = w;
  for (int64_t kp = 0; kp < full; ++kp, wp += TILE_PAIR) {
    if (pf != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + kp * TILE_PAIR), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + kp * TILE_PAIR + 32), _MM_HINT_T0);
    }
    __m256i wv[4];  // outputs [8 j, 8 j + 8), each lane the pair (k, k + 1)
    for (int j = 0; j < 4; ++j)
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * j));
    for (int r = 0; r < R; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * xs + 2 * kp);
      for (int j = 0; j < 4; ++j)
        a[r][j] = _mm256_fmadd_ps(pair_lo(wv[j]), xe, a[r][j]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xo = _mm256_broadcast_ss(x + r * xs + 2 * kp + 1);
      for (int j = 0; j < 4; ++j)
        a[r][j] = _mm256_fmadd_ps(pair_hi(wv[j]), xo, a[r][j]);
    }
  }
  if (K % 2) {  // odd K: the last pair's k + 1 is zero padding in w, absent from x
    for (int j = 0; j < 4; ++j) {
      const __m256i wj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * j));
      for (int r = 0; r < R; ++r)
        a[r][j] = _mm256_fmadd_ps(pair_lo(wj), _mm256_broadcast_ss(x + r * xs + 2 * full), a[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc[r] + 8 * j, a[r][j]);
}

// Rows [0, R) (3 <= R <= 6) of x (row stride xs) against half s of one tile w ([KP, 64]: outputs
// [16 s, 16 s + 16)); acc[r][16 s + j]: output 16 s + j (no bias). `pf` (or null): the same half
// of the next tile, whose lines of pairs pf_first, pf_first + pf_every, ... are prefetched
// meanwhile. Named accumulators (GCC keeps arrays of this many vectors on the stack). With 6 rows
// the 12 chains leave the FMA latency slack (4 rows: 8 chains, exactly what 2 FMAs a cycle of
// latency 4 need; 3 rows, only after other passes over the same half); w is loaded again for the
// k + 1 half of each pair, so that 12 accumulators, two widened vectors and a broadcast fit the
// 16 registers.
#define RLM_ROWS6(X) X(0) X(1) X(2) X(3) X(4) X(5)
// Row i's two accumulators a<i>0 / a<i>1 to c + i * ldc (rows i < R): both 6-row kernels' store.
#define RLM_STORE_ROW(i)                        \
  if constexpr (i < R) {                        \
    _mm256_storeu_ps(c + i * ldc, a##i##0);     \
    _mm256_storeu_ps(c + i * ldc + 8, a##i##1); \
  }
template <int R>
inline void half_rows_f32(const float* x, int64_t xs, const uint16_t* w, int64_t K, int s,
                          float (*acc)[TILE_N], const uint16_t* pf, int64_t pf_first,
                          int64_t pf_every) {
  static_assert(R >= 3 && R <= 6, "3 to 6 rows");
#define RLM_DECL(i) __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = a##i##0;
  RLM_ROWS6(RLM_DECL)
#undef RLM_DECL
  const int64_t full = K / 2;
  const uint16_t* wp = w + 32 * s;
  if (pf != nullptr) pf += 32 * s;
  // R rows times two 8-output vectors v0 / v1 (k: pair_lo, k + 1: pair_hi), x[r, k + off]
#define RLM_ROW(i)                                                              \
  if constexpr (i < R) {                                                        \
    const __m256 xv = _mm256_broadcast_ss(xk + i * xs + off);                   \
    a##i##0 = _mm256_fmadd_ps(v0, xv, a##i##0);                                 \
    a##i##1 = _mm256_fmadd_ps(v1, xv, a##i##1);                                 \
  }
  auto load = [&](const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  int64_t pf_next = pf != nullptr ? pf_first : full;
  for (int64_t kp = 0; kp < full; ++kp, wp += TILE_PAIR) {
    if (kp == pf_next) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + kp * TILE_PAIR), _MM_HINT_T0);
      pf_next += pf_every;
    }
    const float* xk = x + 2 * kp;
    {
      const __m256 v0 = pair_lo(load(wp)), v1 = pair_lo(load(wp + 16));
      constexpr int off = 0;
      RLM_ROWS6(RLM_ROW)
    }
    {
      const __m256 v0 = pair_hi(load(wp)), v1 = pair_hi(load(wp + 16));
      constexpr int off = 1;
      RLM_ROWS6(RLM_ROW)
    }
  }
  if (K % 2) {  // odd K: the last pair's k + 1 is zero padding in w, absent from x
    const float* xk = x + 2 * full;
    const __m256 v0 = pair_lo(load(wp)), v1 = pair_lo(load(wp + 16));
    constexpr int off = 0;
    RLM_ROWS6(RLM_ROW)
  }
#undef RLM_ROW
  float* c = acc[0] + 16 * s;
  constexpr int64_t ldc = TILE_N;
  RLM_ROWS6(RLM_STORE_ROW)
}

// Rows [0, 3) of x against one whole tile w (as `tile_rows_f32`): 12 accumulators (3 rows x 4
// vectors of 8 outputs), each widened vector taken straight from memory (the shift / and with a
// memory operand), so 12 chains fit the registers. `pf` (or null): the next tile, prefetched
// line by line meanwhile.
inline void tile_rows3_f32(const float* x, int64_t xs, const uint16_t* w, int64_t K,
                           float (*acc)[TILE_N], const uint16_t* pf) {
#define RLM_J4(X, i) X(i, 0) X(i, 1) X(i, 2) X(i, 3)
#define RLM_DECL(i, j) __m256 a##i##j = _mm256_setzero_ps();
  RLM_J4(RLM_DECL, 0) RLM_J4(RLM_DECL, 1) RLM_J4(RLM_DECL, 2)
#undef RLM_DECL
  auto load = [](const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  const int64_t full = K / 2;
  const uint16_t* wp = w;
#define RLM_FMA(i, j) a##i##j = _mm256_fmadd_ps(v##j, x##i, a##i##j);
#define RLM_PASS(widen, off)                                                        \
  {                                                                                 \
    const __m256 x0 = _mm256_broadcast_ss(xk + (off));                              \
    const __m256 x1 = _mm256_broadcast_ss(xk + xs + (off));                         \
    const __m256 x2 = _mm256_broadcast_ss(xk + 2 * xs + (off));                     \
    {                                                                               \
      const __m256 v0 = widen(load(wp)), v1 = widen(load(wp + 16));                 \
      RLM_FMA(0, 0) RLM_FMA(0, 1) RLM_FMA(1, 0) RLM_FMA(1, 1) RLM_FMA(2, 0) RLM_FMA(2, 1) \
    }                                                                               \
    {                                                                               \
      const __m256 v2 = widen(load(wp + 32)), v3 = widen(load(wp + 48));            \
      RLM_FMA(0, 2) RLM_FMA(0, 3) RLM_FMA(1, 2) RLM_FMA(1, 3) RLM_FMA(2, 2) RLM_FMA(2, 3) \
    }                                                                               \
  }
  for (int64_t kp = 0; kp < full; ++kp, wp += TILE_PAIR) {
    if (pf != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + kp * TILE_PAIR), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(pf + kp * TILE_PAIR + 32), _MM_HINT_T0);
    }
    const float* xk = x + 2 * kp;
    RLM_PASS(pair_lo, 0)
    RLM_PASS(pair_hi, 1)
  }
  if (K % 2) {  // odd K: the last pair's k + 1 is zero padding in w, absent from x
    const float* xk = x + 2 * full;
    RLM_PASS(pair_lo, 0)
  }
#undef RLM_PASS
#undef RLM_FMA
#define RLM_STORE(i, j) _mm256_storeu_ps(acc[i] + 8 * j, a##i##j);
  RLM_J4(RLM_STORE, 0) RLM_J4(RLM_STORE, 1) RLM_J4(RLM_STORE, 2)
#undef RLM_STORE
#undef RLM_J4
}

// Half s of one tile, k in [k0, k1) (k0 even), widened to fp32: buf[k - k0][j] = w[16 s + j, k].
inline void widen_half(const uint16_t* w, int s, int64_t k0, int64_t k1, float* buf) {
  for (int64_t k = k0; k < k1; k += 2) {
    const uint16_t* wp = w + (k / 2) * TILE_PAIR + 32 * s;
    float* b = buf + (k - k0) * 16;
    for (int j = 0; j < 2; ++j) {
      const __m256i wj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * j));
      _mm256_storeu_ps(b + 8 * j, pair_lo(wj));
      if (k + 1 < k1) _mm256_storeu_ps(b + 16 + 8 * j, pair_hi(wj));
    }
  }
}

// Rows [0, R) (R <= 6) x 16 outputs over kn k of `buf` ([kn, 16]) and x (row stride xs, already
// offset to the block's first k); c: the running sums (row stride ldc), zero first when `First`.
// Named accumulators: GCC keeps an array of 12 vectors on the stack.
template <int R, bool First>
inline void block_rows_f32(const float* x, int64_t xs, const float* buf, int64_t kn, float* c,
                           int64_t ldc) {
#define RLM_DECL(i)                                   \
  __m256 a##i##0, a##i##1;                            \
  if constexpr (i < R) {                              \
    if constexpr (First) {                            \
      a##i##0 = a##i##1 = _mm256_setzero_ps();        \
    } else {                                          \
      a##i##0 = _mm256_loadu_ps(c + i * ldc);         \
      a##i##1 = _mm256_loadu_ps(c + i * ldc + 8);     \
    }                                                 \
  }
  RLM_ROWS6(RLM_DECL)
#undef RLM_DECL
  const float* xk = x;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kn; ++k, ++xk) {
    const __m256 b0 = _mm256_loadu_ps(buf + 16 * k), b1 = _mm256_loadu_ps(buf + 16 * k + 8);
#define RLM_STEP(i)                                         \
  if constexpr (i < R) {                                    \
    const __m256 xv = _mm256_broadcast_ss(xk + i * xs);     \
    a##i##0 = _mm256_fmadd_ps(b0, xv, a##i##0);             \
    a##i##1 = _mm256_fmadd_ps(b1, xv, a##i##1);             \
  }
    RLM_ROWS6(RLM_STEP)
#undef RLM_STEP
  }
  RLM_ROWS6(RLM_STORE_ROW)
}
#undef RLM_STORE_ROW
#undef RLM_ROWS6

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
template <bool First>
BlockFn block_for(int64_t rows) {
  switch (rows) {
    case 1: return &block_rows_f32<1, First>;
    case 2: return &block_rows_f32<2, First>;
    case 3: return &block_rows_f32<3, First>;
    case 4: return &block_rows_f32<4, First>;
    case 5: return &block_rows_f32<5, First>;
    default: return &block_rows_f32<6, First>;
  }
}

// The tile's outputs from its running sums acc [rows, 32] (rows m0, m0 + 1, ...): bias added,
// gated: silu(gate) * up (half 0 the gate, half 1 the up projection of outputs [n0, n0 + 16)).
// With `masks` (not gated; the LM head's variant): row m's outputs at -inf wherever bit j of its
// bitmask word n0 / 32 is 0 (`masks[m]`, nullptr: not masked), while the tile is in L1.
template <bool Gated>
void finish_tile_f32(const float (*acc)[TILE_N], int64_t rows, const float* bias, float* y,
                     int64_t N, int64_t n0, int64_t m0, const uint32_t* const* masks) {
  if constexpr (Gated) {
    for (int64_t c = 0; c < 16; c += W) {
      const int64_t n = n0 + c;
      if (n >= N) break;
      const int64_t cnt = std::min<int64_t>(W, N - n);
      const vf bg = bias ? load_v(bias + n, cnt) : vf{};
      const vf bu = bias ? load_v(bias + N + n, cnt) : vf{};
      for (int64_t r = 0; r < rows; ++r) {
        const vf g = load_v(acc[r] + c) + bg, u = load_v(acc[r] + 16 + c) + bu;
        store_v(y + (m0 + r) * N + n, (g / (1.f + exp_v(-g))) * u, cnt);
      }
    }
    return;
  }
  for (int64_t c = 0; c < TILE_N; c += W) {
    const int64_t n = n0 + c;
    if (n >= N) break;
    const int64_t cnt = std::min<int64_t>(W, N - n);
    const vf bv = bias ? load_v(bias + n, cnt) : vf{};
    for (int64_t r = 0; r < rows; ++r) store_v(y + (m0 + r) * N + n, load_v(acc[r] + c) + bv, cnt);
  }
  if (masks == nullptr) return;
  const int64_t cnt = std::min<int64_t>(TILE_N, N - n0);  // a tile is one bitmask word
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* m = masks[m0 + r];
    const uint32_t word = m == nullptr ? 0xFFFFFFFFu : m[n0 / 32];
    if (word == 0xFFFFFFFFu) continue;
    float* out = y + (m0 + r) * N + n0;
    for (int64_t j = 0; j < cnt; ++j)
      if (!((word >> j) & 1u)) out[j] = -std::numeric_limits<float>::infinity();
  }
}

// As `linear_packed`, for fp32 x [M, K] (row stride xs) and y [M, N]. Few rows: work items are
// tiles (row chunks of a multiple of 4 rows where the tiles alone are too few), each tile's rows
// in passes while the next tile is prefetched. More rows: work items are (row chunk of at most
// MC_F32, tile), chunk-major, so a thread walks the tiles for one chunk of rows (whose K block
// stays in L2).
template <bool Gated>
void linear_packed_f32(const float* x, int64_t xs, const uint16_t* w, const float* bias,
                       float* y, int64_t M, int64_t N, int64_t K, int64_t KP,
                       const uint32_t* const* masks = nullptr) {
  constexpr int64_t tile_out = Gated ? TILE_N / 2 : TILE_N;
  const int64_t NT = (N + tile_out - 1) / tile_out;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  if (M <= kFewRowsF32) {
    int64_t chunks = 1;  // row chunks of a multiple of 4 rows, where the tiles alone are too few
    while (NT * chunks < want && 4 * chunks < M) chunks *= 2;
    const int64_t per = ((M + chunks - 1) / chunks + 3) / 4 * 4;
    at::parallel_for(0, NT * chunks, 1, [&](int64_t i0, int64_t i1) {
      float acc[kFewRowsF32][TILE_N];
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / chunks, c = i % chunks;
        const uint16_t* wt = w + t * KP * TILE_PAIR;
        const uint16_t* next = i + 1 < i1 && t + 1 < NT ? wt + KP * TILE_PAIR : nullptr;
        const int64_t m0 = std::min(M, c * per), m1 = std::min(M, (c + 1) * per);
        if (m1 - m0 < 4) {  // one tile pass (3 rows: 12 chains, ~15% faster than 2 + 1)
          const float* xm = x + m0 * xs;
          if (m1 - m0 == 3)
            tile_rows3_f32(xm, xs, wt, K, acc, next);
          else if (m1 - m0 == 2)
            tile_rows_f32<2>(xm, xs, wt, K, acc, next);
          else if (m1 - m0 == 1)
            tile_rows_f32<1>(xm, xs, wt, K, acc, next);
        } else {
          // Half passes of 6 rows, the last 3-5 in one (7 and 8 left: 4 + 3, 4 + 4). Measured,
          // AVX2 EPYC, 120 linears of distinct weights, alternated: 6-row passes 10-15% faster
          // than 4-row ones at 6-32 rows; the rows past the last 6 in a half pass 12-18% faster
          // than in a whole-tile pass after the halves, which reads the tile again from L2
          // (5 rows, 5 vs 4 + 1; 9, 6 + 3 vs 6 + tile 3; 11, 6 + 5 vs 6 + 4 + tile 1; 15); for 8
          // rows, 6 + 2 ~4% and 5 + 3 ~10% slower than 4 + 4.
          int64_t sizes[kFewRowsF32 / 3 + 1], np = 0;
          int64_t rem = m1 - m0;
          for (; rem >= 9 || rem == 6; rem -= 6) sizes[np++] = 6;
          if (rem >= 7) sizes[np++] = 4, rem -= 4;
          if (rem > 0) sizes[np++] = rem;  // 3, 4 or 5
          // Q passes over each half: pass q prefetches the next tile's lines of pairs q, q + Q,
          // ... of that half, so the next tile streams in over all of this tile's work
          // (measured, AVX2 EPYC, 120 linears at 8 / 16 rows: ~8% faster than all of it in the
          // first pass, which left the memory idle during the others).
          using HalfFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int,
                                  float (*)[TILE_N], const uint16_t*, int64_t, int64_t);
          constexpr HalfFn kHalf[] = {&half_rows_f32<3>, &half_rows_f32<4>, &half_rows_f32<5>,
                                      &half_rows_f32<6>};
          for (int s = 0; s < 2; ++s)
            for (int64_t q = 0, m = m0; q < np; m += sizes[q++])
              kHalf[sizes[q] - 3](x + m * xs, xs, wt, K, s, acc + (m - m0), next, q, np);
        }
        if (m0 < m1) finish_tile_f32<Gated>(acc, m1 - m0, bias, y, N, t * tile_out, m0, masks);
      }
    });
    return;
  }
  int64_t chunks = (M + MC_F32 - 1) / MC_F32;
  while (NT * chunks < want && chunks * 6 < M) chunks *= 2;
  const int64_t per = (M + chunks - 1) / chunks;  // rows per chunk (at most MC_F32)
  at::parallel_for(0, NT * chunks, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float buf[KC_F32 * 16];
    alignas(64) float acc[MC_F32][TILE_N];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = i / NT, t = i % NT;
      const uint16_t* wt = w + t * KP * TILE_PAIR;
      const int64_t m0 = std::min(M, c * per), m1 = std::min(M, (c + 1) * per);
      for (int64_t k0 = 0; k0 < K; k0 += KC_F32) {
        const int64_t k1 = std::min(K, k0 + KC_F32);
        for (int s = 0; s < 2; ++s) {
          widen_half(wt, s, k0, k1, buf);
          for (int64_t m = m0; m < m1; m += 6) {
            const int64_t r = std::min<int64_t>(6, m1 - m);
            const BlockFn fn = k0 == 0 ? block_for<true>(r) : block_for<false>(r);
            fn(x + m * xs + k0, xs, buf, k1 - k0, acc[m - m0] + 16 * s, TILE_N);
          }
        }
      }
      if (m0 < m1) finish_tile_f32<Gated>(acc, m1 - m0, bias, y, N, t * tile_out, m0, masks);
    }
  });
}
#endif

#if defined(__AMX_BF16__)
constexpr int64_t kAmxMaxRows = 8;
#endif

}  // namespace

// The callers (`layer_linear`, `PackedLinear`) send inputs of at most this many rows here and the
// rest to oneDNN: every row count where the CPU has no AMX (measured above), else `kAmxMaxRows`.
int64_t linear_bf16_max_rows() {
#if defined(__AMX_BF16__)
  return kAmxMaxRows;
#else
  return std::numeric_limits<int64_t>::max();
#endif
}

// The same for fp32 inputs (CPUs without native bf16): every row count where the build has AVX2 +
// FMA but no AVX-512 (the fp32-activation path; measured on an AVX2 EPYC, README), else 0. With
// AVX-512F (e.g. an AVX-512 CPU without AVX512_BF16) only the few-row passes: oneDNN's fp32 GEMM
// has 16-lane FMAs there, twice the blocked kernel's 8 (not measured: no such machine here).
int64_t linear_bf16_fp32_max_rows() {
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__)
  return kFewRowsF32;
#elif defined(__AVX2__) && defined(__FMA__)
  return std::numeric_limits<int64_t>::max();
#else
  return 0;
#endif
}

// w [N, K] bf16 -> w_packed [ceil(N / 32), ceil(K / 2), 64] bf16 (the layout above); gated: w is
// [2I, K] (gate rows, then up rows) -> [ceil(I / 16), ceil(K / 2), 64].
at::Tensor pack_bf16_linear(const at::Tensor& w, bool gated) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2,
              "pack_bf16_linear: w must be a bf16 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), KP = (K + 1) / 2;
  TORCH_CHECK(!gated || N % 2 == 0, "pack_bf16_linear: a gated weight has 2I rows");
  const int64_t NT = gated ? (N / 2 + TILE_N / 2 - 1) / (TILE_N / 2) : (N + TILE_N - 1) / TILE_N;
  auto pad = [&](const at::Tensor& rows, int64_t to) {  // [r, K] -> zero-padded [to, 2 KP]
    at::Tensor out = at::zeros({to, KP * 2}, w.options());
    out.narrow(0, 0, rows.size(0)).narrow(1, 0, K).copy_(rows);
    return out;
  };
  at::Tensor padded;
  if (gated) {  // tile t: gate rows [16 t, 16 t + 16), then the same up rows
    const int64_t I = N / 2, half = TILE_N / 2;
    padded = at::stack({pad(w.narrow(0, 0, I), NT * half).view({NT, half, KP * 2}),
                        pad(w.narrow(0, I, I), NT * half).view({NT, half, KP * 2})},
                       1)
                 .view({NT * TILE_N, KP * 2});
  } else {
    padded = pad(w, NT * TILE_N);
  }
  // [NT, 32, KP, 2] -> [NT, KP, 32, 2]
  return padded.view({NT, TILE_N, KP, 2}).permute({0, 2, 1, 3}).contiguous().view(
      {NT, KP, TILE_PAIR});
}

// The checks both ops share: bf16 or fp32 x [M, K], a weight packed by `pack_bf16_linear` for K,
// and n outputs filling its tiles (`tile_out` outputs a tile: 16 gated, else 32).
static void check_packed_inputs(const char* op, const at::Tensor& x, const at::Tensor& w_packed,
                                int64_t n, int64_t tile_out) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  w_packed.scalar_type() == at::kBFloat16,
              op, ": bf16 or fp32 x and bf16 w");
  TORCH_CHECK(x.dim() == 2, op, ": x must be [M, K]");
  TORCH_CHECK(w_packed.dim() == 3 && w_packed.size(2) == TILE_PAIR && w_packed.is_contiguous(),
              op, ": w must be packed by pack_bf16_linear ([NT, KP, 64])");
  const int64_t K = x.size(1), KP = w_packed.size(1);
  TORCH_CHECK(KP == (K + 1) / 2, op, ": x has ", K, " columns, w was packed for ", 2 * KP);
  TORCH_CHECK(n > 0 && (n + tile_out - 1) / tile_out == w_packed.size(0), op, ": n = ", n,
              " outputs do not match the packed weight's ", w_packed.size(0), " tiles");
}

// y [M, n] = x [M, K] @ W^T + b, W packed by `pack_bf16_linear` from an [n, K] weight; x bf16
// (AVX512_BF16; y bf16, or float32 with `logits`) or fp32 (AVX2 + FMA; y fp32); b: fp32 or bf16
// [n], optional. Gated (W packed gated from [2n, K]): y = silu(g) * u with [g, u] = x @ W^T + b,
// b [2n]. `masks` (not gated): per row the bitmask row whose 0 bits make its outputs -inf.
static at::Tensor packed_product(const char* op, const at::Tensor& x, const at::Tensor& w_packed,
                                 const std::optional<at::Tensor>& b, int64_t n, bool gated,
                                 bool logits, const uint32_t* const* masks) {
  const bool f32 = x.scalar_type() == at::kFloat;
  const int64_t M = x.size(0), K = x.size(1), KP = w_packed.size(1);
  at::Tensor y = at::empty({M, n}, logits ? x.options().dtype(at::kFloat) : x.options());
  if (M == 0) return y;  // a step with no rows to project (e.g. no logits wanted)
  at::Tensor bf;
  if (b.has_value()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == (gated ? 2 * n : n), op,
                ": b must be [n] ([2n] gated)");
    bf = b->to(at::kFloat).contiguous();
  }
  const float* bias = b.has_value() ? bf.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(w_packed.data_ptr<c10::BFloat16>());
  if (f32) {
#if defined(__AVX2__) && defined(__FMA__)
    at::Tensor xc = x.contiguous();
    auto* run = gated ? &linear_packed_f32<true> : &linear_packed_f32<false>;
    run(xc.data_ptr<float>(), K, wp, bias, y.data_ptr<float>(), M, n, K, KP, masks);
#else
    TORCH_CHECK(false, op, ": fp32 inputs need AVX2 and FMA");
#endif
    return y;
  }
#if defined(__AVX512BF16__)
  at::Tensor xc = x.contiguous();
  if (K % 2) xc = at::constant_pad_nd(xc, {0, 1});  // the packed weight's zero K padding
  const auto* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<c10::BFloat16>());
  if (logits) {
    linear_packed<false>(xp, wp, bias, nullptr, M, n, KP, y.data_ptr<float>(), masks);
  } else {
    auto* run = gated ? &linear_packed<true> : &linear_packed<false>;
    run(xp, wp, bias, reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()), M, n, KP, nullptr,
        nullptr);
  }
#else
  TORCH_CHECK(false, op, ": bf16 inputs need AVX512_BF16 (this build has none)");
#endif
  return y;
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w_packed,
                       const std::optional<at::Tensor>& b, int64_t n, bool gated) {
  check_packed_inputs("linear_bf16", x, w_packed, n, gated ? TILE_N / 2 : TILE_N);
  return packed_product("linear_bf16", x, w_packed, b, n, gated, false, nullptr);
}

// linear_bf16(x, w_packed, b, n).float() [M, n] (bf16 x; fp32 x: its fp32 output), with -inf
// wherever bit j of bitmask[r] is 0 in each row r of `rows` (the LM head's logits with a
// grammar's masks; no bitmask: none).
at::Tensor linear_bf16_logits(const at::Tensor& x, const at::Tensor& w_packed,
                              const std::optional<at::Tensor>& b, int64_t n,
                              const std::optional<at::Tensor>& bitmask, const at::Tensor& rows) {
  check_packed_inputs("linear_bf16_logits", x, w_packed, n, TILE_N);
  const auto masks = radixlm_cpu::logits_masks("linear_bf16_logits", bitmask, rows, x.size(0), n);
  return packed_product("linear_bf16_logits", x, w_packed, b, n, false, true, masks.data());
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("pack_bf16_linear(Tensor w, bool gated=False) -> Tensor");
  m.def(
      "linear_bf16_logits(Tensor x, Tensor w_packed, Tensor? b, int n, Tensor? bitmask, "
      "Tensor rows) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w_packed, Tensor? b, int n, bool gated=False) -> Tensor");
  m.def("linear_bf16_max_rows() -> int", &linear_bf16_max_rows);
  m.def("linear_bf16_fp32_max_rows() -> int", &linear_bf16_fp32_max_rows);
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("pack_bf16_linear", &pack_bf16_linear);
  m.impl("linear_bf16", &linear_bf16);
  m.impl("linear_bf16_logits", &linear_bf16_logits);
}
