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
//   on any AVX2 + FMA CPU: the same packed weight, each 8-output half of a 64-byte K-pair run
//   widened to fp32 in registers (w[n, k] = pair << 16, w[n, k + 1] = pair & 0xffff0000: exact),
//   per row two FMAs per pair and vector of 8 outputs, fp32 out. It streams half the bytes of an
//   fp32 weight, which is what a few-row (decode) product is bound by; above
//   `linear_bf16_fp32_max_rows()` rows (compute-bound) the callers take oneDNN's fp32 GEMM.
//   Every output is the sum over even k plus the sum over odd k, each an fp32 FMA chain in k
//   order: batch-invariant like the bf16 path; gated, silu(g) * u in fp32 (the numerics
//   of `silu_and_mul` on fp32).
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

#include "vec.h"

namespace {

constexpr int64_t TILE_N = 32;             // outputs per tile: two vectors of 16 fp32 lanes
constexpr int64_t TILE_PAIR = 2 * TILE_N;  // bf16 per K pair of a tile
constexpr int64_t PASS_ROWS = 8;           // input rows per pass: 16 accumulators

#if defined(__AVX512BF16__)
// Rows [0, R) of x (K pairs as uint32, row stride xs) against one tile `w` ([KP, 64]); writes
// y[r, n0 + j] for j < 32 and n0 + j < N (row stride N).
template <int R, bool Gated>
inline void tile_rows(const uint32_t* x, int64_t xs, const uint16_t* w, int64_t KP,
                      const float* bias, uint16_t* y, int64_t N, int64_t n0) {
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
    for (int r = 0; r < R; ++r)
      _mm256_mask_storeu_epi16(y + r * N + n, mk,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], bv)));
  }
}

using TileFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, const float*,
                        uint16_t*, int64_t, int64_t);

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
// Gated: N outputs of 16 per tile.
template <bool Gated>
void linear_packed(const uint32_t* x, const uint16_t* w, const float* bias, uint16_t* y,
                   int64_t M, int64_t N, int64_t KP) {
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
        fn(x + m0 * KP, KP, wt, KP, bias, y + m0 * N, N, t * tile_out);
      }
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The fp32-activation path (see the header). A pass takes 2 rows: 8 accumulators (the even and
// the odd k of each pair summed apart, so each FMA chain advances once per pair and the FMA
// latency never binds; 3 rows spill registers and measured slower) + 2 weight vectors + 2
// broadcasts.
constexpr int64_t PASS_ROWS_F32 = 2;
// Passes per work item (at most 16 rows): their accumulators live on the stack.
constexpr int64_t ITEM_PASSES_F32 = 8;

// Rows [0, R) of x (fp32, row stride xs) against outputs [16 s, 16 s + 16) of one tile `w`
// ([KP, 64]: half s of each 64-bf16 K-pair run); acc[r] gets the 16 fp32 sums (no bias): per
// output, the sum over even k plus the sum over odd k, each in k order. `pf` (or null): the
// same half of the next tile, prefetched line by line meanwhile.
template <int R>
inline void half_tile_rows(const float* x, int64_t xs, const uint16_t* w, int64_t KP, int64_t K,
                           int s, float (*acc)[16], const uint16_t* pf) {
  __m256 ae[R][2], ao[R][2];
  for (int r = 0; r < R; ++r) ae[r][0] = ae[r][1] = ao[r][0] = ao[r][1] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t full = K / 2;  // pairs with both k and k + 1 inside x's row
  const uint16_t* wp = w + 32 * s;
  if (pf != nullptr) pf += 32 * s;
  for (int64_t kp = 0; kp < full; ++kp, wp += TILE_PAIR) {
    if (pf != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf + kp * TILE_PAIR), _MM_HINT_T0);
    for (int j = 0; j < 2; ++j) {
      const __m256i wj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * j));
      const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(wj, 16));
      const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(wj, hi));
      for (int r = 0; r < R; ++r) {
        ae[r][j] = _mm256_fmadd_ps(e, _mm256_broadcast_ss(x + r * xs + 2 * kp), ae[r][j]);
        ao[r][j] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(x + r * xs + 2 * kp + 1), ao[r][j]);
      }
    }
  }
  if (full < KP) {  // odd K: the last pair's k + 1 is zero padding in w and absent from x
    for (int j = 0; j < 2; ++j) {
      const __m256i wj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * j));
      const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(wj, 16));
      for (int r = 0; r < R; ++r)
        ae[r][j] = _mm256_fmadd_ps(e, _mm256_broadcast_ss(x + r * xs + 2 * full), ae[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc[r], _mm256_add_ps(ae[r][0], ao[r][0]));
    _mm256_storeu_ps(acc[r] + 8, _mm256_add_ps(ae[r][1], ao[r][1]));
  }
}

