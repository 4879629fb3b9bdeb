// Paged attention on CPU that reads K/V where they lie (no gather copy).
//
// Layout (see radixlm/kernels/forward_batch.py): the K/V of layer l are [num_slots, Hkv, D];
// token j of request r lives at slot page_table[r, j / page_size] * page_size + j % page_size.
//
// The host plans once per forward a list of work items (int32 [N, 7]):
//   (req, row0, nq, pos0, kv_lo, kv_hi, part)
// meaning: query rows row0 .. row0 + nq - 1 of q (at positions pos0 .. pos0 + nq - 1 of request
// req) attend to the keys at positions [kv_lo, min(kv_hi, pos0 + nq)), causally (a query at
// position p sees keys <= p), and with a sliding window W > 0 only keys > p - W (the host plans
// kv_lo >= pos0 - W + 1; rows after the first are masked per row). part < 0: the normalized
// output goes to out; part >= 0: the item is one split of a split-KV decode, its normalized
// output and log2-sum-exp go to the partial buffers at index part, and a reduce item
// (row, part0, nparts) combines them. nq < 0 is a shared-prefix item: the -nq decode rows
// listed at item_rows[row0 + 1 ..] (different requests on the same leading pages) attend to
// keys [kv_lo, kv_hi) together; row i's partial goes to part + i * item_rows[row0]
// (radixlm/kernels/cpu/plan.py plans them).
//
// Each item is one task over all KV heads: a key block is read as whole [Hkv, D] rows (a page
// is one sequential run of memory), and the G = Hq / Hkv query heads that share a KV head are
// processed together, so every K/V row is loaded (and converted to fp32) once. Online
// softmax (flash attention) over key blocks of BLOCK_K, fp32 accumulation, exp2 domain. Tasks are
// handed out dynamically (atomic counter) to torch's intra-op threads (at::parallel_for).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int BLOCK_K = 64;  // keys per online-softmax block
constexpr int VW = 8;        // floats per vector (256-bit; AVX2 and up)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// GCC/Clang vector extensions: the compiler emits AVX2 / AVX-512VL code for -march=native.
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int32_t i8v __attribute__((vector_size(32)));
typedef uint32_t u8v __attribute__((vector_size(32)));
typedef uint16_t h8u __attribute__((vector_size(16), aligned(2)));

inline v8 load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void store(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }
inline v8 bcast(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float hsum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}
inline float hmax(v8 v) {
  float m = v[0];
  for (int i = 1; i < VW; ++i) m = std::max(m, v[i]);
  return m;
}

// VW elements of a K/V row as fp32.
inline v8 load_f(const float* p) { return load(p); }
inline v8 load_f(const c10::BFloat16* p) {
  const h8u h = *reinterpret_cast<const h8u*>(p);
  return reinterpret_cast<v8>(__builtin_convertvector(h, u8v) << 16);
}
inline v8 load_f(const c10::Half* p) {
#if defined(__F16C__)
  return reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  v8 r;
  for (int i = 0; i < VW; ++i) r[i] = static_cast<float>(p[i]);
  return r;
#endif
}

// 2^x for x <= 0 (x may be -inf: 0). Round-to-nearest via the 1.5 * 2^23 trick, r in
// [-0.5, 0.5], degree-7 Taylor of e^(r ln 2): relative error < 1e-8.
inline v8 exp2v(v8 x) {
  const v8 lo = bcast(-127.f);
  const v8 xc = x < lo ? lo : x;
  const v8 magic = bcast(12582912.f);
  const v8 t = xc + magic;
  const v8 n = t - magic;
  const v8 r = (xc - n) * 0.6931471805599453f;
  v8 p = bcast(1.f / 5040.f);
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const i8v e = (reinterpret_cast<i8v>(t) - 0x4B400000 + 127) << 23;
  const v8 y = p * reinterpret_cast<v8>(e);
  return x <= lo ? v8{} : y;
}
inline float exp2s(float x) { return exp2v(bcast(x))[0]; }

template <typename T>
inline void store_out(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

struct Dims {
  int64_t hq, hkv, d, group, page_size, window;  // window 0: full attention
  int64_t q_s0, q_s1, o_s0, o_s1, kv_s0, kv_s1, pt_s0;
  int64_t layout;  // KV_FLAT or KV_PAIRS16 (see paged_attention below)
};

// K/V storage layouts. KV_FLAT: slot s, head h, dim d at (s * Hkv + h) * D + d. KV_PAIRS16 (bf16
// only; page_size % 16 == 0): slots in aligned blocks of 16, block b = s / 16 at b * 16 * Hkv * D,
// head h at + h * 16 * D, then, with o = s % 16: K as (d, d + 1) pairs over the 16 keys,
// + (d / 2) * 32 + 2 * o + d % 2 (a key block is K^T: D/2 rows of 16 uint32 pairs); V as
// (key 2i, key 2i + 1) pairs, + (o / 2) * 2 * D + 2 * d + o % 2 (8 rows of D uint32 pairs). Both
// are exactly the operand layouts of vdpbf16ps, so the kernels read them with plain loads.
constexpr int64_t KV_FLAT = 0, KV_PAIRS16 = 1;

// Per-thread scratch, sized for the largest task of a call (all fp32). Rows are ordered
// (kv head, query, head in group); kf / kt / vf hold one key block per KV head.
struct Scratch {
  std::vector<float> qf, acc, m, l, lv, alpha, s, kf, kt, vf;
  std::vector<int64_t> bases;  // KV_PAIRS16: element offset of each key block of a task
  void reserve(int64_t rows, int64_t hkv, int64_t d) {
    qf.assign(rows * d, 0.f);
    acc.assign(rows * d, 0.f);
    m.assign(rows, 0.f);
    l.assign(rows, 0.f);
    lv.assign(16 * rows, 0.f);
    alpha.assign(rows, 0.f);
    s.assign(rows * BLOCK_K, 0.f);
    kf.assign(hkv * BLOCK_K * d, 0.f);
    kt.assign(hkv * BLOCK_K * d, 0.f);
    vf.assign(hkv * BLOCK_K * d, 0.f);
  }
};

// [sum(a0), ..., sum(a7)]: eight horizontal sums at once.
inline v8 hsum8(const v8* a) {
#if defined(__AVX__)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return v8(_mm256_permute2f128_ps(u0, u1, 0x20)) + v8(_mm256_permute2f128_ps(u0, u1, 0x31));
#else
  v8 r;
  for (int i = 0; i < VW; ++i) r[i] = hsum(a[i]);
  return r;
#endif
}

// S[r, 0:n8] = q[r] . K[j] for few rows (decode), eight keys at a time (n8 = n rounded up to 8:
// kf rows n..n8 hold stale finite values whose scores are masked later). kf: [BLOCK_K, D] fp32.
inline void scores_dot(const float* qf, int64_t rows, const float* kf, int64_t n, int64_t D,
                       float* s) {
  for (int64_t j = 0; j < n; j += VW) {
    const float* k = kf + j * D;
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = qf + r * D;
      v8 a[VW];
      for (int i = 0; i < VW; ++i) a[i] = v8{};
      for (int64_t d = 0; d < D; d += VW) {
        const v8 qv = load(q + d);
        for (int i = 0; i < VW; ++i) a[i] += qv * load(k + i * D + d);
      }
      store(s + r * BLOCK_K + j, hsum8(a));
    }
  }
}

