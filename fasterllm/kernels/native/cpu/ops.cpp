// torch operators over gemv.h's kernels: torch.ops.fasterllm_cpu.int4_gemv / int8_gemv. They check their tensors,
// quantize the input rows once and split the output rows over torch's intra-op threads (at::parallel_for).
// The ISA ("avx2" or "avx512") is the caller's choice (kernels/native/cpu_gemv.py picks it at start-up); a choice
// this CPU cannot run is refused here rather than left to crash on an illegal instruction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "gemv.h"

namespace fasterllm_cpu {
namespace {

constexpr int64_t kGrainRows = 64;  // output rows per thread at least: fewer are not worth a thread's start

bool runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
}

bool runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool use_avx512(const std::string& isa) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512", "isa must be 'avx2' or 'avx512', got '", isa, "'");
  TORCH_CHECK(isa == "avx2" ? runs_avx2() : runs_avx512(), "this CPU cannot run the '", isa,
              "' kernels (avx2 needs avx2/fma/f16c; avx512 needs avx512f/bw/dq/vl and avx512_vnni); pass the ISA that "
              "fasterllm.kernels.native.cpu_gemv.kernel_isa() names");
  return isa == "avx512";
}

struct Quantized {
  at::Tensor codes, scales, sums, errors;
  QuantizedRows rows;
};

Quantized quantize(const at::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "input must be [rows, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "input must be float32 or bfloat16, got ", x.scalar_type());
  const at::Tensor values = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), blocks = K / kBlock;
  Quantized q;
  q.codes = at::empty({M, K}, values.options().dtype(at::kChar));
  q.scales = at::empty({M, blocks * kLanes}, values.options());
  q.sums = at::empty({M, blocks}, values.options());
  q.errors = at::empty({M, blocks}, values.options());
  quantize_rows(values.data_ptr<float>(), M, K, q.codes.data_ptr<int8_t>(), q.scales.data_ptr<float>(),
                q.sums.data_ptr<float>(), q.errors.data_ptr<float>());
  q.rows = QuantizedRows{q.codes.data_ptr<int8_t>(), q.scales.data_ptr<float>(), q.sums.data_ptr<float>(),
                         q.errors.data_ptr<float>(), M, K};
  return q;
}

void check_weight(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous CPU ", dtype, " tensor of shape ", shape, ", got ", t.scalar_type(), " ",
              t.sizes());
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     const std::string& isa) {
  const bool wide = use_avx512(isa);
  TORCH_CHECK(codes.dim() == 2, "codes must be [N, K/2] uint8, got ", codes.sizes());
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of ", kBlock, ", got ", K);
  check_weight(codes, at::kByte, {N, K / 2}, "codes");
  check_weight(scales, at::kFloat, {N, K / kBlock}, "scales");
  check_weight(mins, at::kFloat, {N, K / kBlock}, "mins");
  const Quantized q = quantize(x, K);
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float *s = scales.data_ptr<float>(), *m = mins.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    if (wide) int4_rows_avx512(c, s, m, q.rows, n0, n1, N, o);
    else int4_rows_avx2(c, s, m, q.rows, n0, n1, N, o);
  });
  return out;
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales, const std::string& isa) {
  const bool wide = use_avx512(isa);
  TORCH_CHECK(weight.dim() == 2, "weight must be [N, K] int8, got ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % kBlock == 0, "the input width must be a multiple of ", kBlock, ", got ", K);
  check_weight(weight, at::kChar, {N, K}, "weight");
  check_weight(scales, at::kFloat, {N}, "scales");
  const Quantized q = quantize(x, K);
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    if (wide) int8_rows_avx512(w, s, q.rows, n0, n1, N, o);
    else int8_rows_avx2(w, s, q.rows, n0, n1, N, o);
  });
  return out;
}

}  // namespace
}  // namespace fasterllm_cpu

TORCH_LIBRARY(fasterllm_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, str isa) -> Tensor",
        &fasterllm_cpu::int4_gemv);
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scales, str isa) -> Tensor", &fasterllm_cpu::int8_gemv);
}
