// Ops of the sampling step on CPU: the grammar's token bitmask applied to the logits, and the
// greedy rows' argmax.
//
// argmax_rows(logits) -> int64 [B]: per row the index of its first largest value, a NaN
// counting as the largest (torch.argmax's result, bit for bit); torch's CPU argmax takes
// ~700 us for 8 bf16 rows of 49152 here (~4% of a batch-8 decode step), this ~15 us. Without
// AVX-512, 8 lanes (AVX2 EPYC, 8 fp32 rows read from memory: 620 -> 125 us; it was scalar).
//
// apply_token_bitmask_(logits, bitmask, rows): for each r in rows, logits[r, t] = -inf wherever
// bit t % 32 of bitmask[r, t / 32] is 0 (xgrammar's layout; t < V). A grammar row allows a few
// hundred of ~50k tokens, so most words are 0 (16 lanes stored as -inf at once) and the rest are
// masked stores; an all-ones word is skipped; bf16 rows take one 32-lane masked store a word
// (8 rows of 49152: 234 -> 37 us; it was the scalar loop); without AVX-512, a 0 word is four
// 8-lane stores and another fp32 word four masked ones (AVX2 EPYC, 8 fp32 rows read from
// memory: 300 -> 90 us; it was the scalar loop); the threads split the vocabulary.
// Replaces xgrammar's CPU kernel (~50 us a row of SmolLM2's vocabulary here, ~2.7% of a
// batch-8 decode step for 8 rows).
// Twin: radixlm.runtime.grammar.bitmask.apply_token_bitmask_torch.
//
// redraw_row_(values, logits, greedy, u, min_mass, sums?) -> int: the verifier's resample of one row
// (radixlm.runtime.sampler.Sampler.redraw; its torch path is the twin). Wherever logits[t] is
// -inf (the grammar's mask and the refused tokens), values[t] becomes -inf (greedy: values are
// scores, the draw is their first argmax) or 0 (values are probabilities, the draw is the first
// t whose running sum exceeds u * total, inverse-CDF in vocabulary order as `pick`); -1 when no
// score is left or the mass left is under min_mass. One pass zeroes and sums blocks of 256, a
// second walks the block sums and then one block: ~10 us a row against ~130 us of torch ops.
// A sampled row's block sums go to `sums` when given, for redraw_removed_ (below): the next
// redraw of that row then sums only the blocks of the tokens removed since.
//
// sample_rows(x, temps, top_ks, top_ps, min_ps, u, probs) -> int64 [R]: the sampled rows of
// radixlm.runtime.sampler.Sampler._sample (its torch ops are the twin): probs[r] =
// softmax(x[r] / temps[r]) (a probability under e^-87 of the largest is 0, so a masked -inf
// logit is never drawn), min-p, top-k then top-p (`apply_top_k_top_p`'s rule; only the
// tokens that can be kept are sorted, found by a histogram of the probabilities), unnormalized,
// and the first token whose running mass exceeds u[r] * total (inverse-CDF in vocabulary order,
// as `pick`); -1 for a row that allows no token. With `sums` ([R, ceil(V / 256)] float64), each
// row's block sums of probs[r] as its walk used them: a kept row's first redraw then sums only
// the blocks of the tokens removed since (redraw_removed_), not the whole row again. A row
// without filters takes three passes (max, exp, the walk) instead of torch's six; one with
// top-p or top-k a few more instead of torch's top-k candidates or full sort. A row more than
// half -inf (a grammar's mask; counted in the max pass) stores 0 for whole -inf vectors
// without their exp (the same bits; 8 such rows of 49k ~2.3x faster on AVX2).

#pragma GCC optimize("fp-contract=off")  // vec.h's numerics

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec.h"

