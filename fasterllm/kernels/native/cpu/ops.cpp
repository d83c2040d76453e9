// torch operators over gemv.h's and rms_norm.h's kernels: torch.ops.fasterllm_cpu.int4_gemv / int8_gemv /
// uint8_grouped_gemv / add_rms_norm. They check their tensors and split the work over torch's intra-op threads
// (at::parallel_for): the products widen the input rows to fp32 once and split the output tiles, and return the
// input's dtype.
// The ISA ("avx2" or "avx512") is the caller's choice (kernels/native/cpu_gemv.py picks it at start-up); a choice
// this CPU cannot run is refused here rather than left to crash on an illegal instruction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>

#include "gemv.h"
#include "rms_norm.h"

namespace fasterllm_cpu {
namespace {

constexpr int64_t kGrainTiles = 4;  // tiles (of 16 output rows) per thread at least: fewer are not worth a thread
constexpr int64_t kGrainNormRows = 64;  // rows per thread of the RMSNorm

bool runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool runs_avx512() { return runs_avx2() && __builtin_cpu_supports("avx512f"); }

bool use_avx512(const std::string& isa) {
  TORCH_CHECK(isa == "avx2" || isa == "avx512", "isa must be 'avx2' or 'avx512', got '", isa, "'");
  TORCH_CHECK(isa == "avx2" ? runs_avx2() : runs_avx512(), "this CPU cannot run the '", isa,
              "' kernels (avx2 needs avx2/fma/f16c; avx512 needs those and avx512f); pass the ISA that "
              "fasterllm.kernels.native.cpu_gemv.kernel_isa() names");
  return isa == "avx512";
}

// the input rows in fp32, with their groups' sums where asked (sum_group > 0: gemv.h's FloatRows), in one scratch
// tensor
struct Widened {
  at::Tensor storage;
  FloatRows rows;
};

Widened widen(const at::Tensor& x, int64_t K, int64_t sum_group) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "input must be [rows, ", K, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "input must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), "input must be on the CPU, got ", x.device());
  const at::Tensor values = x.contiguous();
  const int64_t M = x.size(0);
  Widened w;
  w.storage = at::empty({M * K + (sum_group ? M * K / sum_group : 0)}, values.options().dtype(at::kFloat));
  float* floats = w.storage.data_ptr<float>();
  float* sums = sum_group ? floats + M * K : nullptr;
  if (values.scalar_type() == at::kFloat)
    widen_rows(values.data_ptr<float>(), M, K, floats, sums, sum_group);
  else
    widen_rows(reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>()), M, K, floats, sums, sum_group);
  w.rows = FloatRows{floats, sums, M, K};
  return w;
}

void check_weight(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous() && t.device().is_cpu(), name,
              " must be a contiguous CPU ", dtype, " tensor of shape ", shape, ", got ", t.scalar_type(), " ",
              t.sizes());
}

// the tiles' dimensions (gemv.h) checked against N: [N/16 rounded up, K/32, tile_bytes]
int64_t tiles_of(const at::Tensor& codes, int64_t N, int64_t tile_bytes, const char* packer) {
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == tile_bytes, "codes must be [N/16, K/32, ", tile_bytes, "] (",
              packer, "), got ", codes.sizes());
  const int64_t tiles = codes.size(0);
  TORCH_CHECK(N > (tiles - 1) * kTileRows && N <= tiles * kTileRows, "N = ", N, " does not fit ", tiles,
              " tiles of ", kTileRows, " rows");
  return tiles;
}

// out [rows of x, N] in fp32, its tiles split over the threads (run(t0, t1, out) fills tiles t0..t1-1), in x's dtype
template <typename Run>
at::Tensor over_tiles(const at::Tensor& x, int64_t N, int64_t tiles, Run&& run) {
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles, kGrainTiles, [&](int64_t t0, int64_t t1) { run(t0, t1, o); });
  return out.to(x.scalar_type());
}

// run(s, m) over a grouped layer's scales and minimums of this shape, both fp32 (const float*) or both fp16 (their
// bits, const uint16_t*: gemv.h), after checking them
template <typename Run>
at::Tensor with_scales(const at::Tensor& scales, const at::Tensor& mins, at::IntArrayRef shape, Run&& run) {
  const at::ScalarType dtype = scales.scalar_type() == at::kHalf ? at::kHalf : at::kFloat;
  check_weight(scales, dtype, shape, "scales");
  check_weight(mins, dtype, shape, "mins");
  if (dtype == at::kFloat) return run(scales.data_ptr<float>(), mins.data_ptr<float>());
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>()); };
  return run(bits(scales), bits(mins));
}

