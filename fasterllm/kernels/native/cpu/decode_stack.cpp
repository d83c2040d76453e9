// A decode batch's step through a stack of Llama-style decoder layers in one call (models/llama_cpu_decode.py):
// per layer the add + RMSNorm, the fused QKV product, RoPE with the K/V store, the attention, the output product,
// the add + RMSNorm, the gate/up product and SiLU(gate) * up, each by the same operator the Python layers call
// (ops.h; float products, SiLU and the product by ATen's and oneDNN's), in the same order on the same tensors, so
// the result is the same to the bit. What it saves is the Python between them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "ops.h"

namespace fasterllm_cpu {
namespace {

// how a linear's tensors (codes, scales, minimums; a float layer: its weight) are multiplied: cpu_gemv.py's packings,
// a weight packed for oneDNN (layers/linear.PackedCPULinear), a plain weight (torch's F.linear)
enum LinearKind : int64_t { kInt8 = 0, kInt4 = 1, kInt4Int8Inputs = 2, kUint8Grouped = 3, kOneDNN = 4, kPlain = 5 };

// x W^T over a weight in oneDNN's blocked layout: the operator layers/linear.onednn_linear calls
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed_weight, bias, c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down
constexpr int64_t kTensorsPerLinear = 4;  // three of the kind's, then the bias
constexpr int64_t kNormsPerLayer = 4;  // before the attention, before the FFN, each query head's, each key head's

// t, or nullopt where t is empty (an absent bias or norm)
std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct Linears {
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& kinds;  // kind, then output rows N, per linear
  const std::string& isa;

  at::Tensor apply(int64_t index, const at::Tensor& x) const {
    const at::Tensor* w = tensors.data() + index * kTensorsPerLinear;
    const int64_t kind = kinds[2 * index], rows = kinds[2 * index + 1];
    TORCH_CHECK(kind >= kInt8 && kind <= kPlain, "linear kind ", kind, " is not one decode_stack runs (0: int8, ",
                "1: int4, 2: int4 with int8 inputs, 3: uint8 grouped, 4: oneDNN-packed, 5: plain)");
    const std::optional<at::Tensor> bias = present(w[3]);
    if (kind == kOneDNN) return onednn_linear(x, w[0], bias);
    if (kind == kPlain) return at::linear(x, w[0], bias);
    at::Tensor out;  // the quantized layers add their bias after the product, as FlatLinear's matmul does
    if (kind == kInt8) out = int8_gemv(x, w[0], w[1], rows, isa);
    else if (kind == kUint8Grouped) out = uint8_grouped_gemv(x, w[0], w[1], w[2], rows, isa);
    else out = int4_gemv(x, w[0], w[1], w[2], rows, isa, kind == kInt4Int8Inputs);
    return bias.has_value() ? out + *bias : out;
  }
};

// one head kind's rows of qkv [B, H, D] (heads first..first + count - 1) through their RMSNorm, [B, count, D]
at::Tensor norm_head_rows(const at::Tensor& qkv, int64_t first, int64_t count, const at::Tensor& weight, double eps) {
  const at::Tensor rows = qkv.narrow(1, first, count).reshape({-1, qkv.size(2)});
  return std::get<0>(add_rms_norm_op(rows, std::nullopt, weight, eps)).view({qkv.size(0), count, qkv.size(2)});
}

// qkv [B, H, D] with its query and key heads each through their RMSNorm (Qwen3), the values as they are: what
// layers/attention_layer.norm_heads does
at::Tensor norm_heads(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, int64_t num_heads,
                      int64_t num_kv_heads, double eps) {
  return at::cat({norm_head_rows(qkv, 0, num_heads, q_norm, eps),
                  norm_head_rows(qkv, num_heads, num_kv_heads, k_norm, eps),
                  qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads)}, 1);
}

// hidden [B, H]: the embedding's rows of a decode batch (the first layer's norm has no residual to add) -> (the last
// layer's SiLU(gate) * up [B, I], the residual stream [B, H]): the last layer's down projection and the final norm
// are the caller's, as the Python layers leave them. Per layer l: norms 4l..4l + 3 (before the attention, before the
// FFN, the query heads' and the key heads': empty where the model has none); linears 4l..4l + 3 (qkv, o, gate_up,
// down), four tensors each (three of the kind's, empty ones where it has fewer, then the bias, empty where none) and
// (kind, N) in kinds; its KV cache kv_caches[l] (kv_caches: [layers, 2, blocks, block_size, Hkv, D]). cos / sin:
// the tokens' rotary rows [B, 1, D]; block_table, key_ranges: decode_attention_op's.
std::tuple<at::Tensor, at::Tensor> decode_stack(const at::Tensor& hidden, const std::vector<at::Tensor>& norms,
                                                const std::vector<at::Tensor>& linear_tensors,
                                                const std::vector<int64_t>& kinds, double eps, const at::Tensor& cos,
                                                const at::Tensor& sin, const at::Tensor& kv_caches,
                                                const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                                const at::Tensor& key_ranges, int64_t num_heads,
                                                int64_t num_kv_heads, int64_t head_dim, double scale,
                                                const std::string& isa) {
  const int64_t layers = kv_caches.dim() == 6 ? kv_caches.size(0) : 0;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(norms.size()) == kNormsPerLayer * layers &&
                  static_cast<int64_t>(linear_tensors.size()) == kLinearsPerLayer * kTensorsPerLinear * layers &&
                  static_cast<int64_t>(kinds.size()) == 2 * kLinearsPerLayer * layers,
              "decode_stack needs per layer 4 norms, 4 linears of 4 tensors, 4 (kind, N) pairs and a KV cache; got ",
              norms.size(), " norms, ", linear_tensors.size(), " linear tensors, ", kinds.size(), " kinds for a ",
              kv_caches.sizes(), " cache");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be the tokens' rows [B, H], got ", hidden.sizes());
  const int64_t tokens = hidden.size(0);
  const Linears linears{linear_tensors, kinds, isa};
  const int64_t heads = num_heads + 2 * num_kv_heads;
  at::Tensor normed, residual;
  std::tie(normed, residual) = add_rms_norm_op(hidden, std::nullopt, norms[0], eps);
  at::Tensor activated;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t first = kLinearsPerLayer * l;
    if (l > 0) std::tie(normed, residual) = add_rms_norm_op(linears.apply(first - 1, activated), residual,
                                                            norms[kNormsPerLayer * l], eps);
    at::Tensor qkv = linears.apply(first, normed).view({tokens, heads, head_dim});
    if (norms[kNormsPerLayer * l + 2].numel() > 0)
      qkv = norm_heads(qkv, norms[kNormsPerLayer * l + 2], norms[kNormsPerLayer * l + 3], num_heads, num_kv_heads, eps);
    const at::Tensor cache = kv_caches.select(0, l);
    rotary_store_op(qkv, cos, sin, cache, slot_mapping, num_heads);
    const at::Tensor attended = decode_attention_op(qkv.narrow(1, 0, num_heads), cache, block_table, key_ranges, scale);
    std::tie(normed, residual) = add_rms_norm_op(
        linears.apply(first + 1, attended.view({tokens, num_heads * head_dim})), residual,
        norms[kNormsPerLayer * l + 1], eps);
    const std::vector<at::Tensor> gate_up = linears.apply(first + 2, normed).chunk(2, -1);
    activated = at::silu(gate_up[0]) * gate_up[1];
  }
  return {activated, residual};
}

}  // namespace
}  // namespace fasterllm_cpu

TORCH_LIBRARY_FRAGMENT(fasterllm_cpu, m) {
  m.def("decode_stack(Tensor hidden, Tensor[] norms, Tensor[] linear_tensors, int[] kinds, float eps, Tensor cos, "
        "Tensor sin, Tensor(a!) kv_caches, Tensor slot_mapping, Tensor block_table, Tensor key_ranges, "
        "int num_heads, int num_kv_heads, int head_dim, float scale, str isa) -> (Tensor, Tensor)",
        &fasterllm_cpu::decode_stack);
}