// S[r, 0:BLOCK_K] = q[r] . K for many rows (extend): a register tile of RM rows x 16 keys over
// the transposed block kt [D, BLOCK_K] (columns >= n hold stale values; they are masked later).
template <int RM>
inline void scores_tile(const float* qf, const float* kt, int64_t D, float* s) {
  for (int j = 0; j < BLOCK_K; j += 2 * VW) {
    v8 a[RM][2];
    for (int r = 0; r < RM; ++r) a[r][0] = a[r][1] = v8{};
    for (int64_t d = 0; d < D; ++d) {
      const v8 k0 = load(kt + d * BLOCK_K + j), k1 = load(kt + d * BLOCK_K + j + VW);
      for (int r = 0; r < RM; ++r) {
        const v8 q = bcast(qf[r * D + d]);
        a[r][0] += q * k0;
        a[r][1] += q * k1;
      }
    }
    for (int r = 0; r < RM; ++r) {
      store(s + r * BLOCK_K + j, a[r][0]);
      store(s + r * BLOCK_K + j + VW, a[r][1]);
    }
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j P[r, j] V[j] for RM rows, 16 columns of D at a time.
template <int RM>
inline void pv_tile(float* acc, const float* alpha, const float* p, const float* vf, int64_t n,
                    int64_t D) {
  for (int64_t d = 0; d < D; d += 2 * VW) {
    v8 a[RM][2];
    for (int r = 0; r < RM; ++r) {
      a[r][0] = load(acc + r * D + d) * alpha[r];
      a[r][1] = load(acc + r * D + d + VW) * alpha[r];
    }
    for (int64_t j = 0; j < n; ++j) {
      const v8 v0 = load(vf + j * D + d), v1 = load(vf + j * D + d + VW);
      for (int r = 0; r < RM; ++r) {
        const v8 w = bcast(p[r * BLOCK_K + j]);
        a[r][0] += w * v0;
        a[r][1] += w * v1;
      }
    }
    for (int r = 0; r < RM; ++r) {
      store(acc + r * D + d, a[r][0]);
      store(acc + r * D + d + VW, a[r][1]);
    }
  }
}

// Row tiles of RM_MAX rows, then one tile for the rest.
constexpr int RM_MAX = 6;  // 6 rows x 2 vectors = 12 accumulators (of 16 AVX2 registers)

template <typename Tile>
inline void by_row_tiles(int64_t rows, Tile tile) {
  int64_t r = 0;
  for (; r + RM_MAX <= rows; r += RM_MAX) tile(r, std::integral_constant<int, RM_MAX>{});
  switch (rows - r) {
    case 1: tile(r, std::integral_constant<int, 1>{}); break;
    case 2: tile(r, std::integral_constant<int, 2>{}); break;
    case 3: tile(r, std::integral_constant<int, 3>{}); break;
    case 4: tile(r, std::integral_constant<int, 4>{}); break;
    case 5: tile(r, std::integral_constant<int, 5>{}); break;
    default: break;
  }
}


#if defined(__AVX512BF16__)
// ---- Decode rows over bf16 K/V with AVX512_BF16 dot products (vdpbf16ps) ------------------------
//
// A decode item (one query row) reads each K/V row once per KV head and uses it for the G query
// heads of its group. Instead of converting the block to fp32 and multiplying in fp32, the dot
// products run on the bf16 values directly: q . k as pairs of bf16 products accumulated in fp32
// (exact products; q is the bf16 query, the softmax scale is applied to the fp32 score), and
// P @ V with P rounded to bf16 (as GPU flash attention does), accumulated in fp32.
constexpr int DKB = 16;  // keys per block: one 16-lane score vector per query head

inline __m512bh load_bh(const c10::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// The accumulators of P @ V hold d in the order the 16-bit unpacks leave it: vector 2c (lo) lane
// k is d = 32c + 8(k / 4) + k % 4, vector 2c + 1 (hi) the same + 4.
inline int64_t acc_d(int64_t vec, int64_t k) {
  return 32 * (vec / 2) + 8 * (k / 4) + k % 4 + 4 * (vec % 2);
}

constexpr int DEC_MAX_G = 8;   // query heads per KV head handled here (else the generic path)
constexpr int DEC_MAX_C = 8;   // head dim / 32 (head dim <= 256)
constexpr int DEC_PF = 1;      // key blocks prefetched ahead

bool decode_bf16_fits(const Dims& dm) {
  return dm.group <= DEC_MAX_G && dm.d % 32 == 0 && dm.d / 32 <= DEC_MAX_C;
}

// One decode task: the query rows rows[0 .. m - 1] (m = 1 for a plain decode row; m > 1 for a
// shared-prefix item: rows of different requests over the same pages) attend to keys
// [kv_lo, kv_hi) of request req's pages, no causal mask (every key is before every query).
// Each K/V block is loaded once for all m rows. Output: part < 0 -> out; else row r's
// normalized output and log2-sum-exp go to partial index part + r * pstride.
// G (query heads per KV head) and C (head dim / 32) are compile-time so the P @ V
// accumulators (G x 2C vectors) live in registers.
template <int G, int C>
void decode_rows_bf16(const int32_t* rows, int64_t m, int64_t req, int64_t kv_lo, int64_t kv_hi,
                      int64_t part, int64_t pstride, const c10::BFloat16* q,
                      const c10::BFloat16* k_buf, const c10::BFloat16* v_buf,
                      const int32_t* page_table, c10::BFloat16* out, float* part_o,
                      float* part_lse, const Dims& dm, float qscale, Scratch& sc) {
  constexpr int64_t D = 32 * C;
  const int64_t H = dm.hkv, HQ = dm.hq;
  const int32_t* pages = page_table + req * dm.pt_s0;
  const int64_t ps = dm.page_size;
  float* acc = sc.acc.data();  // [m, Hq, D] in acc_d order
  float* mrow = sc.m.data();   // [m, Hq]
  float* lrow = sc.l.data();
  std::fill(acc, acc + m * HQ * D, 0.f);
  std::fill(mrow, mrow + m * HQ, NEG_INF);
  std::fill(lrow, lrow + m * HQ, 0.f);
  const c10::BFloat16* krow[DKB];
  const c10::BFloat16* vrow[DKB];
  alignas(64) float s[DKB];
  alignas(64) float p[DKB];
  uint32_t pair[G][DKB / 2];
  float alpha[G];
  // (page, off) of the next key; advanced key by key (no division per key). The prefetch
  // cursor runs one block ahead.
  int64_t page = kv_lo / ps, off = kv_lo % ps;
  int64_t ppage = page, poff = off;
  auto next_slot = [&](int64_t& pg, int64_t& of) {
    const int64_t slot = static_cast<int64_t>(pages[pg]) * ps + of;
    if (++of == ps) of = 0, ++pg;
    return slot;
  };
  const int64_t row_bytes = H * D * 2;
  auto prefetch_next = [&]() {
    const int64_t slot = next_slot(ppage, poff);
    const char* kp = reinterpret_cast<const char*>(k_buf + slot * dm.kv_s0);
    const char* vp = reinterpret_cast<const char*>(v_buf + slot * dm.kv_s0);
    for (int64_t b = 0; b < row_bytes; b += 64) {
      __builtin_prefetch(kp + b);
      __builtin_prefetch(vp + b);
    }
  };
  for (int64_t pos = kv_lo; pos < std::min<int64_t>(kv_hi, kv_lo + DEC_PF * DKB); ++pos)
    prefetch_next();
  for (int64_t j0 = kv_lo; j0 < kv_hi; j0 += DKB) {
    const int64_t n = std::min<int64_t>(DKB, kv_hi - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t slot = next_slot(page, off);
      krow[jj] = k_buf + slot * dm.kv_s0;
      vrow[jj] = v_buf + slot * dm.kv_s0;
    }
    for (int64_t jj = n; jj < DKB; ++jj) krow[jj] = vrow[jj] = nullptr;
    // Scattered pages: prefetch the next block's rows while this one is computed.
    for (int64_t pos = j0 + DEC_PF * DKB;
         pos < std::min<int64_t>(kv_hi, j0 + (DEC_PF + 1) * DKB); ++pos)
      prefetch_next();
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t r = 0; r < m; ++r) {
        const c10::BFloat16* qrow = q + rows[r] * dm.q_s0;
        float* mr = mrow + r * HQ;
        float* lr = lrow + r * HQ;
        float* ar = acc + r * HQ * D;
        for (int g = 0; g < G; ++g) {
          const int64_t hq = h * G + g;
          const c10::BFloat16* qh = qrow + hq * dm.q_s1;
          __m512bh qv[C];
          for (int c = 0; c < C; ++c) qv[c] = load_bh(qh + 32 * c);
          __m512 dots[DKB];
          for (int64_t jj = 0; jj < DKB; ++jj) {
            __m512 a = _mm512_setzero_ps();
            if (jj < n) {
              const c10::BFloat16* kh = krow[jj] + h * dm.kv_s1;
              for (int c = 0; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[c], load_bh(kh + 32 * c));
            }
            dots[jj] = a;
          }
          const __m512 sv = _mm512_mul_ps(radixlm_cpu::hsum16x16(dots), _mm512_set1_ps(qscale));
          const __mmask16 valid = n == DKB ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
          const __m512 sm = _mm512_mask_blend_ps(valid, _mm512_set1_ps(NEG_INF), sv);
          _mm512_store_ps(s, sm);
          const float m_new = std::max(mr[hq], _mm512_reduce_max_ps(sm));
          alpha[g] = mr[hq] == NEG_INF ? 0.f : exp2s(mr[hq] - m_new);
          const v8 mb = bcast(m_new);
          const v8 e0 = exp2v(load(s) - mb), e1 = exp2v(load(s + VW) - mb);
          store(p, e0);
          store(p + VW, e1);
          lr[hq] = lr[hq] * alpha[g] + hsum(e0 + e1);
          mr[hq] = m_new;
          // P rounded to bf16, two keys per 32-bit lane: (p[j], p[j + 1])
          const __m256bh pb = _mm512_cvtneps_pbh(_mm512_load_ps(p));
          std::memcpy(pair[g], &pb, sizeof(pb));
        }
        __m512 accv[G][2 * C];
        for (int g = 0; g < G; ++g) {
          const float* a = ar + (h * G + g) * D;
          const __m512 al = _mm512_set1_ps(alpha[g]);
          for (int c = 0; c < 2 * C; ++c) accv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), al);
        }
        for (int64_t jj = 0; jj < n; jj += 2) {
          const c10::BFloat16* v0 = vrow[jj] + h * dm.kv_s1;
          const c10::BFloat16* v1 = (jj + 1 < n ? vrow[jj + 1] : vrow[jj]) + h * dm.kv_s1;
          __m512bh pp[G];
          for (int g = 0; g < G; ++g)
            pp[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair[g][jj / 2]));
          for (int c = 0; c < C; ++c) {
            const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(v0 + 32 * c));
            const __m512i y = _mm512_loadu_si512(reinterpret_cast<const void*>(v1 + 32 * c));
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
            // p[n] is exp2(-inf) = 0: an odd block's last pair adds nothing for its second key
            for (int g = 0; g < G; ++g) {
              accv[g][2 * c] = _mm512_dpbf16_ps(accv[g][2 * c], lo, pp[g]);
              accv[g][2 * c + 1] = _mm512_dpbf16_ps(accv[g][2 * c + 1], hi, pp[g]);
            }
          }
        }
        for (int g = 0; g < G; ++g) {
          float* a = ar + (h * G + g) * D;
          for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(a + 16 * c, accv[g][c]);
        }
      }
    }
  }
  alignas(64) float tmp[D];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t hq = 0; hq < HQ; ++hq) {
      const float* a = acc + (r * HQ + hq) * D;
      for (int64_t vec = 0; vec < 2 * C; ++vec)
        for (int64_t k = 0; k < 16; ++k) tmp[acc_d(vec, k)] = a[16 * vec + k];
      const float l = lrow[r * HQ + hq];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      if (part < 0) {
        store_out(tmp, out + rows[r] * dm.o_s0 + hq * dm.o_s1, D, inv);
      } else {
        const int64_t pi = part + r * pstride;
        float* po = part_o + (pi * HQ + hq) * D;
        for (int64_t d = 0; d < D; ++d) po[d] = tmp[d] * inv;
        part_lse[pi * HQ + hq] = mrow[r * HQ + hq] + std::log2(l);
      }
    }
  }
}

