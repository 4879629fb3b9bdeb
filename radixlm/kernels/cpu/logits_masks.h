// The grammar masks an LM head writes into its logits (int8_gemm.cpp's int8_mm_logits,
// linear_bf16.cpp's linear_bf16_logits): the one check of the bitmask and the rows, and per
// output row the bitmask row that masks it.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace radixlm_cpu {

// Per row of an [M, n] output, the int32 bitmask row ([B, W], xgrammar's layout: token t
// allowed iff bit t % 32 of word t / 32 is 1) that masks it, nullptr for a row not in `rows`.
inline std::vector<const uint32_t*> logits_masks(const char* op,
                                                 const std::optional<at::Tensor>& bitmask,
                                                 const at::Tensor& rows, int64_t M, int64_t n) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, op, ": rows must be int64 [R]");
  std::vector<const uint32_t*> out(M, nullptr);
  if (!bitmask.has_value()) {
    TORCH_CHECK(rows.size(0) == 0, op, ": rows to mask need a bitmask");
    return out;
  }
  const at::Tensor& bm = *bitmask;
  TORCH_CHECK(bm.dim() == 2 && bm.scalar_type() == at::kInt && bm.is_contiguous(), op,
              ": bitmask must be a contiguous int32 [B, W]");
  const int64_t W = bm.size(1);
  TORCH_CHECK(32 * W >= n, op, ": bitmask too narrow for ", n, " outputs");
  const auto* words = reinterpret_cast<const uint32_t*>(bm.data_ptr<int32_t>());
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < M && rp[i] < bm.size(0), "row ", rp[i], " out of range");
    out[rp[i]] = words + rp[i] * W;
  }
  return out;
}

}  // namespace radixlm_cpu
