// A decode batch's step through the decoder layers of a BART-family encoder-decoder (BART, mBART, Marian, M2M100) in
// one call (models/seq2seq_cpu_decode.py): per layer the fused QKV product, the K/V store, self-attention over the
// paged cache, the output product, the residual add and LayerNorm (post-norm, or the norm before each block:
// pre-norm), the cross-attention query product, attention over the request's cross blocks, its output product, the
// add and norm, then fc1, the activation, fc2, the add and norm. Each is the operator the Python layers
// (models/bart.py, layers/attention.py) call, in the same order on tensors of the same shapes and strides: SDPA over
// the gathered (or, for one sequence's consecutive blocks, viewed) blocks, or the C++ decode attention where the
// Python path takes it. So the result is the layers' to the bit; what it saves is the Python between them, a fifth
// of a Marian-base fp32 step on two cores (benchmarks/RESULTS.md, twenty-fifth session).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "linears.h"
#include "ops.h"

namespace fasterllm_cpu {
namespace {

constexpr int64_t kLinearsPerLayer = 6;  // qkv, out, cross q, cross out, fc1, fc2
constexpr int64_t kNormsPerLayer = 6;  // self-attention's, cross-attention's and the FFN's LayerNorm: weight, bias
constexpr int64_t kGroupTensors = 6;  // blocks, mask, query places, result places, block table, key ranges
constexpr int64_t kGroupInts = 6;  // first block, end block, first key, end key, rows per query run, native

// A DecodeGroup of layers/attention.py as the stack reads it: which blocks and keys each row attends to.
struct Group {
  std::optional<at::Tensor> blocks;  // gathered block ids; none: the range [block_start, block_end) read in place
  std::optional<at::Tensor> mask;  // [B, 1, 1, keys] True where visible; none: one sequence
  std::optional<at::Tensor> places, results;  // a cross group's query runs (rows sharing one cross table)
  at::Tensor block_table, key_ranges;  // for decode_attention_op
  int64_t block_start, block_end, key_start, key_end, rows_each;
  bool native;  // the C++ decode attention (bf16, or fp32 released from bit-equality) rather than SDPA

