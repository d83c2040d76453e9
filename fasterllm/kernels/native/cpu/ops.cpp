// torch operators over gemv.h's, rms_norm.h's and argmax_rows.h's kernels: torch.ops.fasterllm_cpu.int4_gemv /
// int8_gemv / uint8_grouped_gemv / float_gemv / add_rms_norm / argmax_rows. They check their tensors and split the
// work over torch's intra-op threads (at::parallel_for): the products widen the input rows to fp32 once (fp32 weights
// take fp32 rows as they are) and split the output tiles, and return the input's dtype.
// The ISA ("avx2" or "avx512") is the caller's choice (kernels/native/cpu_gemv.py picks it at start-up); a choice
// this CPU cannot run is refused here rather than left to crash on an illegal instruction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "argmax_rows.h"
#include "decode_attention.h"
#include "gemv.h"
#include "ops.h"
#include "rms_norm.h"
#include "rotary_store.h"

namespace fasterllm_cpu {
namespace {

constexpr int64_t kGrainTiles = 4;  // tiles (of 16 output rows) per thread at least: fewer are not worth a thread
constexpr int64_t kGrainNormRows = 64;  // rows per thread of the RMSNorm
constexpr int64_t kThreadedAttentionPairs = 4096;  // (query head, key) pairs of a decode attention worth threads
constexpr int64_t kGrainArgmaxRows = 4;  // logits rows per thread of the argmax at least

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

}  // namespace

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

at::Tensor float_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t N,
                      const std::string& isa) {
  const bool wide = use_avx512(isa);
  TORCH_CHECK(weight.dim() == 3 && weight.size(2) == kFloatTileFloats,
              "weight must be [N/16, K/32, ", kFloatTileFloats, "] (cpu_gemv.pack_float), got ", weight.sizes());
  const int64_t tiles = weight.size(0), K = weight.size(1) * kBlock;
  TORCH_CHECK(N > (tiles - 1) * kTileRows && N <= tiles * kTileRows, "N = ", N, " does not fit ", tiles,
              " tiles of ", kTileRows, " rows");
  check_weight(weight, at::kFloat, weight.sizes(), "weight");
  if (bias.has_value()) check_weight(*bias, at::kFloat, {N}, "bias");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "input must be a float32 CPU tensor [rows, ", K, "], got ", x.scalar_type(), " ", x.sizes(), " on ",
              x.device());
  const at::Tensor values = x.contiguous();
  const FloatRows rows{values.data_ptr<float>(), nullptr, x.size(0), K};
  const float* w = weight.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  return over_tiles(x, N, tiles, [&](int64_t t0, int64_t t1, float* o) {
    if (wide) float_tiles_avx512(w, b, rows, t0, t1, N, o);
    else float_tiles_avx2(w, b, rows, t0, t1, N, o);
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

// a decode batch's attention (decode_attention.h), each row over its own keys: query [B, Hq, D] (each row's heads
// contiguous, rows at any stride), kv_cache [2, num_blocks, block_size, Hkv, D] of query's dtype (bf16 or fp32),
// block_table [B, W] int64 (row b's blocks, padded), key_ranges [B, 2] int64 (row b's keys key_start..key_end - 1);
// the (row, KV head) pairs split over the threads where the work is worth a thread's start (about 4 us here): below
// about 4,096 (query head, key) pairs one thread does them all. A row's result does not depend on the others.
at::Tensor decode_attention_op(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                    const at::Tensor& key_ranges, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.device().is_cpu() && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2) &&
                  (query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kFloat),
              "query must be a CPU bfloat16 or float32 [B, Hq, D] tensor with each row's heads contiguous, got ",
              query.scalar_type(), " ", query.sizes(), " strides ", query.strides());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == query.scalar_type() &&
                  kv_cache.is_contiguous() && kv_cache.size(4) == query.size(2),
              "kv_cache must be a contiguous [2, num_blocks, block_size, Hkv, D=", query.size(2), "] CPU ",
              query.scalar_type(), " tensor, got ", kv_cache.scalar_type(), " ", kv_cache.sizes());
  const int64_t rows = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(decode_attention_supports(head_dim), "head_dim ", head_dim, " is not one decode_attention runs");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads (", num_heads, ") must be a multiple of the KV heads (",
              num_kv_heads, ")");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 && block_table.size(0) == rows &&
                  block_table.is_contiguous(),
              "block_table must be a contiguous int64 [B=", rows, ", W] tensor, got ", block_table.scalar_type(), " ",
              block_table.sizes());
  TORCH_CHECK(key_ranges.scalar_type() == at::kLong && key_ranges.sizes() == at::IntArrayRef({rows, 2}) &&
                  key_ranges.is_contiguous(),
              "key_ranges must be a contiguous int64 [B=", rows, ", 2] tensor, got ", key_ranges.scalar_type(), " ",
              key_ranges.sizes());
  const int64_t width = block_table.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* ranges = key_ranges.data_ptr<int64_t>();
  int64_t most_keys = 1, pairs = 0;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t start = ranges[2 * b], end = ranges[2 * b + 1];
    TORCH_CHECK(0 <= start && start < end && end <= width * block_size, "row ", b, "'s keys ", start, "..", end,
                " must be a nonempty range within its ", width, " blocks of ", block_size);
    for (int64_t i = 0; i < (end + block_size - 1) / block_size; ++i)
      TORCH_CHECK(0 <= table[b * width + i] && table[b * width + i] < num_blocks, "row ", b, "'s block id ",
                  table[b * width + i], " is outside the cache's ", num_blocks);
    most_keys = std::max(most_keys, end - start);
    pairs += num_heads * (end - start);
  }
  const int64_t group = num_heads / num_kv_heads;
  const int64_t per_row = num_kv_heads * decode_attention_scratch(group, head_dim, most_keys);
  at::Tensor out = at::empty({rows, num_heads, head_dim}, query.options());
  at::Tensor scratch = at::empty({rows * per_row}, query.options().dtype(at::kFloat));
  float* work = scratch.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t grain = pairs < kThreadedAttentionPairs ? rows * num_kv_heads : 1;
  auto run = [&](auto* q, auto* o) {
    const auto* k = reinterpret_cast<decltype(q)>(kv_cache.data_ptr());
    at::parallel_for(0, rows * num_kv_heads, grain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / num_kv_heads, h = i % num_kv_heads;
        const PagedKeys keys{table + b * width, block_size, num_kv_heads, head_dim, ranges[2 * b], ranges[2 * b + 1]};
        decode_attention(q + b * query.stride(0), k, k + kv_cache.numel() / 2, keys, group, s, h, h + 1,
                         work + b * per_row, o + b * num_heads * head_dim);
      }
    });
  };
  if (query.scalar_type() == at::kFloat) {
    run(query.data_ptr<float>(), out.data_ptr<float>());
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    run(bits(query), bits(out));
  }
  return out;
}

