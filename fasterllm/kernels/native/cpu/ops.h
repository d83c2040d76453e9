// The torch operators of ops.cpp, for other operators of this extension that chain them (decode_stack.cpp): each
// checks its tensors and runs its kernel over torch's intra-op threads, as torch.ops.fasterllm_cpu.<name> does.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace fasterllm_cpu {

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t N, const std::string& isa, bool int8_inputs);
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N,
                     const std::string& isa);
at::Tensor uint8_grouped_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, int64_t N, const std::string& isa);
at::Tensor float_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t N,
                      const std::string& isa);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                    const at::Tensor& weight, double eps);
at::Tensor decode_attention_op(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                               const at::Tensor& key_ranges, double scale);
void rotary_store_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, int64_t num_heads);

}  // namespace fasterllm_cpu