  Group(const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& ints, const char* what) {
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == kGroupTensors && static_cast<int64_t>(ints.size()) ==
                    kGroupInts, what, " group needs ", kGroupTensors, " tensors and ", kGroupInts, " ints, got ",
                tensors.size(), " and ", ints.size());
    blocks = present(tensors[0]);
    mask = present(tensors[1]);
    places = present(tensors[2]);
    results = present(tensors[3]);
    block_table = tensors[4];
    key_ranges = tensors[5];
    block_start = ints[0], block_end = ints[1], key_start = ints[2], key_end = ints[3], rows_each = ints[4];
    native = ints[5] != 0;
  }
};

// query [B, Hq, D] over a layer's cache [2, blocks, block_size, Hkv, D] -> [B, Hq, D]: what
// layers/attention.py's _decode_attention does (no soft-capping, no fp8 cache)
at::Tensor attend(const at::Tensor& query, const at::Tensor& cache, const Group& g, double scale) {
  if (g.native) return decode_attention_op(query, cache, g.block_table, g.key_ranges, scale);
  const int64_t num_heads = query.size(1), head_dim = query.size(2), num_kv_heads = cache.size(-2);
  const int64_t group = num_heads / num_kv_heads;
  at::Tensor rows = query;
  int64_t rows_each = 1;
  if (g.places.has_value()) {
    rows = query.index_select(0, *g.places);
    rows_each = g.rows_each;
  }
  const int64_t batch = rows.size(0) / rows_each;
  const at::Tensor q = rows.view({batch, rows_each, num_kv_heads, group, head_dim}).transpose(1, 2).reshape(
      {batch, num_kv_heads, rows_each * group, head_dim});
  const at::Tensor raw = g.blocks.has_value() ? cache.index_select(1, *g.blocks)
                                              : cache.slice(1, g.block_start, g.block_end);
  const at::Tensor kv = raw.view({2, batch, -1, num_kv_heads, head_dim}).slice(2, g.key_start, g.key_end)
                            .transpose(2, 3);
  const at::Tensor out = at::scaled_dot_product_attention(q, kv.select(0, 0), kv.select(0, 1), g.mask, 0.0, false,
                                                          scale, true);
  if (!g.places.has_value()) return out.reshape({batch, num_heads, head_dim});
  return out.view({batch, num_kv_heads, rows_each, group, head_dim}).transpose(1, 2)
      .reshape({batch * rows_each, num_heads, head_dim}).index_select(0, *g.results);
}

at::Tensor activate(const at::Tensor& x, const std::string& activation) {
  if (activation == "silu") return at::silu(x);
  if (activation == "gelu") return at::gelu(x, "none");
  if (activation == "gelu_tanh") return at::gelu(x, "tanh");
  if (activation == "relu") return at::relu(x);
  TORCH_CHECK(false, "activation ", activation, " is not one seq2seq_decode_stack runs (silu, gelu, gelu_tanh, relu)");
}

// hidden [B, H]: the decoder's embedded rows of a decode batch (one new token per sequence) -> the last layer's
// output [B, H] (the final norm of a pre-norm model and the head are the caller's). Per layer l: norms 6l..6l + 5
// (LayerNorm weight and bias before or after self-attention, cross-attention, the FFN); linears 6l..6l + 5 (qkv, out,
// cross q, cross out, fc1, fc2), four tensors each (linears.h) and (kind, N) in kinds; its cache kv_caches[l]
// (kv_caches: [layers, 2, blocks, block_size, H, D]), where slot_mapping says each row's new K/V go. self_* and
// cross_*: the rows' DecodeGroup for self-attention and for cross-attention (Group).
at::Tensor seq2seq_decode_stack(const at::Tensor& hidden, const std::vector<at::Tensor>& norms,
                                const std::vector<at::Tensor>& linear_tensors, const std::vector<int64_t>& kinds,
                                double eps, bool pre_norm, const std::string& activation, const at::Tensor& kv_caches,
                                const at::Tensor& slot_mapping, const std::vector<at::Tensor>& self_tensors,
                                const std::vector<int64_t>& self_ints, const std::vector<at::Tensor>& cross_tensors,
                                const std::vector<int64_t>& cross_ints, int64_t num_heads, int64_t head_dim,
                                double scale, double cross_scale, const std::string& isa) {
  const int64_t layers = kv_caches.dim() == 6 ? kv_caches.size(0) : 0;
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(norms.size()) == kNormsPerLayer * layers &&
                  static_cast<int64_t>(linear_tensors.size()) == kLinearsPerLayer * kTensorsPerLinear * layers &&
                  static_cast<int64_t>(kinds.size()) == 2 * kLinearsPerLayer * layers,
              "seq2seq_decode_stack needs per layer 6 norm tensors, 6 linears of 4 tensors, 6 (kind, N) pairs and a "
              "KV cache; got ", norms.size(), " norm tensors, ", linear_tensors.size(), " linear tensors, ",
              kinds.size(), " kinds for a ", kv_caches.sizes(), " cache");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be the tokens' rows [B, H], got ", hidden.sizes());
  const Group self_group(self_tensors, self_ints, "the self-attention"), cross(cross_tensors, cross_ints,
                                                                                "the cross-attention");
  const int64_t tokens = hidden.size(0), stored = slot_mapping.size(0);
  const Linears linears{linear_tensors, kinds, isa};
  const std::vector<int64_t> width{hidden.size(1)};
  at::Tensor x = hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t first = kLinearsPerLayer * l;
    const at::Tensor cache = kv_caches.select(0, l);
    // x + block(norm(x)) (pre-norm) or norm(x + block(x)) (post-norm): models/bart.py's _residual
    const auto residual = [&](int64_t norm, const std::function<at::Tensor(const at::Tensor&)>& block) {
      const at::Tensor& weight = norms[kNormsPerLayer * l + 2 * norm];
      const at::Tensor& bias = norms[kNormsPerLayer * l + 2 * norm + 1];
      if (pre_norm) return x + block(at::layer_norm(x, width, weight, bias, eps));
      return at::layer_norm(x + block(x), width, weight, bias, eps);
    };
    x = residual(0, [&](const at::Tensor& h) {
      const at::Tensor qkv = linears.apply(first, h).view({tokens, 3 * num_heads, head_dim});
      const at::Tensor new_kv = qkv.narrow(1, num_heads, 2 * num_heads).narrow(0, 0, stored);
      cache.view({2, -1, num_heads, head_dim}).index_copy_(
          1, slot_mapping, new_kv.view({stored, 2, num_heads, head_dim}).transpose(0, 1));
      const at::Tensor attended = attend(qkv.narrow(1, 0, num_heads), cache, self_group, scale);
      return linears.apply(first + 1, attended.reshape({tokens, num_heads * head_dim}));
    });
    x = residual(1, [&](const at::Tensor& h) {
      const at::Tensor query = linears.apply(first + 2, h).view({-1, num_heads, head_dim});
      return linears.apply(first + 3, attend(query, cache, cross, cross_scale).reshape({tokens, -1}));
    });
    x = residual(2, [&](const at::Tensor& h) {
      return linears.apply(first + 5, activate(linears.apply(first + 4, h), activation));
    });
  }
  return x;
}

}  // namespace
}  // namespace fasterllm_cpu

TORCH_LIBRARY_FRAGMENT(fasterllm_cpu, m) {
  m.def("seq2seq_decode_stack(Tensor hidden, Tensor[] norms, Tensor[] linear_tensors, int[] kinds, float eps, "
        "bool pre_norm, str activation, Tensor(a!) kv_caches, Tensor slot_mapping, Tensor[] self_tensors, "
        "int[] self_ints, Tensor[] cross_tensors, int[] cross_ints, int num_heads, int head_dim, float scale, "
        "float cross_scale, str isa) -> Tensor",
        &fasterllm_cpu::seq2seq_decode_stack);
}
