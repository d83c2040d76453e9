// A decode batch's step through a stack of Llama-style decoder layers in one call (models/llama_cpu_decode.py):
// per layer the add + RMSNorm, the fused QKV product, RoPE with the K/V store, the attention, the output product,
// the add + RMSNorm, the gate/up product and SiLU(gate) * up, each by the same operator the Python layers call
// (ops.h; float products, SiLU and the product by ATen's and oneDNN's), in the same order on the same tensors, so
// the result is the same to the bit. What it saves is the Python between them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "linears.h"
#include "ops.h"

namespace fasterllm_cpu {
namespace {

constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down
constexpr int64_t kNormsPerLayer = 4;  // before the attention, before the FFN, each query head's, each key head's

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