// int8_inputs: the input rows quantized to int8 per block first (gemv.h's Int8Rows), the products in integers, by
// the AVX2 kernel whatever the isa (every CPU with AVX-512 here has AVX2). Scale: float, or uint16_t for fp16 scales
// and minimums (gemv.h)
template <typename Scale>
at::Tensor int4_gemv_of(const at::Tensor& x, const at::Tensor& codes, const Scale* s, const Scale* m, int64_t N,
                        bool wide, bool int8_inputs) {
  const int64_t tiles = codes.size(0), blocks = codes.size(1);
  const Widened in = widen(x, blocks * kBlock, kBlock);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  if (int8_inputs) {
    const int64_t M = in.rows.rows, K = in.rows.width;
    const at::Tensor values = at::empty({M * K}, x.options().dtype(at::kChar));
    const at::Tensor input_scales = at::empty({M * K / kBlock}, x.options().dtype(at::kFloat));
    quantize_rows(in.rows.values, M, K, values.data_ptr<int8_t>(), input_scales.data_ptr<float>());
    const Int8Rows quantized{values.data_ptr<int8_t>(), input_scales.data_ptr<float>(), in.rows.sums, M, K};
    return over_tiles(x, N, tiles, [&](int64_t t0, int64_t t1, float* o) {
      int4_tiles_int8_inputs_avx2(c, s, m, quantized, t0, t1, N, o);
    });
  }
  return over_tiles(x, N, tiles, [&](int64_t t0, int64_t t1, float* o) {
    if (wide) int4_tiles_avx512(c, s, m, in.rows, t0, t1, N, o);
    else int4_tiles_avx2(c, s, m, in.rows, t0, t1, N, o);
  });
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t N, const std::string& isa, bool int8_inputs) {
  const bool wide = use_avx512(isa);
  const int64_t tiles = tiles_of(codes, N, kInt4TileBytes, "cpu_gemv.pack_int4"), blocks = codes.size(1);
  check_weight(codes, at::kByte, {tiles, blocks, kInt4TileBytes}, "codes");
  return with_scales(scales, mins, {tiles, blocks, kTileRows},
                     [&](auto s, auto m) { return int4_gemv_of(x, codes, s, m, N, wide, int8_inputs); });
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t N,
                     const std::string& isa) {
  const bool wide = use_avx512(isa);
  const int64_t tiles = tiles_of(codes, N, kInt8TileBytes, "cpu_gemv.pack_int8"), blocks = codes.size(1);
  check_weight(codes, at::kChar, {tiles, blocks, kInt8TileBytes}, "codes");
  check_weight(scales, at::kFloat, {tiles, kTileRows}, "scales");
  const Widened in = widen(x, blocks * kBlock, 0);
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  return over_tiles(x, N, tiles, [&](int64_t t0, int64_t t1, float* o) {
    if (wide) int8_tiles_avx512(w, s, in.rows, t0, t1, N, o);
    else int8_tiles_avx2(w, s, in.rows, t0, t1, N, o);
  });
}

at::Tensor uint8_grouped_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, int64_t N, const std::string& isa) {
  const bool wide = use_avx512(isa);
  const int64_t tiles = tiles_of(codes, N, kInt8TileBytes, "cpu_gemv.pack_uint8_grouped"), blocks = codes.size(1);
  check_weight(codes, at::kByte, {tiles, blocks, kInt8TileBytes}, "codes");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles && scales.size(2) == kTileRows &&
                  (scales.size(1) == blocks || scales.size(1) == 2 * blocks),
              "scales must be [N/16, K/16 or K/32, 16] (cpu_gemv.pack_uint8_grouped), got ", scales.sizes());
  const int64_t group = blocks * kBlock / scales.size(1);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  return with_scales(scales, mins, scales.sizes(), [&](auto s, auto m) {
    const Widened in = widen(x, blocks * kBlock, group);
    return over_tiles(x, N, tiles, [&](int64_t t0, int64_t t1, float* o) {
      if (wide) uint8_grouped_tiles_avx512(c, s, m, group, in.rows, t0, t1, N, o);
      else uint8_grouped_tiles_avx2(c, s, m, group, in.rows, t0, t1, N, o);
    });
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                    const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous [rows, width] CPU float32 or bfloat16 tensor, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t rows = x.size(0), width = x.size(1);
  check_weight(weight, x.scalar_type(), {width}, "weight");
  if (residual.has_value()) check_weight(*residual, x.scalar_type(), x.sizes(), "residual");
  at::Tensor out = at::empty_like(x), sum = residual.has_value() ? at::empty_like(x) : x;
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrainNormRows, [&](int64_t r0, int64_t r1) {
    const int64_t at = r0 * width, count = r1 - r0;
    if (x.scalar_type() == at::kFloat) {
      add_rms_norm(x.data_ptr<float>() + at, residual.has_value() ? residual->data_ptr<float>() + at : nullptr,
                   weight.data_ptr<float>(), epsilon, count, width, out.data_ptr<float>() + at,
                   sum.data_ptr<float>() + at);
    } else {
      auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
      add_rms_norm(bits(x) + at, residual.has_value() ? bits(*residual) + at : nullptr, bits(weight), epsilon, count,
                   width, bits(out) + at, bits(sum) + at);
    }
  });
  return {out, sum};
}

}  // namespace
}  // namespace fasterllm_cpu

TORCH_LIBRARY(fasterllm_cpu, m) {
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, int N, str isa, bool int8_inputs=False) -> "
        "Tensor",
        &fasterllm_cpu::int4_gemv);
  m.def("int8_gemv(Tensor x, Tensor codes, Tensor scales, int N, str isa) -> Tensor", &fasterllm_cpu::int8_gemv);
  m.def("uint8_grouped_gemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, int N, str isa) -> Tensor",
        &fasterllm_cpu::uint8_grouped_gemv);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &fasterllm_cpu::add_rms_norm_op);
}