// rotary_store.h's fused RoPE and K/V store: qkv [T, Hq + 2 Hkv, D] (each token's row contiguous), cos / sin rows
// [T, 1, D] (strided views of the rotary table's gathered rows), kv_cache [2, num_blocks, block_size, Hkv, D],
// slot_mapping [n <= T] int64; all of one dtype, bf16 or fp32
void rotary_store_op(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.device().is_cpu() && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2) &&
                  (qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kFloat),
              "qkv must be a CPU bfloat16 or float32 [T, heads, D] tensor with contiguous rows, got ",
              qkv.scalar_type(), " ", qkv.sizes(), " strides ", qkv.strides());
  const int64_t tokens = qkv.size(0), dim = qkv.size(2), kv_heads = (qkv.size(1) - num_heads) / 2;
  TORCH_CHECK(kv_heads > 0 && num_heads + 2 * kv_heads == qkv.size(1) && dim % 2 == 0 && dim <= 512,
              "qkv's ", qkv.size(1), " heads of ", dim, " are not ", num_heads, " query heads and two equal sets of KV "
              "heads of an even dim up to 512");
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == qkv.scalar_type() && table->numel() == tokens * dim &&
                    table->stride(-1) == 1 && table->stride(0) == cos.stride(0),
                "cos and sin must be [T, 1, D] rows of qkv's dtype with one row stride, got ", table->scalar_type(),
                " ", table->sizes(), " strides ", table->strides());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.scalar_type() == qkv.scalar_type() &&
                  kv_cache.is_contiguous() && kv_cache.size(3) == kv_heads && kv_cache.size(4) == dim,
              "kv_cache must be a contiguous [2, num_blocks, block_size, Hkv=", kv_heads, ", D=", dim, "] tensor of "
              "qkv's dtype, got ", kv_cache.scalar_type(), " ", kv_cache.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() <= tokens,
              "slot_mapping must be a contiguous int64 tensor of at most ", tokens, " slots, got ",
              slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  const int64_t slots_in_cache = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < slot_mapping.numel(); ++i)
    TORCH_CHECK(0 <= slots[i] && slots[i] < slots_in_cache, "slot ", slots[i], " is outside the cache's ",
                slots_in_cache);
  const RotaryStoreShape shape{tokens, num_heads, kv_heads, dim, qkv.stride(0), cos.stride(0), slot_mapping.numel()};
  if (qkv.scalar_type() == at::kFloat) {
    float* cache = kv_cache.data_ptr<float>();
    rotary_store(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), cache,
                 cache + kv_cache.numel() / 2, slots, shape);
    return;
  }
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  uint16_t* cache = bits(kv_cache);
  rotary_store(bits(qkv), bits(cos), bits(sin), cache, cache + kv_cache.numel() / 2, slots, shape);
}

