// The layer stack of a Llama-family decoder on CPU in one op call per forward.
//
// The same ops, in the same order, as the Python layer (radixlm/runtime/models/llama.py with the
// `cpu` layer-op set): per layer
//   h = rms_norm(x) (layer 0: residual = x) | add_rms_norm(x, residual)
//   qkv = linear(h); rope_(q, k); store_kv; paged_attention; o = linear(attn)
//   h = add_rms_norm(o, residual); x = linear(silu_and_mul(linear(h)))
// (the gate_up projection and SiLU-and-mul one call of radixlm's bf16 kernel where it is packed
// gated: the same numerics, linear_bf16.cpp)
// with the bf16 linears through radixlm's packed kernel (linear_bf16.cpp) or oneDNN on prepacked
// weights (mkldnn::_linear_pointwise, called through the dispatcher by name), or, for a linear
// given scales, the weight-only low-bit kernels on the packed weight (int8: radixlm's int8_mm
// (int8_gemm.cpp) on bf16, else aten::_weight_int8pack_mm; uint8 with fp16 scales: radixlm's
// int4_g32_mm (int4_gemm.cpp); uint8 otherwise: aten::_weight_int4pack_mm_for_cpu, group size
// K / scales.size(0)) plus the bias, as radixlm.runtime.quantization.QuantLinear does. What it removes is the Python between the ops: ~4 ms of a 17 ms
// batch-1 SmolLM2 step (30 layers x ~15 module calls, wrappers and dispatches).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

// Defined in fused_ops.cpp and paged_attention.cpp (same library).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
           const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w_packed,
                       const std::optional<at::Tensor>& b, int64_t n, bool gated);
int64_t linear_bf16_max_rows();
int64_t linear_bf16_fp32_max_rows();
at::Tensor int4_g32_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_mins);
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales);
bool has_bf16_dot();
void store_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v, int64_t kv_layout);
void paged_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     at::Tensor& out, const at::Tensor& page_table, const at::Tensor& items,
                     const at::Tensor& item_rows, const at::Tensor& reduces,
                     at::Tensor& part_o, at::Tensor& part_lse, int64_t page_size, double scale,
                     int64_t window, int64_t kv_layout);

namespace {

const c10::OperatorHandle& linear_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  return op;
}

// y = x @ W^T + b with W prepacked by mkldnn::_reorder_linear_weight.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& b) {
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(b);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  linear_op().callBoxed(&stack);
  return stack[0].toTensor();
}

// Inputs of at most this many rows take radixlm's packed kernel (bf16 x: the bf16 path; fp32 x:
// the fp32-activation path on bf16 weights, linear_bf16.cpp).
int64_t packed_max_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? linear_bf16_fp32_max_rows() : linear_bf16_max_rows();
}

// A layer linear of `n` outputs: radixlm's packed kernel on `packed` (given: inputs of at most
// `packed_max_rows(x)` rows), else oneDNN-prepacked `w` (no scales) or weight-only int8 /
// int4 (scales given).
at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& s, const std::optional<at::Tensor>& b,
                        const std::optional<at::Tensor>& packed, int64_t n) {
  if (packed.has_value() && x.size(0) <= packed_max_rows(x))
    return linear_bf16(x, *packed, b, n, false);
  if (!s.has_value()) return packed_linear(x, w, b);
  at::Tensor y;
  if (w.scalar_type() == at::kChar) {
    // radixlm's int8 kernel where it runs (bf16 activations and scales, AVX512_BF16)
    if (has_bf16_dot() && x.scalar_type() == at::kBFloat16 && s->scalar_type() == at::kBFloat16)
      y = int8_mm(x, w, *s);
    else
      y = at::_weight_int8pack_mm(x, w, *s);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kByte, "decoder_stack: quantized weights are int8 or uint8");
    // radixlm's int4 layout: fp16 scales and mins [N, K / 32, 2] (torch's: [K / g, N, 2] in the
    // activation dtype; an fp16 model's would also need K / g == N == K / 32 to look alike)
    if (s->scalar_type() == at::kHalf && s->dim() == 3 && s->size(0) == w.size(0) &&
        s->size(1) * 16 == w.size(1)) {
      y = int4_g32_mm(x, w, *s);
    } else {
      y = at::_weight_int4pack_mm_for_cpu(x, w, x.size(1) / s->size(0), *s);
    }
  }
  if (b.has_value()) y = y + *b;
  return y;
}

}  // namespace