namespace {

// Words [w0, w1) of one row.
template <typename T>
void mask_row(T* lg, const uint32_t* bm, int64_t V, int64_t w0, int64_t w1) {
  const T ninf = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t w = w0; w < w1; ++w) {
    const uint32_t word = bm[w];
    if (word == 0xFFFFFFFFu) continue;
    const int64_t base = 32 * w;
    const int64_t n = std::min<int64_t>(32, V - base);
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (n == 32) {
        const __m512 ni = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        _mm512_mask_storeu_ps(lg + base, static_cast<__mmask16>(~word), ni);
        _mm512_mask_storeu_ps(lg + base + 16, static_cast<__mmask16>(~(word >> 16)), ni);
        continue;
      }
    }
#endif
#if defined(__AVX512BW__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (n == 32) {  // 32 bf16 lanes in one masked store; 0xFF80 is bf16 -inf
        const __m512i ni = _mm512_set1_epi16(static_cast<int16_t>(0xFF80));
        _mm512_mask_storeu_epi16(lg + base, static_cast<__mmask32>(~word), ni);
        continue;
      }
    }
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
    if (n == 32) {  // AVX2: a 0 word in plain stores, others blended 8 / 16 lanes at a time
      // NOTE: a blend and a plain store, not vmaskmov: AMD cores run masked stores microcoded
      // (8 fp32 rows of 49152 with mixed words: ~2x slower).
      if constexpr (std::is_same_v<T, float>) {
        const __m256 ni = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
        if (word == 0) {
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(lg + base + 8 * j, ni);
          continue;
        }
        const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (int j = 0; j < 4; ++j) {  // lanes whose bit is 0: all ones, -inf blended in
          const __m256i w8 = _mm256_set1_epi32(static_cast<int>((word >> (8 * j)) & 0xFFu));
          const __m256i off = _mm256_cmpeq_epi32(_mm256_and_si256(w8, bit), _mm256_setzero_si256());
          float* q = lg + base + 8 * j;
          _mm256_storeu_ps(q, _mm256_blendv_ps(_mm256_loadu_ps(q), ni, _mm256_castsi256_ps(off)));
        }
        continue;
      } else {  // bf16: 0xFF80 is -inf
        const __m256i ni = _mm256_set1_epi16(static_cast<int16_t>(0xFF80));
        if (word == 0) {
          for (int j = 0; j < 2; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(lg + base + 16 * j), ni);
          continue;
        }
        const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                              4096, 8192, 16384, static_cast<int16_t>(0x8000));
        for (int j = 0; j < 2; ++j) {
          const __m256i w16 =
              _mm256_set1_epi16(static_cast<int16_t>((word >> (16 * j)) & 0xFFFFu));
          const __m256i off =
              _mm256_cmpeq_epi16(_mm256_and_si256(w16, bit), _mm256_setzero_si256());
          auto* q = reinterpret_cast<__m256i*>(lg + base + 16 * j);
          _mm256_storeu_si256(q, _mm256_blendv_epi8(_mm256_loadu_si256(q), ni, off));
        }
        continue;
      }
    }
#endif
    for (int64_t i = 0; i < n; ++i)
      if (!((word >> i) & 1u)) lg[base + i] = ninf;
  }
}