using DecodeFn = void (*)(const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                          const int32_t*, c10::BFloat16*, float*, float*, const Dims&, float,
                          Scratch&);

// ---- Decode rows over KV_PAIRS16 K/V -----------------------------------------------------------
//
// With K stored as K^T pairs and V as key pairs per block of 16 keys, q . K for the 16 keys of a
// block is D/2 vdpbf16ps with the query's (d, d + 1) pair broadcast (the 16 lanes are the 16
// keys: no horizontal sums), and P @ V is 8 x D/16 vdpbf16ps with the (p_2i, p_2i+1) pair
// broadcast (the lanes are the head dims, in order). Per KV head, the query heads' accumulators
// stay in registers across all key blocks; a KV head's block is 2 x 16 x D x 2 contiguous bytes.

// 2^x for 16 lanes, x <= 0 (x <= -127, -inf or NaN: 0): 2^n * e^(r ln 2) with the Taylor
// polynomial of degree Deg in r ln 2, r in [-0.5, 0.5]. Degree 7 (`exp2_16`) is exp2v's
// (relative error < 1e-8); degree 5 (`exp2_16_p5`, < 3e-6) for the extend tiles' P, which is
// rounded to bf16 (2^-9) before P @ V.
template <int Deg>
inline __m512 exp2_16_deg(__m512 x) {
  static constexpr float kCoef[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f,
                                     1.f / 6.f,    0.5f,         1.f,          1.f};
  const __m512 lo = _mm512_set1_ps(-127.f);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(xc, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(kCoef[7 - Deg]);
  for (int i = 8 - Deg; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoef[i]));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GT_OQ), _mm512_scalef_ps(p, n));
}
inline __m512 exp2_16(__m512 x) { return exp2_16_deg<7>(x); }
inline __m512 exp2_16_p5(__m512 x) { return exp2_16_deg<5>(x); }

// Element offsets of the key blocks [first, first + 16 nb) of request req (first % 16 == 0).
inline void block_bases(const int32_t* pages, int64_t first, int64_t nb, const Dims& dm,
                        std::vector<int64_t>& bases) {
  if (static_cast<int64_t>(bases.size()) < nb) bases.resize(nb);
  const int64_t ps = dm.page_size;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t pos = first + 16 * b;
    bases[b] = (static_cast<int64_t>(pages[pos / ps]) * ps + pos % ps) * dm.kv_s0;
  }
}

// Lanes of a key block at positions pos .. pos + 15 inside [lo, hi).
inline __mmask16 lanes_in(int64_t pos, int64_t lo, int64_t hi) {
  const int64_t a = std::max<int64_t>(0, lo - pos), b = std::min<int64_t>(16, hi - pos);
  return static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
}

// A KV_PAIRS16 V block (8 rows of D key pairs) with only its first nvalid (1 .. 15) keys kept,
// the others zero, written to vz; returns vz.
inline const uint32_t* v_block_zeroed(const uint32_t* vb, int64_t nvalid, int64_t D,
                                      uint32_t* vz) {
  for (int64_t i = 0; i < 8; ++i) {
    const uint32_t keep = 2 * i + 1 < nvalid ? 0xFFFFFFFFu : 2 * i < nvalid ? 0x0000FFFFu : 0u;
    for (int64_t d = 0; d < D; ++d) vz[i * D + d] = vb[i * D + d] & keep;
  }
  return vz;
}

// Prefetch one KV head's part of a KV_PAIRS16 block (K and V, `bytes` each).
inline void prefetch_block(const c10::BFloat16* k, const c10::BFloat16* v, int64_t bytes) {
  const char* kp = reinterpret_cast<const char*>(k);
  const char* vp = reinterpret_cast<const char*>(v);
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(kp + o);
    __builtin_prefetch(vp + o);
  }
}

// q . K for the 16 keys of a KV_PAIRS16 block (kb: its K^T pair rows) and G query heads (qp[g]:
// each head's (d, d + 1) pairs): out[g] lane j = q_g . k_j, unscaled. Each K^T row is loaded
// once for the G heads, two accumulator chains per head, the query pair broadcast.
template <int G, int64_t NP>
inline void block_dots(const uint32_t* kb, const uint32_t* const* qp, __m512* out) {
  __m512 s0[G], s1[G];
  for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < NP; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + 16 * p);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + 16 * (p + 1));
    for (int g = 0; g < G; ++g) {
      s0[g] = _mm512_dpbf16_ps(s0[g], k0,
                               (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g][p])));
      s1[g] = _mm512_dpbf16_ps(s1[g], k1,
                               (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[g][p + 1])));
    }
  }
  for (int g = 0; g < G; ++g) out[g] = _mm512_add_ps(s0[g], s1[g]);
}

constexpr int64_t BLK_PF = 2;  // key blocks prefetched ahead