// Rows [m0, m1) of x (at most ITEM_PASSES_F32 passes) against one tile: y[r, n0 + j] for the
// tile's outputs (row stride N); gated: half 0 is the gate, half 1 the up projection of outputs
// [n0, n0 + 16). Each half is read from memory by the first pass and from L1 by the rest, which
// prefetch the next tile's half (`next`, or null) meanwhile.
template <bool Gated>
void tile_f32(const float* x, int64_t xs, const uint16_t* w, const uint16_t* next, int64_t KP,
              int64_t K, const float* bias, float* y, int64_t N, int64_t n0, int64_t m0,
              int64_t m1) {
  float acc[2][ITEM_PASSES_F32 * PASS_ROWS_F32][16];
  const int halves = Gated || n0 + 16 < N ? 2 : 1;
  for (int s = 0; s < halves; ++s) {
    for (int64_t m = m0; m < m1; m += PASS_ROWS_F32) {
      const uint16_t* pf = m == m0 + PASS_ROWS_F32 ? next : nullptr;
      if (m + 2 <= m1)
        half_tile_rows<2>(x + m * xs, xs, w, KP, K, s, acc[s] + (m - m0), pf);
      else
        half_tile_rows<1>(x + m * xs, xs, w, KP, K, s, acc[s] + (m - m0), pf);
    }
  }
  if constexpr (Gated) {
    const int64_t cnt = std::min<int64_t>(16, N - n0);
    const vf bg = bias ? load_v(bias + n0, cnt) : vf{};
    const vf bu = bias ? load_v(bias + N + n0, cnt) : vf{};
    for (int64_t r = 0; r < m1 - m0; ++r) {
      const vf g = load_v(acc[0][r]) + bg, u = load_v(acc[1][r]) + bu;
      store_v(y + (m0 + r) * N + n0, (g / (1.f + exp_v(-g))) * u, cnt);
    }
    return;
  }
  for (int j = 0; j < halves; ++j) {
    const int64_t n = n0 + 16 * j;
    const int64_t cnt = std::min<int64_t>(16, N - n);
    const vf bv = bias ? load_v(bias + n, cnt) : vf{};
    for (int64_t r = 0; r < m1 - m0; ++r)
      store_v(y + (m0 + r) * N + n, load_v(acc[j][r]) + bv, cnt);
  }
}

// As `linear_packed`, for fp32 x [M, K] (row stride xs) and y [M, N]: work items are (tile,
// chunk of at most ITEM_PASSES_F32 passes), tile-major.
template <bool Gated>
void linear_packed_f32(const float* x, int64_t xs, const uint16_t* w, const float* bias,
                       float* y, int64_t M, int64_t N, int64_t K, int64_t KP) {
  constexpr int64_t tile_out = Gated ? TILE_N / 2 : TILE_N;
  const int64_t NT = (N + tile_out - 1) / tile_out;
  const int64_t passes = (M + PASS_ROWS_F32 - 1) / PASS_ROWS_F32;
  const int64_t want = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t chunks = (passes + ITEM_PASSES_F32 - 1) / ITEM_PASSES_F32;
  while (NT * chunks < want && chunks < passes) chunks *= 2;
  chunks = std::min(chunks, passes);
  const int64_t per_chunk = (passes + chunks - 1) / chunks;
  at::parallel_for(0, NT * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks, c = i % chunks;
      const uint16_t* wt = w + t * KP * TILE_PAIR;
      const uint16_t* next = i + 1 < i1 && t + 1 < NT ? wt + KP * TILE_PAIR : nullptr;
      const int64_t m0 = std::min(M, c * per_chunk * PASS_ROWS_F32);
      const int64_t m1 = std::min(M, (c + 1) * per_chunk * PASS_ROWS_F32);
      if (m0 < m1) tile_f32<Gated>(x, xs, wt, next, KP, K, bias, y, N, t * tile_out, m0, m1);
    }
  });
}
#endif

