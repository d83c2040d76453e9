// fasterllm's CPU matrix-vector products for decode rows: plain C++ over raw pointers, one translation unit per ISA
// (gemv_avx2.cpp, gemv_avx512.cpp), chosen at start-up by the Python side; ops.cpp checks tensors and splits the
// output rows over torch's threads. The torch paths of layers/quantization/int4.py and int8.py are the reference.
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

constexpr int64_t kBlock = 32;  // weights per int4 group, activations per int8 block
constexpr int64_t kLanes = 8;   // int32 lanes of one block's partial sums (a 256-bit register)

// M input rows of width K quantized per block of 32 (codes = round(x / scale), |codes| <= 127):
//   codes  [M, K] int8
//   scales [M, K/32 * 8] each block's scale repeated 8 times, as the lanes of its partial sums read it
//   sums   [M, K/32] each block's sum of the unquantized inputs (for the int4 minimums)
//   errors [M, K/32] 8 x (sum - scale x sum of codes) per block: the int4 kernels multiply codes 0..15, which count
//          a block's rounding error 8 times more than codes centred at 8 would; scale x errors takes it back out
struct QuantizedRows {
  const int8_t* codes;
  const float* scales;
  const float* sums;
  const float* errors;
  int64_t rows;
  int64_t width;
};

void quantize_rows(const float* x, int64_t rows, int64_t width, int8_t* codes, float* scales, float* sums,
                   float* errors);

// out[m, n] for n in [n0, n1) (out is [M, N] fp32), weights of output row n:
// int4: codes [N, K/2] (block b of row n: 16 bytes, code j in the low nibble of byte j and code j+16 in the high
//       one), scales and minimums [N, K/32] fp32, w = code * scale + minimum
// int8: weight [N, K] int8 in -127..127, scales [N] fp32, w = weight * scale
void int4_rows_avx2(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                    int64_t n0, int64_t n1, int64_t N, float* out);
void int4_rows_avx512(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                      int64_t n0, int64_t n1, int64_t N, float* out);
void int8_rows_avx2(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n0, int64_t n1,
                    int64_t N, float* out);
void int8_rows_avx512(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n0, int64_t n1,
                      int64_t N, float* out);

}  // namespace fasterllm_cpu