void apply_token_bitmask_(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [B, V], rows contiguous");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [B, W]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be int64 [R]");
  const int64_t B = logits.size(0), V = logits.size(1), W = bitmask.size(1);
  TORCH_CHECK(32 * W >= V, "bitmask too narrow for the vocabulary");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t R = rows.size(0);
  for (int64_t i = 0; i < R; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < B && rp[i] < bitmask.size(0), "row ", rp[i], " out of range");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  const auto* bm = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t words = (V + 31) / 32;
  // The logits were just written by the LM head's threads, each a range of the vocabulary:
  // each thread masks a range of words of every row (the fresh logits are read from memory
  // otherwise: 8 fp32 rows of 49152 on one thread ~245 us in a step, ~135 us on two).
  at::parallel_for(0, words, R * words >= 4096 ? 256 : words, [&](int64_t w0, int64_t w1) {
    for (int64_t i = 0; i < R; ++i) {
      const int64_t r = rp[i];
      if (logits.scalar_type() == at::kFloat) {
        mask_row(logits.data_ptr<float>() + r * logits.stride(0), bm + r * W, V, w0, w1);
      } else {
        mask_row(logits.data_ptr<c10::BFloat16>() + r * logits.stride(0), bm + r * W, V, w0, w1);
      }
    }
  });
}

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// 16 values as fp32 (bf16: the 16 bits shifted into the high half, exact).
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__)
// 8 values as fp32 (bf16: the 16 bits shifted into the high half, exact).
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// The first index of the row's largest value (a NaN first if there is one).
template <typename T>
int64_t argmax_row(const T* x, int64_t V) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 mx = _mm512_set1_ps(best);
  __mmask16 nan = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = load16(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  if (nan) i = 0;  // a NaN: the scalar scan below finds the first one
  else best = _mm512_reduce_max_ps(mx);
#elif defined(__AVX2__)
  __m256 mx = _mm256_set1_ps(best), nan = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = load8(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  if (_mm256_movemask_ps(nan)) {
    i = 0;  // a NaN: the scalar scan below finds the first one
  } else {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    best = _mm_cvtss_f32(m4);
  }
#endif
  for (int64_t j = i; j < V; ++j) {
    const float v = as_float(x[j]);
    if (v != v) return j;
    if (v > best) best = v;
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(best);
  for (; j + 16 <= V; j += 16) {
    const __m512 v = load16(x + j);
    const __mmask16 eq = _mm512_cmp_ps_mask(v, b, _CMP_EQ_OQ);
    if (eq) return j + __builtin_ctz(static_cast<unsigned>(eq));
  }
#elif defined(__AVX2__)
  const __m256 b = _mm256_set1_ps(best);
  for (; j + 8 <= V; j += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + j), b, _CMP_EQ_OQ));
    if (eq) return j + __builtin_ctz(static_cast<unsigned>(eq));
  }
#endif
  for (; j < V; ++j)
    if (as_float(x[j]) == best) return j;
  return 0;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logits must be [B, V], rows contiguous");
  const int64_t B = logits.size(0), V = logits.size(1), rs = logits.stride(0);
  at::Tensor out = at::empty({B}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r) {
    if (logits.scalar_type() == at::kFloat) {
      o[r] = argmax_row(logits.data_ptr<float>() + r * rs, V);
    } else if (logits.scalar_type() == at::kBFloat16) {
      o[r] = argmax_row(logits.data_ptr<c10::BFloat16>() + r * rs, V);
    } else {
      TORCH_CHECK(false, "logits must be float32 or bfloat16");
    }
  }
  return out;
}

template <typename L>
inline bool is_ninf(L v) {
  return as_float(v) == -std::numeric_limits<float>::infinity();
}

constexpr int64_t kRedrawBlock = 256;

// p[t] = fill where logits[t] is -inf (a removed token).
template <typename L>
void fill_removed(float* p, const L* lg, int64_t V, float fill) {
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 f = _mm512_set1_ps(fill);
  for (; t + 16 <= V; t += 16)
    _mm512_mask_storeu_ps(p + t, _mm512_cmp_ps_mask(load16(lg + t), ninf, _CMP_EQ_OQ), f);
#elif defined(__AVX2__)
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 f = _mm256_set1_ps(fill);
  for (; t + 8 <= V; t += 8) {  // a blend, not vmaskmov (see mask_row)
    const __m256 removed = _mm256_cmp_ps(load8(lg + t), ninf, _CMP_EQ_OQ);
    _mm256_storeu_ps(p + t, _mm256_blendv_ps(_mm256_loadu_ps(p + t), f, removed));
  }
#endif
  for (; t < V; ++t)
    if (is_ninf(lg[t])) p[t] = fill;
}