// x [rows, width] fp32 -> each row's argmax [rows] int64, as torch.argmax(x, dim=-1)
at::Tensor argmax_rows_op(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "argmax_rows takes fp32 rows [rows, width > 0] on the CPU, got ", x.scalar_type(), " ", x.sizes(), " on ",
              x.device());
  TORCH_CHECK(runs_avx2(), "argmax_rows needs AVX2 and FMA, which this CPU lacks; use torch.argmax");
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* values = rows.data_ptr<float>();
  int64_t* indices = out.data_ptr<int64_t>();
  const int64_t width = x.size(1);
  at::parallel_for(0, x.size(0), kGrainArgmaxRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) indices[r] = argmax_row(values + r * width, width);
  });
  return out;
}

}  // namespace fasterllm_cpu

TORCH_LIBRARY(fasterllm_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &fasterllm_cpu::argmax_rows_op);
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, int N, str isa, bool int8_inputs=False) -> "
        "Tensor",
        &fasterllm_cpu::int4_gemv);
  m.def("int8_gemv(Tensor x, Tensor codes, Tensor scales, int N, str isa) -> Tensor", &fasterllm_cpu::int8_gemv);
  m.def("float_gemv(Tensor x, Tensor weight, Tensor? bias, int N, str isa) -> Tensor", &fasterllm_cpu::float_gemv);
  m.def("uint8_grouped_gemv(Tensor x, Tensor codes, Tensor scales, Tensor mins, int N, str isa) -> Tensor",
        &fasterllm_cpu::uint8_grouped_gemv);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &fasterllm_cpu::add_rms_norm_op);
  m.def("decode_attention(Tensor query, Tensor kv_cache, Tensor block_table, Tensor key_ranges, float scale) -> "
        "Tensor",
        &fasterllm_cpu::decode_attention_op);
  m.def("rotary_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, Tensor slot_mapping, "
        "int num_heads) -> ()",
        &fasterllm_cpu::rotary_store_op);
}