// A shared-prefix item (m > 1 rows over the same pages) over KV_PAIRS16: the loop order of
// decode_rows_pairs16 turned inside out, KV head -> key block -> row, so each block is read from
// memory once and reused from L1 by all m rows. The per-row softmax state (P @ V accumulators
// [m, G, D], 16-lane sums [m, G, 16], maxima [m, G]) lives in the task's scratch instead of
// registers.
template <int G, int C>
void shared_rows_pairs16(const int32_t* rows, int64_t m, int64_t req, int64_t kv_lo,
                         int64_t kv_hi, int64_t part, int64_t pstride, const c10::BFloat16* q,
                         const c10::BFloat16* k_buf, const c10::BFloat16* v_buf,
                         const int32_t* page_table, c10::BFloat16* out, float* part_o,
                         float* part_lse, const Dims& dm, float qscale, Scratch& sc) {
  constexpr int64_t D = 32 * C, NV = 2 * C, NP = 16 * C;  // NP: (d, d + 1) pairs
  const int64_t first = kv_lo & ~int64_t{15}, nb = (kv_hi - first + 15) / 16;
  block_bases(page_table + req * dm.pt_s0, first, nb, dm, sc.bases);
  const int64_t* bases = sc.bases.data();
  const int64_t head_elems = 16 * D;  // one KV head's part of a block, K or V
  const __m512 qs = _mm512_set1_ps(qscale);
  float* acc = sc.acc.data();  // [m, G, D]
  float* lsum = sc.s.data();   // [m, G, 16]
  float* mx = sc.m.data();     // [m, G]
  for (int64_t h = 0; h < dm.hkv; ++h) {
    std::fill(acc, acc + m * G * D, 0.f);
    std::fill(lsum, lsum + m * G * 16, 0.f);
    std::fill(mx, mx + m * G, NEG_INF);
    for (int64_t b = 0; b < std::min<int64_t>(nb, BLK_PF); ++b)
      prefetch_block(k_buf + bases[b] + h * head_elems, v_buf + bases[b] + h * head_elems,
                     head_elems * 2);
    for (int64_t b = 0; b < nb; ++b) {
      if (b + BLK_PF < nb) {
        const int64_t nx = bases[b + BLK_PF] + h * head_elems;
        prefetch_block(k_buf + nx, v_buf + nx, head_elems * 2);
      }
      const uint32_t* kb = reinterpret_cast<const uint32_t*>(k_buf + bases[b] + h * head_elems);
      const uint32_t* vb = reinterpret_cast<const uint32_t*>(v_buf + bases[b] + h * head_elems);
      const int64_t pos = first + 16 * b;
      const bool partial = pos < kv_lo || pos + 16 > kv_hi;
      const __mmask16 valid = partial ? lanes_in(pos, kv_lo, kv_hi) : __mmask16(0xFFFF);
      // Keys past kv_hi in the last block may hold stale values (even NaN): read as zeros.
      alignas(64) uint32_t vz[8 * D];
      if (pos + 16 > kv_hi) vb = v_block_zeroed(vb, kv_hi - pos, D, vz);
      for (int64_t r = 0; r < m; ++r) {
        const uint32_t* qp[G];
        for (int g = 0; g < G; ++g)
          qp[g] = reinterpret_cast<const uint32_t*>(q + rows[r] * dm.q_s0 + (h * G + g) * dm.q_s1);
        __m512 sq[G];
        block_dots<G, NP>(kb, qp, sq);
        alignas(64) uint32_t pp[G][8];
        __m512 av[G][NV];
        for (int g = 0; g < G; ++g) {
          float* a = acc + (r * G + g) * D;
          float* ls = lsum + (r * G + g) * 16;
          float& mg = mx[r * G + g];
          for (int v = 0; v < NV; ++v) av[g][v] = _mm512_loadu_ps(a + 16 * v);
          __m512 l = _mm512_loadu_ps(ls);
          __m512 sv = _mm512_mul_ps(sq[g], qs);
          if (partial) sv = _mm512_mask_blend_ps(valid, _mm512_set1_ps(NEG_INF), sv);
          const float bm = _mm512_reduce_max_ps(sv);
          if (bm > mg) {
            const __m512 al = _mm512_set1_ps(mg == NEG_INF ? 0.f : std::exp2(mg - bm));
            for (int v = 0; v < NV; ++v) av[g][v] = _mm512_mul_ps(av[g][v], al);
            l = _mm512_mul_ps(l, al);
            mg = bm;
          }
          const __m512 e = exp2_16(_mm512_sub_ps(sv, _mm512_set1_ps(mg)));
          _mm512_storeu_ps(ls, _mm512_add_ps(l, e));
          _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), (__m256i)_mm512_cvtneps_pbh(e));
        }
        for (int64_t i = 0; i < 8; ++i) {
          __m512bh pb[G];
          for (int g = 0; g < G; ++g)
            pb[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g][i]));
          for (int v = 0; v < NV; ++v) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(vb + i * D + 16 * v);
            for (int g = 0; g < G; ++g) av[g][v] = _mm512_dpbf16_ps(av[g][v], x, pb[g]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (r * G + g) * D + 16 * v, av[g][v]);
      }
    }
    for (int64_t r = 0; r < m; ++r) {
      for (int g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        const float* a = acc + (r * G + g) * D;
        const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + (r * G + g) * 16));
        const float mg = mx[r * G + g];
        const __m512 iv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
        if (part < 0) {
          c10::BFloat16* o = out + rows[r] * dm.o_s0 + hq * dm.o_s1;
          for (int v = 0; v < NV; ++v)
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(o + 16 * v),
                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + 16 * v), iv)));
        } else {
          const int64_t pi = part + r * pstride;
          float* po = part_o + (pi * dm.hq + hq) * D;
          for (int v = 0; v < NV; ++v)
            _mm512_storeu_ps(po + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * v), iv));
          part_lse[pi * dm.hq + hq] = mg + std::log2(l);
        }
      }
    }
  }
}

// decode_rows_bf16 over KV_PAIRS16 (same task contract), block-major: for each pair of key
// blocks, every KV head in turn, so the task reads each block whole (its K, then its V, all
// heads: 2 x 16 x Hkv x D x 2 contiguous bytes) and a request's pages in order. Head-major (each
// head over all blocks, i.e. 2 KB of every block per pass) read the same bytes as a strided
// stream: measured in the forward (benchmarks/kernels/bench_cpu_attention_forward.py, AVX512_BF16
// EPYC, 2 threads, pages in ascending order), batch 32 x 400 keys 16.1 -> 13.1 ms, batch 64 x
// 512 39.5 -> 31.4 ms (18-19 -> 22-24 GB/s of K/V).
// Per head, the accumulators of its G query heads live in registers while the head runs and
// in an L1 array between blocks (heads taken BM_HEADS at a time).
template <int G, int C>
void decode_rows_pairs16(const int32_t* rows, int64_t m, int64_t req, int64_t kv_lo,
                         int64_t kv_hi, int64_t part, int64_t pstride, const c10::BFloat16* q,
                         const c10::BFloat16* k_buf, const c10::BFloat16* v_buf,
                         const int32_t* page_table, c10::BFloat16* out, float* part_o,
                         float* part_lse, const Dims& dm, float qscale, Scratch& sc) {
  if (m > 1) {
    shared_rows_pairs16<G, C>(rows, m, req, kv_lo, kv_hi, part, pstride, q, k_buf, v_buf,
                              page_table, out, part_o, part_lse, dm, qscale, sc);
    return;
  }
  constexpr int64_t D = 32 * C, NV = 2 * C, NP = 16 * C;  // NP: (d, d + 1) pairs
  // KV heads per block-major pass: their softmax state in at most ~16 KB of L1
  constexpr int64_t BM_HEADS = std::max<int64_t>(1, std::min<int64_t>(16, 256 / (G * NV)));
  const int64_t first = kv_lo & ~int64_t{15}, nb = (kv_hi - first + 15) / 16;
  block_bases(page_table + req * dm.pt_s0, first, nb, dm, sc.bases);
  const int64_t* bases = sc.bases.data();
  const int64_t head_elems = 16 * D;  // one KV head's part of a block, K or V
  const __m512 qs = _mm512_set1_ps(qscale);
  const int64_t row = rows[0];
  alignas(64) __m512 acc_s[BM_HEADS][G][NV];
  alignas(64) __m512 lsum_s[BM_HEADS][G];
  float mx_s[BM_HEADS][G];
  for (int64_t h0 = 0; h0 < dm.hkv; h0 += BM_HEADS) {
    const int64_t nh = std::min<int64_t>(BM_HEADS, dm.hkv - h0);
    for (int64_t j = 0; j < nh; ++j)
      for (int g = 0; g < G; ++g) {
        for (int v = 0; v < NV; ++v) acc_s[j][g][v] = _mm512_setzero_ps();
        lsum_s[j][g] = _mm512_setzero_ps();
        mx_s[j][g] = NEG_INF;
      }
    auto prefetch = [&](int64_t blk) {
      const int64_t nx = bases[blk] + h0 * head_elems;
      prefetch_block(k_buf + nx, v_buf + nx, nh * head_elems * 2);
    };
    for (int64_t b = 0; b < std::min<int64_t>(nb, BLK_PF); ++b) prefetch(b);
    // Two key blocks per step: twice the independent dot-product chains, one softmax
    // rescale per 32 keys.
    for (int64_t b = 0; b < nb; b += 2) {
      const bool two = b + 1 < nb;
      for (int64_t nx = b + BLK_PF; nx < std::min<int64_t>(nb, b + BLK_PF + 2); ++nx)
        prefetch(nx);
      for (int64_t j = 0; j < nh; ++j) {
        const int64_t h = h0 + j;
        const uint32_t* qp[G];
        for (int g = 0; g < G; ++g)
          qp[g] = reinterpret_cast<const uint32_t*>(q + row * dm.q_s0 + (h * G + g) * dm.q_s1);
        __m512 acc[G][NV], lsum[G];
        float mx[G];
        for (int g = 0; g < G; ++g) {
          for (int v = 0; v < NV; ++v) acc[g][v] = acc_s[j][g][v];
          lsum[g] = lsum_s[j][g];
          mx[g] = mx_s[j][g];
        }
        // Scaled scores of block blk's 16 keys for the G query heads (lanes = keys; lanes
        // outside [kv_lo, kv_hi) are -inf).
        auto scores = [&](int64_t blk, __m512* out_s) {
          const uint32_t* kb =
              reinterpret_cast<const uint32_t*>(k_buf + bases[blk] + h * head_elems);
          __m512 sq[G];
          block_dots<G, NP>(kb, qp, sq);
          const int64_t pos = first + 16 * blk;
          const bool partial = pos < kv_lo || pos + 16 > kv_hi;
          const __mmask16 valid = partial ? lanes_in(pos, kv_lo, kv_hi) : __mmask16(0xFFFF);
          for (int g = 0; g < G; ++g) {
            out_s[g] = _mm512_mul_ps(sq[g], qs);
            if (partial)
              out_s[g] = _mm512_mask_blend_ps(valid, _mm512_set1_ps(NEG_INF), out_s[g]);
          }
        };
        // acc += P @ V over block blk's 8 key pairs (pp: P of its 16 keys as bf16 pairs).
        // Keys past kv_hi may hold stale values (even NaN): their p is 0, but 0 * NaN is NaN,
        // so their V is read as zeros.
        auto pv = [&](int64_t blk, const uint32_t (*pp)[16], int half) {
          const uint32_t* vb =
              reinterpret_cast<const uint32_t*>(v_buf + bases[blk] + h * head_elems);
          const int64_t pos = first + 16 * blk;
          alignas(64) uint32_t vz[8 * D];
          if (pos + 16 > kv_hi) vb = v_block_zeroed(vb, kv_hi - pos, D, vz);
          for (int64_t i = 0; i < 8; ++i) {
            __m512bh pb[G];
            for (int g = 0; g < G; ++g)
              pb[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[g][8 * half + i]));
            for (int v = 0; v < NV; ++v) {
              const __m512bh x = (__m512bh)_mm512_loadu_si512(vb + i * D + 16 * v);
              for (int g = 0; g < G; ++g) acc[g][v] = _mm512_dpbf16_ps(acc[g][v], x, pb[g]);
            }
          }
        };
        __m512 sa[G], sb[G];
        scores(b, sa);
        if (two) {
          scores(b + 1, sb);
        } else {
          for (int g = 0; g < G; ++g) sb[g] = _mm512_set1_ps(NEG_INF);
        }
        alignas(64) uint32_t pp[G][16];
        for (int g = 0; g < G; ++g) {
          const float bm = _mm512_reduce_max_ps(_mm512_max_ps(sa[g], sb[g]));
          if (bm > mx[g]) {
            const __m512 al = _mm512_set1_ps(mx[g] == NEG_INF ? 0.f : std::exp2(mx[g] - bm));
            for (int v = 0; v < NV; ++v) acc[g][v] = _mm512_mul_ps(acc[g][v], al);
            lsum[g] = _mm512_mul_ps(lsum[g], al);
            mx[g] = bm;
          }
          const __m512 mm = _mm512_set1_ps(mx[g]);
          const __m512 ea = exp2_16(_mm512_sub_ps(sa[g], mm));
          const __m512 eb = exp2_16(_mm512_sub_ps(sb[g], mm));
          lsum[g] = _mm512_add_ps(lsum[g], _mm512_add_ps(ea, eb));
          _mm512_store_si512(reinterpret_cast<__m512i*>(pp[g]),
                             (__m512i)_mm512_cvtne2ps_pbh(eb, ea));
        }
        pv(b, pp, 0);
        if (two) pv(b + 1, pp, 1);
        for (int g = 0; g < G; ++g) {
          for (int v = 0; v < NV; ++v) acc_s[j][g][v] = acc[g][v];
          lsum_s[j][g] = lsum[g];
          mx_s[j][g] = mx[g];
        }
      }
    }
    for (int64_t j = 0; j < nh; ++j)
      for (int g = 0; g < G; ++g) {
        const int64_t hq = (h0 + j) * G + g;
        const float l = _mm512_reduce_add_ps(lsum_s[j][g]);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const __m512 iv = _mm512_set1_ps(inv);
        if (part < 0) {
          c10::BFloat16* o = out + row * dm.o_s0 + hq * dm.o_s1;
          for (int v = 0; v < NV; ++v)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * v),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc_s[j][g][v], iv)));
        } else {
          float* po = part_o + (part * dm.hq + hq) * D;
          for (int v = 0; v < NV; ++v)
            _mm512_storeu_ps(po + 16 * v, _mm512_mul_ps(acc_s[j][g][v], iv));
          part_lse[part * dm.hq + hq] = mx_s[j][g] + std::log2(l);
        }
      }
  }
}