// A model's constants of `decoder_stack`, gathered once (`radixlm_cpu::DecoderWeights`): a
// forward passes this one object, not ~10 per-layer tensor lists. Each tensor of a list copied
// for a call is a reference to a Python-owned weight, and dropping it when the op returns takes
// the GIL (torch's PyObject preservation): ~300 GIL round trips a forward, each a wait while
// another Python thread (the server's event loop) holds it. Held here, the references stay.
struct DecoderWeights : torch::CustomClassHolder {
  std::vector<at::Tensor> ln1, ln2, w_qkv, w_o, w_gate_up, w_down, k_bufs, v_bufs;
  std::vector<std::optional<at::Tensor>> s_qkv, b_qkv, s_o, b_o, s_gate_up, b_gate_up, s_down,
      b_down, packed;
  at::Tensor cos, sin;
  double eps, scale;
  int64_t num_heads, num_kv_heads, head_dim, kv_layout;
  std::vector<int64_t> out_features;

  static std::vector<std::optional<at::Tensor>> opt(const c10::List<std::optional<at::Tensor>>& l) {
    std::vector<std::optional<at::Tensor>> out;
    out.reserve(l.size());
    for (size_t i = 0; i < l.size(); ++i) out.push_back(l.get(i));
    return out;
  }

  DecoderWeights(std::vector<at::Tensor> ln1_, std::vector<at::Tensor> ln2_,
                 std::vector<at::Tensor> w_qkv_, c10::List<std::optional<at::Tensor>> s_qkv_,
                 c10::List<std::optional<at::Tensor>> b_qkv_, std::vector<at::Tensor> w_o_,
                 c10::List<std::optional<at::Tensor>> s_o_,
                 c10::List<std::optional<at::Tensor>> b_o_, std::vector<at::Tensor> w_gate_up_,
                 c10::List<std::optional<at::Tensor>> s_gate_up_,
                 c10::List<std::optional<at::Tensor>> b_gate_up_,
                 std::vector<at::Tensor> w_down_, c10::List<std::optional<at::Tensor>> s_down_,
                 c10::List<std::optional<at::Tensor>> b_down_, std::vector<at::Tensor> k_bufs_,
                 std::vector<at::Tensor> v_bufs_, at::Tensor cos_, at::Tensor sin_,
                 c10::List<std::optional<at::Tensor>> packed_, std::vector<int64_t> out_features_,
                 double eps_, double scale_, int64_t num_heads_, int64_t num_kv_heads_,
                 int64_t head_dim_, int64_t kv_layout_)
      : ln1(std::move(ln1_)), ln2(std::move(ln2_)), w_qkv(std::move(w_qkv_)),
        w_o(std::move(w_o_)), w_gate_up(std::move(w_gate_up_)), w_down(std::move(w_down_)),
        k_bufs(std::move(k_bufs_)), v_bufs(std::move(v_bufs_)), s_qkv(opt(s_qkv_)),
        b_qkv(opt(b_qkv_)), s_o(opt(s_o_)), b_o(opt(b_o_)), s_gate_up(opt(s_gate_up_)),
        b_gate_up(opt(b_gate_up_)), s_down(opt(s_down_)), b_down(opt(b_down_)),
        packed(opt(packed_)), cos(std::move(cos_)), sin(std::move(sin_)), eps(eps_),
        scale(scale_), num_heads(num_heads_), num_kv_heads(num_kv_heads_), head_dim(head_dim_),
        kv_layout(kv_layout_), out_features(std::move(out_features_)) {
    const size_t n = ln1.size();
    TORCH_CHECK(ln2.size() == n && w_qkv.size() == n && w_o.size() == n &&
                    w_gate_up.size() == n && w_down.size() == n && k_bufs.size() == n &&
                    v_bufs.size() == n && b_qkv.size() == n && b_o.size() == n &&
                    b_gate_up.size() == n && b_down.size() == n && s_qkv.size() == n &&
                    s_o.size() == n && s_gate_up.size() == n && s_down.size() == n,
                "DecoderWeights: every per-layer list must have one entry per layer");
    TORCH_CHECK(packed.empty() || packed.size() == 4 * n,
                "DecoderWeights: packed holds 4 entries per layer (qkv, o, gate_up, down) or none");
    TORCH_CHECK(out_features.size() == 4,
                "DecoderWeights: out_features holds the qkv, o, intermediate and down widths");
  }
};