// The sum (double) of block b of p: one fixed order, so a block summed again alone (after a
// token in it was removed) gives the bits a pass over the whole row would.
double block_sum(const float* p, int64_t V, int64_t b) {
  const int64_t lo = b * kRedrawBlock, hi = std::min(V, lo + kRedrawBlock);
  Sum16 acc;
  int64_t t = lo;
  for (; t + 16 <= hi; t += 16)
    for (int j = 0; j < Sum16::kVecs; ++j) acc.v[j] += load_v(p + t + j * W);
  double s = acc.total<double>();
  for (; t < hi; ++t) s += p[t];
  return s;
}

// Block sums of p (double) into sums; returns their total. With lg, each block's removed
// tokens are zeroed first (fill_removed, one pass over the row instead of two).
template <typename L = float>
double block_sums(float* p, int64_t V, std::vector<double>& sums, const L* lg = nullptr) {
  const int64_t nb = (V + kRedrawBlock - 1) / kRedrawBlock;
  sums.assign(nb, 0.0);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kRedrawBlock, hi = std::min(V, lo + kRedrawBlock);
    if (lg != nullptr) fill_removed(p + lo, lg + lo, hi - lo, 0.f);
    sums[b] = block_sum(p, V, b);
    total += sums[b];
  }
  return total;
}

// The first t with running mass > target over p (block sums given), else the last t with mass.
int64_t walk(const float* p, int64_t V, const std::vector<double>& sums, double target) {
  double run = 0.0;
  int64_t last = -1;
  for (int64_t b = 0; b < static_cast<int64_t>(sums.size()); ++b) {
    if (sums[b] > 0) last = b;
    if (run + sums[b] <= target) {
      run += sums[b];
      continue;
    }
    const int64_t lo = b * kRedrawBlock, hi = std::min(V, lo + kRedrawBlock);
    for (int64_t t = lo; t < hi; ++t) {
      run += p[t];
      if (run > target && p[t] > 0) return t;
    }
  }
  if (last < 0) return -1;
  for (int64_t t = std::min(V, (last + 1) * kRedrawBlock) - 1; t >= last * kRedrawBlock; --t)
    if (p[t] > 0) return t;
  return -1;
}

template <typename L>
int64_t redraw_row(float* p, const L* lg, int64_t V, bool greedy, double u, double min_mass,
                   double* keep_sums) {
  if (greedy) {
    fill_removed(p, lg, V, -std::numeric_limits<float>::infinity());
    const int64_t best = argmax_row(p, V);
    return is_ninf(p[best]) ? -1 : best;
  }
  std::vector<double> sums;
  const double total = block_sums(p, V, sums, lg);
  if (keep_sums != nullptr) std::copy(sums.begin(), sums.end(), keep_sums);
  if (!(total >= min_mass)) return -1;
  return walk(p, V, sums, u * total);
}

// redraw_removed_(values, sums, removed, u, min_mass) -> int: a sampled row's next redraw when
// only the tokens `removed` left the row since the last one (values and their block sums `sums`
// as that redraw_row_ / redraw_removed_ left them): those tokens zeroed, their blocks summed
// again alone, then the same walk. The same token as redraw_row_ on the masked logits (the
// same sums, bit for bit), without its pass over the row.
int64_t redraw_removed_(at::Tensor values, at::Tensor sums, const at::Tensor& removed, double u,
                        double min_mass) {
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && values.scalar_type() == at::kFloat,
              "values must be a contiguous float32 [V]");
  const int64_t V = values.size(0), nb = (V + kRedrawBlock - 1) / kRedrawBlock;
  TORCH_CHECK(sums.dim() == 1 && sums.is_contiguous() && sums.scalar_type() == at::kDouble &&
                  sums.size(0) == nb,
              "sums must be a contiguous float64 [ceil(V / 256)]");
  TORCH_CHECK(removed.dim() == 1 && removed.scalar_type() == at::kLong, "removed must be int64");
  float* p = values.data_ptr<float>();
  double* s = sums.data_ptr<double>();
  const int64_t* rm = removed.data_ptr<int64_t>();
  for (int64_t i = 0; i < removed.size(0); ++i)
    TORCH_CHECK(rm[i] >= 0 && rm[i] < V, "removed token ", rm[i], " out of range");
  for (int64_t i = 0; i < removed.size(0); ++i) p[rm[i]] = 0.f;
  for (int64_t i = 0; i < removed.size(0); ++i) {
    const int64_t b = rm[i] / kRedrawBlock;
    s[b] = block_sum(p, V, b);
  }
  std::vector<double> block(s, s + nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) total += block[b];
  if (!(total >= min_mass)) return -1;
  return walk(p, V, block, u * total);
}

