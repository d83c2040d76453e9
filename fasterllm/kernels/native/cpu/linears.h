// A decoder layer's projections as the decode stacks (decode_stack.cpp, seq2seq_decode_stack.cpp) multiply them: each
// by the operator its Python layer calls (models/cpu_decode_linears.py says which), so a stack's result is the layers'.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace fasterllm_cpu {

// how a linear's tensors (codes, scales, minimums; a float layer: its weight) are multiplied: cpu_gemv.py's packings,
// a weight packed for oneDNN (layers/linear.PackedCPULinear), a plain weight (torch's F.linear), fp32 tiles
// (layers/linear.TiledCPULinear)
enum LinearKind : int64_t {
  kInt8 = 0, kInt4 = 1, kInt4Int8Inputs = 2, kUint8Grouped = 3, kOneDNN = 4, kPlain = 5, kFloatTiles = 6
};

constexpr int64_t kTensorsPerLinear = 4;  // three of the kind's, then the bias

// x W^T over a weight in oneDNN's blocked layout: the operator layers/linear.onednn_linear calls
inline at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                                const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed_weight, bias, c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// t, or nullopt where t is empty (an absent bias or norm)
inline std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct Linears {
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& kinds;  // kind, then output rows N, per linear
  const std::string& isa;

  // x [M, K] (made contiguous, as the Python layers make their inputs) -> [M, N]
  at::Tensor apply(int64_t index, const at::Tensor& input) const {
    const at::Tensor* w = tensors.data() + index * kTensorsPerLinear;
    const int64_t kind = kinds[2 * index], rows = kinds[2 * index + 1];
    TORCH_CHECK(kind >= kInt8 && kind <= kFloatTiles, "linear kind ", kind, " is not one a decode stack runs (0: ",
                "int8, 1: int4, 2: int4 with int8 inputs, 3: uint8 grouped, 4: oneDNN-packed, 5: plain, ",
                "6: fp32 tiles)");
    const at::Tensor x = input.contiguous();
    const std::optional<at::Tensor> bias = present(w[3]);
    if (kind == kOneDNN) return onednn_linear(x, w[0], bias);
    if (kind == kPlain) return at::linear(x, w[0], bias);
    if (kind == kFloatTiles) return float_gemv(x, w[0], bias, rows, isa);
    at::Tensor out;  // the quantized layers add their bias after the product, as FlatLinear's matmul does
    if (kind == kInt8) out = int8_gemv(x, w[0], w[1], rows, isa);
    else if (kind == kUint8Grouped) out = uint8_grouped_gemv(x, w[0], w[1], w[2], rows, isa);
    else out = int4_gemv(x, w[0], w[1], w[2], rows, isa, kind == kInt4Int8Inputs);
    return bias.has_value() ? out + *bias : out;
  }
};

}  // namespace fasterllm_cpu
