// Paged attention on CPU that reads K/V where they lie (no gather copy).
//
// Layout (see radixlm/kernels/forward_batch.py): the K/V of layer l are [num_slots, Hkv, D];
// token j of request r lives at slot page_table[r, j / page_size] * page_size + j % page_size.
//
// The host plans once per forward a list of work items (int32 [N, 7]):
//   (req, row0, nq, pos0, kv_lo, kv_hi, part)
// meaning: query rows row0 .. row0 + nq - 1 of q (at positions pos0 .. pos0 + nq - 1 of request
// req) attend to the keys at positions [kv_lo, min(kv_hi, pos0 + nq)), causally (a query at
// position p sees keys <= p). part < 0: the normalized output goes to out; part >= 0: the item is
// one split of a split-KV decode, its normalized output and log2-sum-exp go to the partial
// buffers at index part, and a reduce item (row, part0, nparts) combines them.
//
// Each (item, kv head) is one task: the G = Hq / Hkv query heads that share the KV head are
// processed together, so every K/V row is loaded (and converted to fp32) once per task. Online
// softmax (flash attention) over key blocks of BLOCK_K, fp32 accumulation, exp2 domain. Tasks are
// handed out dynamically (atomic counter) to torch's intra-op threads (at::parallel_for).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int BLOCK_K = 64;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0 (x may be -inf: returns 0). Vectorizable: no branches, no calls.
// Round-to-nearest reduction to r in [-0.5, 0.5], degree-7 Taylor of e^(r ln 2):
// relative error < 1e-8 (below float32's epsilon).
inline float exp2_neg(float x) {
  x = x < -127.f ? -127.f : x;
  const float n = __builtin_floorf(x + 0.5f);
  const float r = (x - n) * 0.6931471805599453f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = static_cast<int32_t>(n) + 127;  // >= 0 after the clamp
  const float scale = __builtin_bit_cast(float, e << 23);
  return x <= -127.f ? 0.f : p * scale;
}

// Row conversion to fp32 (contiguous D elements).
inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(s[i]) << 16);
  }
}
inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc[0:n] = acc[0:n] * alpha
inline void scale_row(float* __restrict acc, float alpha, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] *= alpha;
}

// acc[0:n] += p * v[0:n]
inline void axpy(float* __restrict acc, float p, const float* __restrict v, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) acc[i] += p * v[i];
}

struct Dims {
  int64_t hq, hkv, d, group, page_size;
  int64_t q_s0, q_s1, o_s0, o_s1, kv_s0, kv_s1, pt_s0;
};

// Per-thread scratch, sized for the largest task of a call.
struct Scratch {
  std::vector<float> qf, acc, m, l, s, kf, vf;
  std::vector<const float*> krow, vrow;
  void reserve(int64_t rows, int64_t d) {
    qf.resize(rows * d);
    acc.resize(rows * d);
    m.resize(rows);
    l.resize(rows);
    s.resize(BLOCK_K);
    kf.resize(BLOCK_K * d);
    vf.resize(BLOCK_K * d);
    krow.resize(BLOCK_K);
    vrow.resize(BLOCK_K);
  }
};