template <int G, bool P16>
DecodeFn decode_fn_c(int64_t c) {
  switch (c) {
    case 1: return P16 ? &decode_rows_pairs16<G, 1> : &decode_rows_bf16<G, 1>;
    case 2: return P16 ? &decode_rows_pairs16<G, 2> : &decode_rows_bf16<G, 2>;
    case 4: return P16 ? &decode_rows_pairs16<G, 4> : &decode_rows_bf16<G, 4>;
    case 8: return P16 ? &decode_rows_pairs16<G, 8> : &decode_rows_bf16<G, 8>;
    default: return nullptr;
  }
}

template <int G>
DecodeFn decode_fn_g(const Dims& dm) {
  const int64_t c = dm.d / 32;
  return dm.layout == KV_PAIRS16 ? decode_fn_c<G, true>(c) : decode_fn_c<G, false>(c);
}

// The decode kernel for (layout, group, head dim / 32), or nullptr (then the register tiles or
// the generic path run).
DecodeFn decode_fn(const Dims& dm) {
  if (!decode_bf16_fits(dm)) return nullptr;
  switch (dm.group) {
    case 1: return decode_fn_g<1>(dm);
    case 2: return decode_fn_g<2>(dm);
    case 3: return decode_fn_g<3>(dm);
    case 4: return decode_fn_g<4>(dm);
    case 5: return decode_fn_g<5>(dm);
    case 6: return decode_fn_g<6>(dm);
    case 7: return decode_fn_g<7>(dm);
    case 8: return decode_fn_g<8>(dm);
    default: return nullptr;
  }
}

// ---- Extend tiles over bf16 K/V with AVX512_BF16 dot products ----------------------------------
//
// The register tiles of the fp32 path (RM query rows x 64 keys; RM rows x 32 columns of D) on
// bf16 pairs: q and K as (d, d + 1) pairs, P and V as (key j, key j + 1) pairs, fp32 accumulation.
// Layouts per KV head, as uint32 pairs: q [rows, D/2]; K [D/2, BLOCK_K] (pair p of key j at
// p * BLOCK_K + j); V [BLOCK_K/2, D] (keys 2i, 2i+1 of column d at i * D + d); P overwrites the
// first BLOCK_K/2 floats of its own score row.
constexpr bool kHasBf16Dot = true;


template <int RM>
inline void scores_tile_bf16(const uint32_t* qp, int64_t q_stride, const uint32_t* kt2, int64_t D,
                             float qscale, float* s) {
  __m512 a[RM][4];
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const uint32_t* kr = kt2 + p * BLOCK_K;
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kr + 16);
    const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kr + 32);
    const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kr + 48);
    for (int r = 0; r < RM; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * q_stride + p]));
      a[r][0] = _mm512_dpbf16_ps(a[r][0], qb, k0);
      a[r][1] = _mm512_dpbf16_ps(a[r][1], qb, k1);
      a[r][2] = _mm512_dpbf16_ps(a[r][2], qb, k2);
      a[r][3] = _mm512_dpbf16_ps(a[r][3], qb, k3);
    }
  }
  const __m512 sc = _mm512_set1_ps(qscale);
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * BLOCK_K + 16 * c, _mm512_mul_ps(a[r][c], sc));
}

template <int RM, int NV>
inline void pv_cols_bf16(float* acc, const float* alpha, const uint32_t* pp, const uint32_t* vt2,
                         int64_t npairs, int64_t D, int64_t d) {
  __m512 a[RM][NV];
  for (int r = 0; r < RM; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < NV; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d + 16 * c), al);
  }
  for (int64_t i = 0; i < npairs; ++i) {
    __m512bh v[NV];
    for (int c = 0; c < NV; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt2 + i * D + d + 16 * c);
    for (int r = 0; r < RM; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * BLOCK_K + i]));
      for (int c = 0; c < NV; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pb, v[c]);
    }
  }
  for (int r = 0; r < RM; ++r)
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + r * D + d + 16 * c, a[r][c]);
}

