// fasterllm's CPU matrix-vector products for decode rows: plain C++ over raw pointers, one translation unit per ISA
// (gemv_avx2.cpp, gemv_avx512.cpp), chosen at start-up by the Python side; ops.cpp checks tensors and splits the
// output rows over torch's threads. The torch paths of layers/quantization/int4.py and int8.py are the reference.
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

constexpr int64_t kBlock = 32;      // weights per int4 group, activations per int8 block
constexpr int64_t kLanes = 8;       // int32 lanes of one block's partial sums in the int8 kernels (256 bits)
constexpr int64_t kTileRows = 16;   // output rows of one int4 tile
constexpr int64_t kTileBytes = kTileRows * kBlock / 2;  // one tile's codes of one block

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

// x [rows, width] fp32, or bf16 as its uint16 bits; width a multiple of 32; rows' storage as QuantizedRows says
void quantize_rows(const float* x, int64_t rows, int64_t width, int8_t* codes, float* scales, float* sums,
                   float* errors);
void quantize_rows(const uint16_t* x, int64_t rows, int64_t width, int8_t* codes, float* scales, float* sums,
                   float* errors);

// out[m, n] (out is [M, N] fp32) for the output rows of tiles [t0, t1) (int4) or rows [n0, n1) (int8).
// int4, in tiles of 16 output rows (N padded to a multiple of 16 with zero rows; w = code * scale + minimum):
//   codes [N/16, K/32, 256] bytes: tile t, block b holds 4 chunks of 64 bytes, chunk c's byte 4r + j the codes of
//         row 16t + r at k = 32b + 8c + j (low nibble) and k + 4 (high nibble), j = 0..3
//   scales, minimums [N/16, K/32, 16] fp32: those of rows 16t..16t+15 for block b, in row order
// int8, row-major: weight [N, K] int8 in -127..127, scales [N] fp32, w = weight * scale
void int4_tiles_avx2(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                     int64_t t0, int64_t t1, int64_t N, float* out);
void int4_tiles_avx512(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                       int64_t t0, int64_t t1, int64_t N, float* out);
void int8_rows_avx2(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n0, int64_t n1,
                    int64_t N, float* out);
void int8_rows_avx512(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n0, int64_t n1,
                      int64_t N, float* out);

}  // namespace fasterllm_cpu
