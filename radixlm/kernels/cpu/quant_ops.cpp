// Dequantize a weight packed for torch's CPU int4 kernel (aten::_weight_int4pack_mm_for_cpu), for
// the inputs with many rows, where a float GEMM on a dequantized copy beats the low-bit kernel.
//
// The pack stores blocks of rows one after the other, each block k-major: at input column k, a
// block of `size` rows holds size/2 bytes. Two byte layouts occur (the caller learns which block
// has which from the pack itself): `split` (full AVX-512 / AVX2 blocks), byte i holds row i in
// its low nibble and row i + size/2 in its high one; `paired` (tail blocks), byte i holds rows
// 2i and 2i + 1. This op writes the transposed weight,
//   out[k, n] = (q[n, k] - 8) * scale[k / group, n] + zero[k / group, n]
// (the kernel's formula, in float32, rounded once to the output dtype), reading the pack and
// writing each output row sequentially. Twin: `_dequantize_int4_cpu` in
// radixlm/runtime/quantization/kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPaired = 0, kSplit = 1;
constexpr int64_t kMaxBlock = 256;

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// Finite floats to `t`; bf16 rounds to nearest even, as at::BFloat16 does, with integer ops the
// compiler vectorizes (its constructor's NaN branch keeps the loop scalar).
inline void store_row(float* o, const float* v, int64_t size) {
#pragma omp simd
  for (int64_t j = 0; j < size; ++j) o[j] = v[j];
}
inline void store_row(at::BFloat16* o, const float* v, int64_t size) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(o);
#pragma omp simd
  for (int64_t j = 0; j < size; ++j) {
    uint32_t u;
    std::memcpy(&u, &v[j], sizeof(u));
    bits[j] = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

template <typename t>
void dequantize_blocks(const uint8_t* packed, const std::vector<int64_t>& sizes,
                       const std::vector<int64_t>& kinds, const t* sz, t* out, int64_t k,
                       int64_t n, int64_t group) {
  const int64_t nb = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> first(nb + 1, 0);
  for (int64_t b = 0; b < nb; ++b) first[b + 1] = first[b] + sizes[b];
  const int64_t groups = k / group;
  // one task per (block, group of k): its own rows of its own k range
  at::parallel_for(0, nb * groups, 1, [&](int64_t begin, int64_t end) {
    float scale[kMaxBlock], zero[kMaxBlock], vals[kMaxBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / groups, g = task % groups;
      const int64_t size = sizes[b], n0 = first[b], half = size / 2;
      const t* e = sz + (g * n + n0) * 2;
      for (int64_t j = 0; j < size; ++j) {  // this group's scales, rows n0 ..
        scale[j] = to_float(e[2 * j]);
        zero[j] = to_float(e[2 * j + 1]) - 8.0f * scale[j];
      }
      const uint8_t* src = packed + (n0 / 2) * k;  // the block: k * size / 2 bytes
      for (int64_t kk = g * group; kk < (g + 1) * group; ++kk) {
        const uint8_t* bytes = src + kk * half;
        if (kinds[b] == kSplit) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            vals[i] = static_cast<float>(bytes[i] & 15) * scale[i] + zero[i];
            vals[i + half] = static_cast<float>(bytes[i] >> 4) * scale[i + half] + zero[i + half];
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            vals[2 * i] = static_cast<float>(bytes[i] & 15) * scale[2 * i] + zero[2 * i];
            vals[2 * i + 1] =
                static_cast<float>(bytes[i] >> 4) * scale[2 * i + 1] + zero[2 * i + 1];
          }
        }
        store_row(out + kk * n + n0, vals, size);
      }
    }
  });
}

}  // namespace

// packed: uint8, the N * K / 2 bytes of the pack; blocks: int64 [NB, 2], each block's rows
// (in order, summing to N) and layout (0 paired, 1 split); scales_and_zeros: the kernel's
// [K / group, N, 2] (float32 or bfloat16). Returns [K, N] of the scales' dtype.
at::Tensor int4_dequantize_t(const at::Tensor& packed, const at::Tensor& blocks,
                             const at::Tensor& scales_and_zeros, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_dequantize_t: packed must be contiguous uint8");
  const at::Tensor& sz = scales_and_zeros;
  TORCH_CHECK(sz.dim() == 3 && sz.size(2) == 2 && sz.is_contiguous(),
              "int4_dequantize_t: scales_and_zeros must be contiguous [G, N, 2]");
  const int64_t n = sz.size(1), groups = sz.size(0);
  TORCH_CHECK(groups > 0 && k % groups == 0, "int4_dequantize_t: K must split into the groups");
  TORCH_CHECK(packed.numel() * 2 == n * k, "int4_dequantize_t: packed size is not N * K / 2");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 2, "int4_dequantize_t: blocks is [NB, 2]");
  const at::Tensor bl = blocks.to(at::kLong).contiguous();
  const int64_t* bp = bl.data_ptr<int64_t>();
  std::vector<int64_t> sizes, kinds;
  int64_t total = 0;
  for (int64_t b = 0; b < bl.size(0); ++b) {
    const int64_t s = bp[2 * b], kind = bp[2 * b + 1];
    TORCH_CHECK(s > 0 && s % 2 == 0 && s <= kMaxBlock && (kind == kPaired || kind == kSplit),
                "int4_dequantize_t: blocks are even sizes up to 256, layout 0 or 1");
    sizes.push_back(s);
    kinds.push_back(kind);
    total += s;
  }
  TORCH_CHECK(total == n, "int4_dequantize_t: block sizes must sum to N");
  at::Tensor out = at::empty({k, n}, sz.options());
  const int64_t group = k / groups;
  if (sz.scalar_type() == at::kFloat) {
    dequantize_blocks<float>(packed.data_ptr<uint8_t>(), sizes, kinds, sz.data_ptr<float>(),
                             out.data_ptr<float>(), k, n, group);
  } else {
    TORCH_CHECK(sz.scalar_type() == at::kBFloat16,
                "int4_dequantize_t: scales_and_zeros are float32 or bfloat16");
    dequantize_blocks<at::BFloat16>(packed.data_ptr<uint8_t>(), sizes, kinds,
                                    sz.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), k,
                                    n, group);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def(
      "int4_dequantize_t(Tensor packed, Tensor blocks, Tensor scales_and_zeros, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("int4_dequantize_t", &int4_dequantize_t); }