// acc[r] = acc[r] * alpha[r] + P[r] @ V for RM rows: 64 columns of D per pass (RM x 4
// accumulators: each P pair broadcast serves 4 dot products), then 32 for the rest.
template <int RM>
inline void pv_tile_bf16(float* acc, const float* alpha, const uint32_t* pp, const uint32_t* vt2,
                         int64_t npairs, int64_t D) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_cols_bf16<RM, 4>(acc, alpha, pp, vt2, npairs, D, d);
  if (d < D) pv_cols_bf16<RM, 2>(acc, alpha, pp, vt2, npairs, D, d);
}
// In-register transpose of 16 rows of 16 x 32-bit: r[i][j] -> r[j][i].
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] now holds, in 128-bit lane L, elements 4L..4L+3 of column (b') of rows 4a..4a+3;
  // exchange the 128-bit lanes across the four groups of four.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_i32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// One KV head's block of n <= BLOCK_K keys (row pointers krows / vrows, already offset to the
// head) into the tile layouts: K as [D/2, BLOCK_K] (d, d + 1) pairs, V as [BLOCK_K/2, D]
// (key 2i, key 2i + 1) pairs. Keys >= n are zero. D % 32 == 0.
inline void pack_kv_pairs(const c10::BFloat16* const* krows, const c10::BFloat16* const* vrows,
                          int64_t n, int64_t D, uint32_t* kt2, uint32_t* vt2) {
  for (int64_t j0 = 0; j0 < BLOCK_K; j0 += 16) {
    for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = j0 + i < n ? _mm512_loadu_si512(krows[j0 + i] + 2 * p0) : _mm512_setzero_si512();
      transpose16x16_epi32(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kt2 + (p0 + i) * BLOCK_K + j0, r[i]);
    }
  }
  alignas(64) static const uint16_t kLo[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                               37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                               11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo_idx = _mm512_load_si512(kLo);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < BLOCK_K / 2; ++i) {
    const c10::BFloat16* a = 2 * i < n ? vrows[2 * i] : nullptr;
    const c10::BFloat16* b = 2 * i + 1 < n ? vrows[2 * i + 1] : nullptr;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      const __m512i x = a ? _mm512_loadu_si512(a + d0) : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_loadu_si512(b + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(vt2 + i * D + d0, _mm512_permutex2var_epi16(x, lo_idx, y));
      _mm512_storeu_si512(vt2 + i * D + d0 + 16, _mm512_permutex2var_epi16(x, hi_idx, y));
    }
  }
}
// One KV_PAIRS16 block of 16 keys (k / v: the block's start, all heads; nk of its keys valid)
// into the register tiles' layouts at key offset 16 * sb: kt2 / vt2 already offset to it,
// head h at + h * stride uint32. V pairs of keys >= nk are zeroed (stale slots may hold NaN).
inline void pack_pairs16(const c10::BFloat16* k, const c10::BFloat16* v, int64_t nk, int64_t H,
                         int64_t D, uint32_t* kt2, uint32_t* vt2, int64_t stride) {
  for (int64_t h = 0; h < H; ++h) {
    const uint32_t* kb = reinterpret_cast<const uint32_t*>(k + h * 16 * D);
    const uint32_t* vb = reinterpret_cast<const uint32_t*>(v + h * 16 * D);
    uint32_t* kd = kt2 + h * stride;
    uint32_t* vd = vt2 + h * stride;
    for (int64_t p = 0; p < D / 2; ++p)
      _mm512_storeu_si512(kd + p * BLOCK_K, _mm512_loadu_si512(kb + 16 * p));
    if (nk == 16) {
      std::memcpy(vd, vb, 8 * D * sizeof(uint32_t));
      continue;
    }
    for (int64_t i = 0; i < 8; ++i) {
      const uint32_t keep = 2 * i + 1 < nk ? 0xFFFFFFFFu : 2 * i < nk ? 0xFFFFu : 0u;
      for (int64_t d = 0; d < D; ++d) vd[i * D + d] = vb[i * D + d] & keep;
    }
  }
}
#else
constexpr bool kHasBf16Dot = false;
void pack_pairs16(const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, int64_t,
                  uint32_t*, uint32_t*, int64_t);
void pack_kv_pairs(const c10::BFloat16* const*, const c10::BFloat16* const*, int64_t, int64_t,
                   uint32_t*, uint32_t*);
template <int RM>
void scores_tile_bf16(const uint32_t*, int64_t, const uint32_t*, int64_t, float, float*);
template <int RM>
void pv_tile_bf16(float*, const float*, const uint32_t*, const uint32_t*, int64_t, int64_t);
#endif  // __AVX512BF16__

// One work item over all KV heads: a key block is read as whole [Hkv, D] rows (contiguous:
// a page is one sequential run of memory), converted to fp32 once, and used by every query
// head of its group.
template <typename T>
void attend_task(
    const int32_t* item,
    const int32_t* item_rows,  // row lists of shared-prefix items
    const T* q,
    const T* k_buf,
    const T* v_buf,
    const int32_t* page_table,
    T* out,
    float* part_o,    // [P, Hq, D]
    float* part_lse,  // [P, Hq]
    const Dims& dm,
    float qscale,
    Scratch& sc) {
  const int64_t req = item[0], kv_lo = item[4], part = item[6];
  // A shared-prefix item (nq < 0): the -nq decode rows listed at item_rows[item[1] + 1 ..]
  // over keys [kv_lo, kv_hi) of pages they all share, no causal mask (pos0 = kv_hi - 1), row i's
  // partial at part + i * item_rows[item[1]]. Otherwise rows row0 .. row0 + nq - 1.
  const int32_t* rows = item[2] < 0 ? item_rows + item[1] + 1 : nullptr;
  const int64_t pstride = rows ? rows[-1] : 1;
  const int64_t nq = std::abs(static_cast<int64_t>(item[2]));
  const int64_t row0 = rows ? 0 : item[1];
  const int64_t pos0 = rows ? item[5] - 1 : item[3];
  auto row_of = [&](int64_t i) -> int64_t { return rows ? rows[i] : row0 + i; };
  const int64_t kv_hi = std::min<int64_t>(item[5], pos0 + (rows ? 1 : nq));
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Few query rows per KV head: the decode kernel (dot products + horizontal sums); from 8
    // rows up the register tiles below (K transposed once per block for all rows) are faster,
    // but for KV_PAIRS16, where a shared-prefix item of any size takes shared_rows_pairs16
    // (measured, cache-resident, 1 thread: 8 rows x 1040 keys 0.22 vs 0.31 ms in the tiles).
    if (rows ? nq * dm.group < 8 || dm.layout == KV_PAIRS16 : nq == 1) {
      if (DecodeFn fn = decode_fn(dm)) {
        const int32_t one = static_cast<int32_t>(row0);
        fn(rows ? rows : &one, nq, req, kv_lo, kv_hi, part, pstride, q, k_buf, v_buf, page_table,
           out, part_o, part_lse, dm, qscale, sc);
        return;
      }
    }
  }
