// fasterllm's CPU matrix-vector products for decode rows: plain C++ over raw pointers, one translation unit per ISA
// (gemv_avx2.cpp, gemv_avx512.cpp), chosen at start-up by the Python side; ops.cpp checks tensors and splits the
// output tiles over torch's threads. The torch paths of layers/quantization/int4.py and int8.py are the reference.
//
// Weights are stored in tiles of 16 output rows (N padded with zero rows to a multiple of 16), each tile's bytes in
// the order the kernels read them, so a product streams its weights front to back: one int32 lane per output row,
// 4 inputs broadcast to all lanes, so each block's scales apply to a whole tile at once and no horizontal sum is
// needed. Per tile t and block b of 32 inputs:
//   int4: 4 chunks of 64 bytes; chunk c's byte 4r + j holds the codes (0..15) of row 16t + r at k = 32b + 8c + j
//         (low nibble) and k + 4 (high nibble), j = 0..3; fp32 scales and minimums [N/16, K/32, 16]
//         (w = code * scale + minimum)
//   int8: 8 chunks of 64 bytes; chunk c's byte 4r + j holds the weight (-127..127) of row 16t + r at
//         k = 32b + 4c + j; fp32 scales [N/16, 16] per output row (w = weight * scale)
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

constexpr int64_t kBlock = 32;      // weights per int4 group, inputs per int8 block
constexpr int64_t kTileRows = 16;   // output rows of a tile
constexpr int64_t kInt4TileBytes = kTileRows * kBlock / 2;  // one tile's codes of one block
constexpr int64_t kInt8TileBytes = kTileRows * kBlock;
// bytes requested (prefetch) ahead of those multiplied: a decode step streams every weight from DRAM once, and one
// core's hardware prefetcher alone kept too few lines in flight
constexpr int64_t kPrefetchBytes = 4096;

// M input rows of width K quantized per block of 32 (codes = round(x / scale), |codes| <= 127):
//   codes  [M, K] int8
//   scales [M, K/32] each block's scale
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

// out[m, n] (out is [M, N] fp32) for the output rows of tiles [t0, t1)
void int4_tiles_avx2(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                     int64_t t0, int64_t t1, int64_t N, float* out);
void int4_tiles_avx512(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                       int64_t t0, int64_t t1, int64_t N, float* out);
void int8_tiles_avx2(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t t0, int64_t t1,
                     int64_t N, float* out);
void int8_tiles_avx512(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t t0, int64_t t1,
                       int64_t N, float* out);

}  // namespace fasterllm_cpu