template <typename T>
void attend_task(
    const int32_t* item,
    int64_t h,
    const T* q,
    const T* k_buf,
    const T* v_buf,
    const int32_t* page_table,
    T* out,
    float* part_o,   // [P, Hq, D]
    float* part_lse,  // [P, Hq]
    const Dims& dm,
    float qscale,
    Scratch& sc) {
  const int64_t req = item[0], row0 = item[1], nq = item[2], pos0 = item[3];
  const int64_t kv_lo = item[4], part = item[6];
  const int64_t kv_hi = std::min<int64_t>(item[5], pos0 + nq);
  const int64_t D = dm.d, G = dm.group, M = nq * G;
  float* qf = sc.qf.data();
  float* acc = sc.acc.data();
  float* mrow = sc.m.data();
  float* lrow = sc.l.data();
  float* s = sc.s.data();
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      to_float(q + (row0 + i) * dm.q_s0 + (h * G + g) * dm.q_s1, qf + r * D, D);
      scale_row(qf + r * D, qscale, D);
    }
  }
  std::fill(acc, acc + M * D, 0.f);
  std::fill(mrow, mrow + M, NEG_INF);
  std::fill(lrow, lrow + M, 0.f);
  const int32_t* pages = page_table + req * dm.pt_s0;
  const int64_t ps = dm.page_size;
  for (int64_t j0 = kv_lo; j0 < kv_hi; j0 += BLOCK_K) {
    const int64_t n = std::min<int64_t>(BLOCK_K, kv_hi - j0);
    for (int64_t jj = 0; jj < n; ++jj) {
      const int64_t pos = j0 + jj;
      const int64_t slot = static_cast<int64_t>(pages[pos / ps]) * ps + pos % ps;
      const T* kp = k_buf + slot * dm.kv_s0 + h * dm.kv_s1;
      const T* vp = v_buf + slot * dm.kv_s0 + h * dm.kv_s1;
      if constexpr (std::is_same_v<T, float>) {
        sc.krow[jj] = kp;
        sc.vrow[jj] = vp;
      } else {
        to_float(kp, sc.kf.data() + jj * D, D);
        to_float(vp, sc.vf.data() + jj * D, D);
        sc.krow[jj] = sc.kf.data() + jj * D;
        sc.vrow[jj] = sc.vf.data() + jj * D;
      }
    }
    for (int64_t r = 0; r < M; ++r) {
      const int64_t qpos = pos0 + r / G;
      const int64_t nv = std::min<int64_t>(n, qpos - j0 + 1);  // causal: keys <= qpos
      if (nv <= 0) continue;
      const float* qr = qf + r * D;
      float bmax = NEG_INF;
      for (int64_t jj = 0; jj < nv; ++jj) {
        s[jj] = dot(qr, sc.krow[jj], D);
        bmax = std::max(bmax, s[jj]);
      }
      const float m_new = std::max(mrow[r], bmax);
      const float alpha = exp2_neg(mrow[r] - m_new);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t jj = 0; jj < nv; ++jj) {
        s[jj] = exp2_neg(s[jj] - m_new);
        sum += s[jj];
      }
      float* ar = acc + r * D;
      if (alpha != 1.f) scale_row(ar, alpha, D);
      for (int64_t jj = 0; jj < nv; ++jj) axpy(ar, s[jj], sc.vrow[jj], D);
      lrow[r] = lrow[r] * alpha + sum;
      mrow[r] = m_new;
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g, hq = h * G + g;
      const float inv = lrow[r] > 0.f ? 1.f / lrow[r] : 0.f;
      if (part < 0) {
        from_float(acc + r * D, out + (row0 + i) * dm.o_s0 + hq * dm.o_s1, D, inv);
      } else {
        float* po = part_o + (part * dm.hq + hq) * D;
        for (int64_t d = 0; d < D; ++d) po[d] = acc[r * D + d] * inv;
        part_lse[part * dm.hq + hq] = mrow[r] + std::log2(lrow[r]);
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
    const float w = exp2_neg(part_lse[(p0 + p) * dm.hq + hq] - gmax);
    wsum += w;
    axpy(tmp, w, part_o + ((p0 + p) * dm.hq + hq) * D, D);
  }
  from_float(tmp, out + row * dm.o_s0 + hq * dm.o_s1, D, wsum > 0.f ? 1.f / wsum : 0.f);
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
    const at::Tensor& reduces,     // [R, 3] int32
    at::Tensor& part_o,            // [P, Hq, D] float32 (P >= 0)
    at::Tensor& part_lse,          // [P, Hq] float32
    int64_t page_size,
    double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
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
  TORCH_CHECK(part_o.scalar_type() == at::kFloat && part_o.is_contiguous());
  TORCH_CHECK(part_lse.scalar_type() == at::kFloat && part_lse.is_contiguous());
  const int64_t hq = q.size(1), hkv = k_buf.size(1), d = q.size(2);
  TORCH_CHECK(hq % hkv == 0 && k_buf.size(2) == d, "head counts / head dims do not match");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(reduces.size(0) == 0 || part_o.dim() == 3 && part_o.size(1) == hq &&
              part_o.size(2) == d && part_lse.size(1) == hq, "partial buffers: [P, Hq, D]");
  Dims dm{hq, hkv, d, hq / hkv, page_size, q.stride(0), q.stride(1), out.stride(0),
          out.stride(1), k_buf.stride(0), k_buf.stride(1), page_table.stride(0)};
  const int64_t n_items = items.size(0), n_red = reduces.size(0);
  const int32_t* it = items.data_ptr<int32_t>();
  int64_t max_nq = 1;
  for (int64_t i = 0; i < n_items; ++i) max_nq = std::max<int64_t>(max_nq, it[i * 7 + 2]);
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
        n_items * hkv,
        [&] {
          Scratch sc;
          sc.reserve(max_nq * dm.group, d);
          return sc;
        },
        [&](int64_t t, Scratch& sc) {
          attend_task<scalar_t>(it + (t / hkv) * 7, t % hkv, qp, kp, vp, pt, op, po, pl, dm,
                                qscale, sc);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over K/V read in place (CPU)");
}