#endif
  const int64_t D = dm.d, G = dm.group, H = dm.hkv, M = nq * G, MT = H * M;
  // KV_PAIRS16 blocks are already the tiles' operand layouts: always the bf16 tiles (the op
  // accepts that layout only for bf16 with AVX512_BF16 and D % 32 == 0, D <= 256).
  const bool pairs16 = dm.layout == KV_PAIRS16;
  const bool tiled = M >= 8 || pairs16;  // transposed-K tiles pay off from a few rows up
  // bf16 K/V on a CPU with AVX512_BF16: the tiles multiply bf16 pairs (see scores_tile_bf16)
  constexpr bool kBf = kHasBf16Dot && std::is_same_v<T, c10::BFloat16>;
  const bool bfdot = kBf && tiled && D % 32 == 0 && D <= 256;
  float* qf = sc.qf.data();
  float* acc = sc.acc.data();
  float* mrow = sc.m.data();
  float* lrow = sc.l.data();
  float* alpha = sc.alpha.data();
  float* s = sc.s.data();
  float* kf = sc.kf.data();
  float* kt = sc.kt.data();
  float* vf = sc.vf.data();
  const int64_t blk = BLOCK_K * D;  // floats per head in kf / kt / vf
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q + row_of(i) * dm.q_s0 + (h * G + g) * dm.q_s1;
        float* dst = qf + (h * M + i * G + g) * D;
        if (bfdot) {  // unscaled bf16 pairs (the scale multiplies the fp32 scores)
          std::memcpy(dst, src, D * sizeof(T));
          continue;
        }
        for (int64_t d = 0; d < D; d += VW) store(dst + d, load_f(src + d) * qscale);
      }
    }
  }
  std::fill(acc, acc + MT * D, 0.f);
  std::fill(mrow, mrow + MT, NEG_INF);
  std::fill(lrow, lrow + MT, 0.f);
  float* lvec = sc.lv.data();  // bf16 tiles: row sums as 16 lanes
  if (bfdot) std::fill(lvec, lvec + 16 * MT, 0.f);
  const int32_t* pages = page_table + req * dm.pt_s0;
  const int64_t ps = dm.page_size;
  const int64_t row_bytes = H * D * static_cast<int64_t>(sizeof(T));
  // KV_PAIRS16: blocks start on a 16-key boundary; keys before kv_lo are masked below.
  for (int64_t j0 = pairs16 ? (kv_lo & ~int64_t{15}) : kv_lo; j0 < kv_hi; j0 += BLOCK_K) {
    const int64_t n = std::min<int64_t>(BLOCK_K, kv_hi - j0);
    int64_t page = j0 / ps, off = j0 % ps;  // one division per block, not per key
    if constexpr (kBf) {
      if (pairs16) {  // copy the 16-key blocks' K^T rows and V pair rows into the tiles
        for (int64_t sb = 0; 16 * sb < n; ++sb) {
          const int64_t pos = j0 + 16 * sb;
          const int64_t base = (static_cast<int64_t>(pages[pos / ps]) * ps + pos % ps) * dm.kv_s0;
          pack_pairs16(k_buf + base, v_buf + base, std::min<int64_t>(16, n - 16 * sb), H, D,
                       reinterpret_cast<uint32_t*>(kt) + 16 * sb,
                       reinterpret_cast<uint32_t*>(vf) + 8 * sb * D, blk);
        }
        // prefetch the next block's 16-key blocks (all heads: one contiguous run each)
        for (int64_t pos = j0 + BLOCK_K; pos < std::min<int64_t>(kv_hi, j0 + 2 * BLOCK_K);
             pos += 16) {
          const int64_t base = (static_cast<int64_t>(pages[pos / ps]) * ps + pos % ps) * dm.kv_s0;
          const char* kp = reinterpret_cast<const char*>(k_buf + base);
          const char* vp = reinterpret_cast<const char*>(v_buf + base);
          for (int64_t b = 0; b < 16 * row_bytes; b += 64) {
            __builtin_prefetch(kp + b);
            __builtin_prefetch(vp + b);
          }
        }
      } else if (bfdot) {  // K as [D/2, BLOCK_K] pairs, V as [BLOCK_K/2, D] key pairs, per head
        const T* kr[BLOCK_K];
        const T* vr[BLOCK_K];
        for (int64_t jj = 0; jj < n; ++jj) {
          const int64_t slot = static_cast<int64_t>(pages[page]) * ps + off;
          if (++off == ps) off = 0, ++page;
          kr[jj] = k_buf + slot * dm.kv_s0;
          vr[jj] = v_buf + slot * dm.kv_s0;
        }
        for (int64_t h = 0; h < H; ++h) {
          const T* krh[BLOCK_K];
          const T* vrh[BLOCK_K];
          for (int64_t jj = 0; jj < n; ++jj) {
            krh[jj] = kr[jj] + h * dm.kv_s1;
            vrh[jj] = vr[jj] + h * dm.kv_s1;
          }
          pack_kv_pairs(krh, vrh, n, D, reinterpret_cast<uint32_t*>(kt + h * blk),
                        reinterpret_cast<uint32_t*>(vf + h * blk));
        }
      }
    }
    // The next block's keys are prefetched one per key converted here (a burst of all of them
    // after the block overflowed the miss buffers: measured, AVX2 EPYC, decode rows over
    // scattered pages stalled on their K/V loads).
    const int64_t n2 = pairs16 ? 0 : std::min<int64_t>(BLOCK_K, kv_hi - j0 - BLOCK_K);
    int64_t page2 = (j0 + n) / ps, off2 = (j0 + n) % ps;  // key j0 + n (the bf16 packing
    // above has already moved page / off past this block)
    auto prefetch_next = [&]() {  // the K / V rows (all heads) of key page2 / off2; advance
      const int64_t slot = static_cast<int64_t>(pages[page2]) * ps + off2;
      if (++off2 == ps) off2 = 0, ++page2;
      const char* kp = reinterpret_cast<const char*>(k_buf + slot * dm.kv_s0);
      const char* vp = reinterpret_cast<const char*>(v_buf + slot * dm.kv_s0);
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(kp + b);
        __builtin_prefetch(vp + b);
      }
    };
    for (int64_t jj = 0; jj < (bfdot ? 0 : n); ++jj) {
      const int64_t slot = static_cast<int64_t>(pages[page]) * ps + off;
      if (++off == ps) off = 0, ++page;
      if (jj < n2) prefetch_next();
      for (int64_t h = 0; h < H; ++h) {
        const T* kp = k_buf + slot * dm.kv_s0 + h * dm.kv_s1;
        const T* vp = v_buf + slot * dm.kv_s0 + h * dm.kv_s1;
        for (int64_t d = 0; d < D; d += VW) {
          const v8 kv = load_f(kp + d);
          if (tiled) {
            for (int i = 0; i < VW; ++i) kt[h * blk + (d + i) * BLOCK_K + jj] = kv[i];
          } else {
            store(kf + h * blk + jj * D + d, kv);
          }
          store(vf + h * blk + jj * D + d, load_f(vp + d));
        }
      }
    }
    if (bfdot && !pairs16)  // the bf16 tiles packed above: the next block in one burst
      for (int64_t jj = 0; jj < n2; ++jj) prefetch_next();
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = qf + h * M * D;
      float* sh = s + h * M * BLOCK_K;
      if constexpr (kBf) {
        if (bfdot) {
          const uint32_t* qp = reinterpret_cast<const uint32_t*>(qh);  // row stride D floats
          const uint32_t* kt2 = reinterpret_cast<const uint32_t*>(kt + h * blk);
          by_row_tiles(M, [&](int64_t r, auto rm) {  // a q row: D/2 pairs in D floats of room
            scores_tile_bf16<decltype(rm)::value>(qp + r * D, D, kt2, D, qscale, sh + r * BLOCK_K);
          });
          continue;
        }
      }
      if (tiled) {
        const float* kth = kt + h * blk;
        by_row_tiles(M, [&](int64_t r, auto rm) {
          scores_tile<decltype(rm)::value>(qh + r * D, kth, D, sh + r * BLOCK_K);
        });
      } else {
        scores_dot(qh, M, kf + h * blk, n, D, sh);
      }
    }
    // The keys [nlo, nv) of this block that score row r's query sees: causal (keys <= its
    // position), from kv_lo, and past the window's first key (position qpos - W + 1).
    auto visible = [&](int64_t r) -> std::pair<int64_t, int64_t> {
      const int64_t qpos = rows ? pos0 : pos0 + (r % M) / G;
      const int64_t nv = std::min<int64_t>(n, qpos - j0 + 1);
      const int64_t nlo = std::max<int64_t>(
          kv_lo - j0, dm.window > 0 ? std::max<int64_t>(0, qpos - dm.window + 1 - j0) : 0);
      return {nlo, nv};
    };
#if defined(__AVX512BF16__)
    // bf16 tiles: the online softmax of each row's 64 scores in four 16-lane vectors, its P
    // written as bf16 key pairs in place at the start of the score row, then P @ V (measured
    // 10-11% faster for the whole extend attention than 8-lane vectors and a second pass
    // converting P: 512-token prefill 39.3 vs 43.7 ms, 6 x 330 tokens 119 vs 134, 30 layers).
    if (bfdot) {
      if constexpr (kBf) {
        const __m512 ninf = _mm512_set1_ps(NEG_INF);
        for (int64_t r = 0; r < MT; ++r) {
          float* sr = s + r * BLOCK_K;
          const auto [nlo, nv] = visible(r);
          if (nv <= nlo) {
            _mm512_storeu_si512(sr, _mm512_setzero_si512());
            _mm512_storeu_si512(sr + 16, _mm512_setzero_si512());
            alpha[r] = 1.f;
            continue;
          }
          __m512 v[4];
          if (nlo == 0 && nv >= 64) {
            for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(sr + 16 * i);
          } else {
            const uint64_t valid =
                (nv >= 64 ? ~uint64_t{0} : (uint64_t{1} << nv) - 1) & ~((uint64_t{1} << nlo) - 1);
            for (int i = 0; i < 4; ++i)
              v[i] = _mm512_mask_blend_ps(static_cast<__mmask16>(valid >> (16 * i)), ninf,
                                          _mm512_loadu_ps(sr + 16 * i));
          }
          const float bm = _mm512_reduce_max_ps(
              _mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
          const float m_new = std::max(mrow[r], bm);
          alpha[r] = mrow[r] == NEG_INF ? 0.f : exp2s(mrow[r] - m_new);
          const __m512 mb = _mm512_set1_ps(m_new);
          __m512 e[4];
          for (int i = 0; i < 4; ++i) e[i] = exp2_16_p5(_mm512_sub_ps(v[i], mb));
          const __m512 sum = _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]));
          float* lvr = lvec + 16 * r;  // the row sum as 16 lanes (reduced at the end)
          _mm512_storeu_ps(lvr, _mm512_fmadd_ps(_mm512_loadu_ps(lvr), _mm512_set1_ps(alpha[r]), sum));
          mrow[r] = m_new;
          _mm512_storeu_si512(sr, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
          _mm512_storeu_si512(sr + 16, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
        }
        const int64_t npairs = (n + 1) / 2;
        for (int64_t h = 0; h < H; ++h) {
          const uint32_t* vt2 = reinterpret_cast<const uint32_t*>(vf + h * blk);
          float* ah = acc + h * M * D;
          const float* alh = alpha + h * M;
          const uint32_t* ph = reinterpret_cast<const uint32_t*>(s + h * M * BLOCK_K);
          by_row_tiles(M, [&](int64_t r, auto rm) {
            pv_tile_bf16<decltype(rm)::value>(ah + r * D, alh + r, ph + r * BLOCK_K, vt2, npairs,
                                              D);
          });
        }
        continue;
      }
    }