int64_t redraw_row_(at::Tensor values, const at::Tensor& logits, bool greedy, double u,
                    double min_mass, const std::optional<at::Tensor>& sums) {
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && values.scalar_type() == at::kFloat,
              "values must be a contiguous float32 [V]");
  TORCH_CHECK(logits.dim() == 1 && logits.is_contiguous() && logits.size(0) == values.size(0),
              "logits must be a contiguous [V] like values");
  const int64_t V = values.size(0);
  TORCH_CHECK(V > 0, "empty row");
  float* p = values.data_ptr<float>();
  double* keep = nullptr;  // the block sums, for redraw_removed_ (sampled rows)
  if (sums.has_value() && sums->defined()) {
    TORCH_CHECK(sums->dim() == 1 && sums->is_contiguous() && sums->scalar_type() == at::kDouble &&
                    sums->size(0) == (V + kRedrawBlock - 1) / kRedrawBlock,
                "sums must be a contiguous float64 [ceil(V / 256)]");
    keep = sums->data_ptr<double>();
  }
  if (logits.scalar_type() == at::kFloat)
    return redraw_row(p, logits.data_ptr<float>(), V, greedy, u, min_mass, keep);
  if (logits.scalar_type() == at::kBFloat16)
    return redraw_row(p, logits.data_ptr<c10::BFloat16>(), V, greedy, u, min_mass, keep);
  TORCH_CHECK(false, "logits must be float32 or bfloat16");
}



// The tokens top-k then top-p keep of p (mass `total`, unnormalized, no NaN), as
// `apply_top_k_top_p` does on a full stable descending sort: the k most likely, then the
// shortest prefix of those whose probability (over the top-k mass) before a token stays under
// top_p; the first is always kept. Only the tokens that can be kept are sorted: a histogram of p
// by its float bits (monotone for p >= 0) finds the buckets the kept tokens lie in. Zeroes the
// rest of p in place.
void keep_top_k_top_p(float* p, int64_t V, double total, int64_t k, double top_p) {
  constexpr int kShift = 19;  // sign 0, exponent and 4 mantissa bits: 4096 buckets
  constexpr int kBuckets = 1 << (31 - kShift);
  std::vector<int64_t> count(kBuckets, 0);
  std::vector<double> mass(kBuckets, 0.0);
  for (int64_t t = 0; t < V; ++t) {
    if (p[t] > 0) {
      uint32_t bits;
      std::memcpy(&bits, p + t, 4);
      count[bits >> kShift] += 1;
      mass[bits >> kShift] += p[t];
    }
  }
  // The lowest bucket the kept tokens may reach: where the count reaches k (top-k) and where
  // the mass reaches top_p of the total (the nucleus needs at most that: its norm, the top-k
  // mass, is at most the total).
  const bool by_k = k < V;
  int floor_k = 0, floor_p = 0;
  int64_t c = 0;
  double mcum = 0.0;
  bool found_k = !by_k, found_p = !(top_p < 1.0);
  for (int bkt = kBuckets - 1; bkt >= 0 && !(found_k && found_p); --bkt) {
    c += count[bkt];
    mcum += mass[bkt];
    if (!found_k && c >= k) found_k = true, floor_k = bkt;
    if (!found_p && mcum >= top_p * total) found_p = true, floor_p = bkt;
  }
  // With top-k the whole top-k set is needed (its mass normalizes top-p).
  const int lowest = by_k ? floor_k : floor_p;
  std::vector<std::pair<float, int64_t>> cand;
  for (int64_t t = 0; t < V; ++t) {
    if (p[t] > 0) {
      uint32_t bits;
      std::memcpy(&bits, p + t, 4);
      if (static_cast<int>(bits >> kShift) >= lowest) cand.emplace_back(p[t], t);
    }
  }
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  const int64_t n = static_cast<int64_t>(cand.size());
  int64_t kept = std::min<int64_t>(n, by_k ? k : n);
  if (top_p < 1.0) {
    double norm = 0.0;
    for (int64_t j = 0; j < kept; ++j) norm += cand[j].first;
    norm = by_k ? norm : total;  // the mass of the top-k set when it is known, else the row's
    double before = 0.0;
    int64_t j = 0;
    for (; j < kept; ++j) {
      if (j > 0 && before / norm >= top_p) break;
      before += cand[j].first;
    }
    kept = std::max<int64_t>(j, 1);
  }
  std::vector<uint8_t> keep(V, 0);
  for (int64_t j = 0; j < kept; ++j) keep[cand[j].second] = 1;
  for (int64_t t = 0; t < V; ++t)
    if (!keep[t]) p[t] = 0.f;
}