std::tuple<at::Tensor, at::Tensor> decoder_stack(
    const c10::intrusive_ptr<DecoderWeights>& weights,
    const at::Tensor& x_in,  // [T, H] embeddings
    const at::Tensor& positions, const at::Tensor& slots, const at::Tensor& page_table,
    const at::Tensor& items, const at::Tensor& item_rows, const at::Tensor& reduces,
    at::Tensor& part_o, at::Tensor& part_lse, int64_t page_size) {
  const DecoderWeights& W = *weights;
  const int64_t n = static_cast<int64_t>(W.ln1.size());
  // (layer l, projection j): radixlm's packed bf16 weight, when there is one
  auto pk = [&](int64_t l, int64_t j) -> const std::optional<at::Tensor>& {
    static const std::optional<at::Tensor> none;
    return W.packed.empty() ? none : W.packed[4 * l + j];
  };
  // packed gate_up weights are packed gated (a Llama MLP's SiLU), of n_inter outputs
  const int64_t n_qkv = W.out_features[0], n_o = W.out_features[1], n_inter = W.out_features[2],
                n_down = W.out_features[3];
  const int64_t num_heads = W.num_heads, num_kv_heads = W.num_kv_heads, head_dim = W.head_dim;
  const int64_t kv_layout = W.kv_layout;
  const double eps = W.eps;
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous(), "decoder_stack: x must be [T, H]");
  const int64_t t = x_in.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor x = x_in;
  at::Tensor residual;
  for (int64_t l = 0; l < n; ++l) {
    at::Tensor h;
    if (l == 0) {
      residual = x;  // the embeddings: a fresh tensor, updated in place from here on
      h = rms_norm(x, W.ln1[l], eps);
    } else {
      h = add_rms_norm(x, residual, W.ln1[l], eps);
    }
    // [T, q + 2 kv]
    at::Tensor qkv = layer_linear(h, W.w_qkv[l], W.s_qkv[l], W.b_qkv[l], pk(l, 0), n_qkv);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decoder_stack: qkv width mismatch");
    at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    rope_(q, k, positions, W.cos, W.sin);
    at::Tensor k_buf = W.k_bufs[l], v_buf = W.v_bufs[l];
    store_kv(k_buf, v_buf, slots, k, v, kv_layout);
    at::Tensor qc = q.scalar_type() == k_buf.scalar_type() ? q : q.to(k_buf.scalar_type());
    at::Tensor attn = at::empty({t, num_heads, head_dim}, qc.options());
    paged_attention(qc, k_buf, v_buf, attn, page_table, items, item_rows, reduces, part_o,
                    part_lse, page_size, W.scale, 0, kv_layout);
    if (attn.scalar_type() != x.scalar_type()) attn = attn.to(x.scalar_type());
    at::Tensor o =
        layer_linear(attn.view({t, q_size}), W.w_o[l], W.s_o[l], W.b_o[l], pk(l, 1), n_o);
    h = add_rms_norm(o, residual, W.ln2[l], eps);
    at::Tensor act;  // [T, I]
    if (pk(l, 2).has_value() && t <= packed_max_rows(h)) {
      act = linear_bf16(h, *pk(l, 2), W.b_gate_up[l], n_inter, true);
    } else {
      act = silu_and_mul(
          layer_linear(h, W.w_gate_up[l], W.s_gate_up[l], W.b_gate_up[l], std::nullopt, 0));
    }
    x = layer_linear(act, W.w_down[l], W.s_down[l], W.b_down[l], pk(l, 3), n_down);
  }
  return {x, residual};
}

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.class_<DecoderWeights>("DecoderWeights")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       c10::List<std::optional<at::Tensor>>, c10::List<std::optional<at::Tensor>>,
                       std::vector<at::Tensor>, c10::List<std::optional<at::Tensor>>,
                       c10::List<std::optional<at::Tensor>>, std::vector<at::Tensor>,
                       c10::List<std::optional<at::Tensor>>, c10::List<std::optional<at::Tensor>>,
                       std::vector<at::Tensor>, c10::List<std::optional<at::Tensor>>,
                       c10::List<std::optional<at::Tensor>>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, at::Tensor, at::Tensor,
                       c10::List<std::optional<at::Tensor>>, std::vector<int64_t>, double, double,
                       int64_t, int64_t, int64_t, int64_t>());
  m.def(
      "decoder_stack(__torch__.torch.classes.radixlm_cpu.DecoderWeights weights, Tensor x, "
      "Tensor positions, Tensor slots, Tensor page_table, Tensor items, Tensor item_rows, "
      "Tensor reduces, Tensor(a!) part_o, Tensor(b!) part_lse, int page_size) -> (Tensor, Tensor)");
}

// CatchAll: fp32 prepacked weights are MkldnnCPU tensors, bf16 ones plain CPU tensors.
TORCH_LIBRARY_IMPL(radixlm_cpu, CatchAll, m) { m.impl("decoder_stack", &decoder_stack); }