#endif
    // Online softmax per row over the valid (causal, in-range) keys of this block.
    for (int64_t r = 0; r < MT; ++r) {
      float* sr = s + r * BLOCK_K;
      const auto [nlo, nv] = visible(r);
      if (nv <= nlo) {  // no key of the block is visible to this query: weights 0, no rescale
        std::fill(sr, sr + BLOCK_K, 0.f);
        alpha[r] = 1.f;
        continue;
      }
      for (int64_t jj = 0; jj < nlo; ++jj) sr[jj] = NEG_INF;
      for (int64_t jj = nv; jj < BLOCK_K; ++jj) sr[jj] = NEG_INF;
      v8 mx = load(sr);
      for (int jj = VW; jj < BLOCK_K; jj += VW) mx = mx > load(sr + jj) ? mx : load(sr + jj);
      const float m_new = std::max(mrow[r], hmax(mx));
      alpha[r] = mrow[r] == NEG_INF ? 0.f : exp2s(mrow[r] - m_new);
      v8 sum = v8{};
      const v8 mb = bcast(m_new);
      for (int jj = 0; jj < BLOCK_K; jj += VW) {
        const v8 e = exp2v(load(sr + jj) - mb);
        store(sr + jj, e);
        sum += e;
      }
      lrow[r] = lrow[r] * alpha[r] + hsum(sum);
      mrow[r] = m_new;
    }
    for (int64_t h = 0; h < H; ++h) {
      float* ah = acc + h * M * D;
      const float* alh = alpha + h * M;
      const float* sh = s + h * M * BLOCK_K;
      const float* vh = vf + h * blk;
      by_row_tiles(M, [&](int64_t r, auto rm) {
        pv_tile<decltype(rm)::value>(ah + r * D, alh + r, sh + r * BLOCK_K, vh, n, D);
      });
    }
  }
#if defined(__AVX512BF16__)
  if (bfdot)
    for (int64_t r = 0; r < MT; ++r) lrow[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lvec + 16 * r));
#endif
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = h * M + i * G + g, hq = h * G + g;
        const float inv = lrow[r] > 0.f ? 1.f / lrow[r] : 0.f;
        if (part < 0) {
          store_out(acc + r * D, out + row_of(i) * dm.o_s0 + hq * dm.o_s1, D, inv);
        } else {
          const int64_t pi = part + i * pstride;
          float* po = part_o + (pi * dm.hq + hq) * D;
          for (int64_t d = 0; d < D; ++d) po[d] = acc[r * D + d] * inv;
          part_lse[pi * dm.hq + hq] = mrow[r] + std::log2(lrow[r]);
        }
      }
    }
  }
}

// Combine the splits of one decode row for one query head.
template <typename T>
void reduce_task(
    const int32_t* red, int64_t hq, const float* part_o, const float* part_lse, T* out,
    const Dims& dm, float* tmp) {
  const int64_t row = red[0], p0 = red[1], np = red[2], D = dm.d;
  float gmax = NEG_INF;
  for (int64_t p = 0; p < np; ++p) gmax = std::max(gmax, part_lse[(p0 + p) * dm.hq + hq]);
  std::fill(tmp, tmp + D, 0.f);
  float wsum = 0.f;
  for (int64_t p = 0; p < np; ++p) {
    const float w = exp2s(part_lse[(p0 + p) * dm.hq + hq] - gmax);
    wsum += w;
    const float* po = part_o + ((p0 + p) * dm.hq + hq) * D;
    for (int64_t d = 0; d < D; ++d) tmp[d] += w * po[d];
  }
  store_out(tmp, out + row * dm.o_s0 + hq * dm.o_s1, D, wsum > 0.f ? 1.f / wsum : 0.f);
}

// Run fn(task) for task in [0, n) on torch's intra-op threads, tasks handed out dynamically.
template <typename Init, typename Fn>
void parallel_tasks(int64_t n, Init init, Fn fn) {
  if (n <= 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    auto state = init();
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) fn(t, state);
  });
}

void check_index(const at::Tensor& t, const char* name, int64_t cols) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), name, ": int32 contiguous");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == cols, name, ": expected [N, ", cols, "]");
}

}  // namespace

// out[T, Hq, D] = attention of q over the paged K/V, per the planned work items.
void paged_attention(
    const at::Tensor& q,           // [T, Hq, D], last dim contiguous
    const at::Tensor& k_buf,       // [S, Hkv, D]
    const at::Tensor& v_buf,       // [S, Hkv, D]
    at::Tensor& out,               // [T, Hq, D], q's dtype, last dim contiguous
    const at::Tensor& page_table,  // [B, max_pages] int32
    const at::Tensor& items,       // [N, 7] int32
    const at::Tensor& item_rows,   // [K] int32: row lists of shared-prefix items (nq < 0)
    const at::Tensor& reduces,     // [R, 3] int32
    at::Tensor& part_o,            // [P, Hq, D] float32 (P >= 0)
    at::Tensor& part_lse,          // [P, Hq] float32
    int64_t page_size,
    double scale,
    int64_t window,
    int64_t kv_layout) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(kv_layout == KV_FLAT || kv_layout == KV_PAIRS16, "paged_attention: kv_layout 0 or 1");
  TORCH_CHECK(kv_layout == KV_FLAT || (kHasBf16Dot && k_buf.scalar_type() == at::kBFloat16 &&
                                       page_size % 16 == 0 && q.size(2) % 32 == 0 &&
                                       q.size(2) <= 256),
              "paged_attention: the pairs16 KV layout needs bf16 K/V, AVX512_BF16, page_size % 16 "
              "== 0 and head_dim % 32 == 0, <= 256");
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3 && out.dim() == 3);
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && k_buf.scalar_type() == v_buf.scalar_type()
              && out.scalar_type() == q.scalar_type(), "q, k_buf, v_buf, out: one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out: last dim contiguous");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "k_buf/v_buf: contiguous");
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes(), "k_buf and v_buf shapes differ");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 &&
              page_table.stride(1) == 1, "page_table: int32 [B, max_pages], rows contiguous");
  check_index(items, "items", 7);
  check_index(reduces, "reduces", 3);
  TORCH_CHECK(item_rows.scalar_type() == at::kInt && item_rows.is_contiguous() &&
              item_rows.dim() == 1, "item_rows: int32 [K]");
  TORCH_CHECK(part_o.scalar_type() == at::kFloat && part_o.is_contiguous());
  TORCH_CHECK(part_lse.scalar_type() == at::kFloat && part_lse.is_contiguous());
  const int64_t hq = q.size(1), hkv = k_buf.size(1), d = q.size(2);
  TORCH_CHECK(hq % hkv == 0 && k_buf.size(2) == d, "head counts / head dims do not match");
  TORCH_CHECK(d % 16 == 0, "paged_attention: head_dim must be a multiple of 16, got ", d);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(reduces.size(0) == 0 || part_o.dim() == 3 && part_o.size(1) == hq &&
              part_o.size(2) == d && part_lse.size(1) == hq, "partial buffers: [P, Hq, D]");
  Dims dm{hq, hkv, d, hq / hkv, page_size, window, q.stride(0), q.stride(1), out.stride(0),
          out.stride(1), k_buf.stride(0), k_buf.stride(1), page_table.stride(0), kv_layout};
  const int64_t n_items = items.size(0), n_red = reduces.size(0);
  const int32_t* it = items.data_ptr<int32_t>();
  int64_t max_nq = 1;
  for (int64_t i = 0; i < n_items; ++i)
    max_nq = std::max<int64_t>(max_nq, std::abs(static_cast<int64_t>(it[i * 7 + 2])));
  const int32_t* irows = item_rows.data_ptr<int32_t>();
  const float qscale = static_cast<float>(scale) * LOG2E;
  float* po = part_o.numel() ? part_o.data_ptr<float>() : nullptr;
  float* pl = part_lse.numel() ? part_lse.data_ptr<float>() : nullptr;
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_buf.data_ptr<scalar_t>();
    const scalar_t* vp = v_buf.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int32_t* pt = page_table.data_ptr<int32_t>();
    parallel_tasks(
        n_items,
        [&] {
          Scratch sc;
          sc.reserve(max_nq * hq, hkv, d);
          return sc;
        },
        [&](int64_t t, Scratch& sc) {
          attend_task<scalar_t>(it + t * 7, irows, qp, kp, vp, pt, op, po, pl, dm, qscale, sc);
        });
    const int32_t* rd = reduces.data_ptr<int32_t>();
    parallel_tasks(
        n_red * hq, [&] { return std::vector<float>(d); },
        [&](int64_t t, std::vector<float>& tmp) {
          reduce_task<scalar_t>(rd + (t / hq) * 3, t % hq, po, pl, op, dm, tmp.data());
        });
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_attention: dtype must be float32, bfloat16 or float16");
  }
}

// A plain dispatcher op (no pybind11: the extension compiles much faster), called as
// torch.ops.radixlm_cpu.paged_attention(...).
// Whether this build multiplies bf16 pairs (AVX512_BF16): the pairs16 KV layout needs it.
bool has_bf16_dot() { return kHasBf16Dot; }

TORCH_LIBRARY(radixlm_cpu, m) {
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def(
      "paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor(a!) out, Tensor page_table, "
      "Tensor items, Tensor item_rows, Tensor reduces, Tensor(b!) part_o, Tensor(c!) part_lse, "
      "int page_size, float scale, int window=0, int kv_layout=0) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("paged_attention", &paged_attention);
}