#if defined(__AMX_BF16__)
constexpr int64_t kAmxMaxRows = 8;
#endif
#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kFp32MaxRows = 16;
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

// The same for fp32 inputs (CPUs without native bf16): every row count up to this one takes the
// fp32-activation path, the rest oneDNN's fp32 GEMM on its own packed fp32 copy; 0 where the
// build has no AVX2 + FMA. Measured on an AVX2 EPYC (2 threads, SmolLM2's layer linears): README,
// "CPU matmuls: bf16 only where the CPU has it".
int64_t linear_bf16_fp32_max_rows() {
#if defined(__AVX2__) && defined(__FMA__)
  return kFp32MaxRows;
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

// y [M, n] = x [M, K] @ W^T + b, W packed by `pack_bf16_linear` from an [n, K] weight; x bf16
// (AVX512_BF16; y bf16) or fp32 (AVX2 + FMA; y fp32); b: fp32 or bf16 [n], optional. Gated (W
// packed gated from [2n, K]): y = silu(g) * u with [g, u] = x @ W^T + b, b [2n].
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w_packed,
                       const std::optional<at::Tensor>& b, int64_t n, bool gated) {
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK((f32 || x.scalar_type() == at::kBFloat16) &&
                  w_packed.scalar_type() == at::kBFloat16,
              "linear_bf16: bf16 or fp32 x and bf16 w");
  TORCH_CHECK(x.dim() == 2, "linear_bf16: x must be [M, K]");
  TORCH_CHECK(w_packed.dim() == 3 && w_packed.size(2) == TILE_PAIR && w_packed.is_contiguous(),
              "linear_bf16: w must be packed by pack_bf16_linear ([NT, KP, 64])");
  const int64_t M = x.size(0), K = x.size(1), KP = w_packed.size(1);
  TORCH_CHECK(KP == (K + 1) / 2, "linear_bf16: x has ", K, " columns, w was packed for ", 2 * KP);
  const int64_t tile_out = gated ? TILE_N / 2 : TILE_N;
  TORCH_CHECK(n > 0 && (n + tile_out - 1) / tile_out == w_packed.size(0),
              "linear_bf16: n = ", n, " outputs do not match the packed weight's ",
              w_packed.size(0), " tiles");
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;  // a step with no rows to project (e.g. no logits wanted)
  at::Tensor bf;
  if (b.has_value()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == (gated ? 2 * n : n),
                "linear_bf16: b must be [n] ([2n] gated)");
    bf = b->to(at::kFloat).contiguous();
  }
  const float* bias = b.has_value() ? bf.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(w_packed.data_ptr<c10::BFloat16>());
  if (f32) {
#if defined(__AVX2__) && defined(__FMA__)
    at::Tensor xc = x.contiguous();
    auto* run = gated ? &linear_packed_f32<true> : &linear_packed_f32<false>;
    run(xc.data_ptr<float>(), K, wp, bias, y.data_ptr<float>(), M, n, K, KP);
#else
    TORCH_CHECK(false, "linear_bf16: fp32 inputs need AVX2 and FMA");
#endif
    return y;
  }
#if defined(__AVX512BF16__)
  at::Tensor xc = x.contiguous();
  if (K % 2) xc = at::constant_pad_nd(xc, {0, 1});  // the packed weight's zero K padding
  auto* run = gated ? &linear_packed<true> : &linear_packed<false>;
  run(reinterpret_cast<const uint32_t*>(xc.data_ptr<c10::BFloat16>()), wp, bias,
      reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()), M, n, KP);
#else
  TORCH_CHECK(false, "linear_bf16: bf16 inputs need AVX512_BF16 (this build has none)");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("pack_bf16_linear(Tensor w, bool gated=False) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w_packed, Tensor? b, int n, bool gated=False) -> Tensor");
  m.def("linear_bf16_max_rows() -> int", &linear_bf16_max_rows);
  m.def("linear_bf16_fp32_max_rows() -> int", &linear_bf16_fp32_max_rows);
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("pack_bf16_linear", &pack_bf16_linear);
  m.impl("linear_bf16", &linear_bf16);
}