// exp((v - m) * inv), 0 under e^-87.3 (-inf included: what fp32's exp would flush) and under
// the min-p floor.
inline vf exp_masked(vf v, float m, float inv, float floor) {
  const vf d = (v - m) * inv;
  vf e = exp_v(d);
  e = d < -87.33654f ? splat(0.f) : e;
  return e < floor ? splat(0.f) : e;
}

// All W lanes of v are -inf.
inline bool all_ninf(vf v) {
  const vi eq = (v == splat(-std::numeric_limits<float>::infinity()));
#if defined(__AVX512F__)
  return _mm512_movepi32_mask(reinterpret_cast<__m512i>(eq)) == 0xFFFF;
#elif defined(__AVX2__)
  return _mm256_movemask_ps(reinterpret_cast<__m256>(eq)) == 0xFF;
#else
  for (int j = 0; j < W; ++j)
    if (!eq[j]) return false;
  return true;
#endif
}

// One row: p = exp((x - max) / T) (0 under e^-87 of the max: -inf never drawn), min-p, top-k /
// top-p, then the inverse-CDF walk at u of what is left. -1: nothing allowed.
int64_t sample_row(const float* x, int64_t V, float temp, int64_t k, float top_p, float min_p,
                   double u, float* p, double* keep_sums) {
  const vf ninf = splat(-std::numeric_limits<float>::infinity());
  vf mx = ninf;
  vi masked{};  // per lane: minus the number of -inf values (a grammar's masked tokens)
  int64_t i = 0;
  for (; i + W <= V; i += W) {
    const vf v = load_v(x + i);
    mx = v > mx ? v : mx;
    masked += (v == ninf);
  }
  float m = mx[0];
  for (int j = 1; j < W; ++j) m = std::max(m, mx[j]);
  for (; i < V; ++i) m = std::max(m, x[i]);
  if (!(m > -std::numeric_limits<float>::infinity())) return -1;  // nothing allowed (or NaN)
  int64_t num_masked = 0;
  for (int j = 0; j < W; ++j) num_masked -= masked[j];
  const float inv = 1.f / temp;
  const float floor = min_p > 0 ? min_p : 0.f;  // min-p: p < min_p * max (the max is e^0 = 1)
  // A mostly masked row (a grammar's) skips the exp of whole -inf vectors (their 0 is stored:
  // the same bits); the test would slow the loop of an unmasked row, which keeps the plain one.
  if (2 * num_masked > V) {
    for (int64_t t = 0; t < V; t += W) {
      const int64_t n = std::min<int64_t>(W, V - t);
      const vf v = load_v(x + t, n);
      if (n == W && all_ninf(v)) {
        store_v(p + t, splat(0.f), n);
        continue;
      }
      store_v(p + t, exp_masked(v, m, inv, floor), n);
    }
  } else {
    for (int64_t t = 0; t < V; t += W) {
      const int64_t n = std::min<int64_t>(W, V - t);
      store_v(p + t, exp_masked(load_v(x + t, n), m, inv, floor), n);
    }
  }
  std::vector<double> sums;
  double total = block_sums(p, V, sums);
  if (k < V || top_p < 1.f) {
    keep_top_k_top_p(p, V, total, k, top_p);
    total = block_sums(p, V, sums);
  }
  if (keep_sums != nullptr) std::copy(sums.begin(), sums.end(), keep_sums);
  return walk(p, V, sums, u * total);
}

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temps, const at::Tensor& top_ks,
                       const at::Tensor& top_ps, const at::Tensor& min_ps, const at::Tensor& u,
                       const at::Tensor& probs, const std::optional<at::Tensor>& sums) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "x must be a float32 [R, V] with contiguous rows");
  const int64_t R = x.size(0), V = x.size(1);
  for (const at::Tensor* t : {&temps, &top_ps, &min_ps, &u})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == R,
                "temps, top_ps, min_ps and u must be contiguous float32 [R]");
  TORCH_CHECK(top_ks.scalar_type() == at::kLong && top_ks.is_contiguous() && top_ks.numel() == R,
              "top_ks must be a contiguous int64 [R]");
  TORCH_CHECK(probs.scalar_type() == at::kFloat && probs.is_contiguous() &&
                  probs.dim() == 2 && probs.size(0) == R && probs.size(1) == V,
              "probs must be a contiguous float32 [R, V]");
  TORCH_CHECK(V > 0, "empty rows");
  const int64_t nb = (V + kRedrawBlock - 1) / kRedrawBlock;
  double* sp = nullptr;
  if (sums.has_value() && sums->defined()) {
    TORCH_CHECK(sums->scalar_type() == at::kDouble && sums->is_contiguous() && sums->dim() == 2 &&
                    sums->size(0) == R && sums->size(1) == nb,
                "sums must be a contiguous float64 [R, ceil(V / 256)]");
    sp = sums->data_ptr<double>();
  }
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const float *tp = temps.data_ptr<float>(), *pp_ = top_ps.data_ptr<float>();
  const float *mp = min_ps.data_ptr<float>(), *up = u.data_ptr<float>();
  const int64_t* kp = top_ks.data_ptr<int64_t>();
  float* pp = probs.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      o[r] = sample_row(xp + r * xs, V, tp[r], kp[r] < 1 ? V : std::min(kp[r], V), pp_[r], mp[r],
                        up[r], pp + r * V, sp == nullptr ? nullptr : sp + r * nb);
  });
  return out;  // -1 where a row allows no token: the caller decides (one row, not the batch)
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def(
      "redraw_row_(Tensor(a!) values, Tensor logits, bool greedy, float u, float min_mass, "
      "Tensor(b!)? sums=None) -> int");
  m.def(
      "redraw_removed_(Tensor(a!) values, Tensor(b!) sums, Tensor removed, float u, "
      "float min_mass) -> int");
  m.def(
      "sample_rows(Tensor x, Tensor temps, Tensor top_ks, Tensor top_ps, Tensor min_ps, Tensor u, "
      "Tensor(a!) probs, Tensor(b!)? sums=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("redraw_row_", &redraw_row_);
  m.impl("redraw_removed_", &redraw_removed_);
  m.impl("sample_rows", &sample_rows);
}
