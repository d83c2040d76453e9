// fasterllm's CPU matrix-vector products for decode rows: plain C++ over raw pointers, one translation unit per ISA
// (gemv_avx2.cpp, gemv_avx512.cpp), chosen at start-up by the Python side; ops.cpp checks tensors and splits the
// output tiles over torch's threads. Exact products of the quantized weights (tests/kernels/test_cpu_gemv.py) are the
// reference.
//
// The inputs are multiplied as they come: widened to fp32 (widen_rows.cpp), never rounded, and every product is an
// fp32 FMA of a weight code (exact in fp32) and an input; each group's (int4, uint8 grouped) or row's (int8) scale
// applies once to the sum. The one exception, opt-in: int4 codes times inputs quantized to int8 per block
// (Int8Rows, int4_tiles_int8_inputs_avx2). A decode product is bound by the weight bytes it reads, so the codes are turned into fp32
// in registers.
//
// Weights are stored in tiles of 16 output rows (N padded with zero rows to a multiple of 16), each tile's bytes in
// the order the kernels read them, so a product streams its weights front to back: one fp32 lane per output row and
// one input broadcast to all lanes, so each group's scales apply to a whole tile at once and no horizontal sum is
// needed. Per tile t and block b of 32 inputs:
//   int4: 4 chunks of 64 bytes; chunk c's 32-bit word r holds 8 codes (0..15) of row 16t + r, nibble p (bits
//         4p..4p+3) the one at k = 32b + 8c + p; scales and minimums [N/16, K/32, 16] (w = code * scale +
//         minimum), in fp16 (their bits, uint16_t) where fp16 holds all of a weight's exactly (GGUF Q4_0 / Q4_1:
//         a sixth fewer bytes to read than with fp32's), else in fp32; turned into fp32 (F16C) where applied
//   int8: 32 groups of 16 bytes; group j's byte r holds the weight (-127..127) of row 16t + r at k = 32b + j; fp32
//         scales [N/16, 16] per output row (w = weight * scale)
//   uint8 grouped: int8's bytes, unsigned codes (0..255); scales and minimums [N/16, K/G, 16] per group of G
//         (16 or 32) inputs (w = code * scale + minimum), in fp16 or fp32 as int4's (fp16: GGUF Q8_0, a tenth fewer
//         bytes)
//   float: fp32 weights as they are, 32 groups of 16 floats (one 64-byte line); group j holds rows 16t..16t+15's
//         weights at k = 32b + j (each tile's [16, K] transposed); an optional fp32 bias [N] added to the sums
#pragma once
#include <cstdint>
#include <type_traits>

namespace fasterllm_cpu {

constexpr int64_t kBlock = 32;      // weights per int4 group
constexpr int64_t kTileRows = 16;   // output rows of a tile
constexpr int64_t kInt4TileBytes = kTileRows * kBlock / 2;  // one tile's codes of one block
constexpr int64_t kInt8TileBytes = kTileRows * kBlock;
constexpr int64_t kFloatTileFloats = kTileRows * kBlock;  // one tile's weights of one block
// bytes requested (prefetch) ahead of those multiplied: a decode step streams every weight from DRAM once, and one
// core's hardware prefetcher alone kept too few lines in flight
constexpr int64_t kPrefetchBytes = 4096;

// M input rows of width K in fp32, with each group of G's sum (for the minimums: sum_k (code * scale + minimum) x_k =
// scale * sum_k code x_k + minimum * sum_k x_k; G = 32 for int4)
struct FloatRows {
  const float* values;  // [M, K]
  const float* sums;    // [M, K/G]
  int64_t rows;
  int64_t width;
};

// M input rows quantized to int8 per block of 32 inputs (as llama.cpp's Q8 inputs), for int4 weights whose
// products then run in integers: values in the kernel's order (per block, per chunk c of 8 inputs: those at k = 8c,
// 8c + 2, 8c + 4, 8c + 6, then 8c + 1, 8c + 3, 8c + 5, 8c + 7, matching the int4 words' low and high nibbles),
// x_k ~= value_k * scale of its block; sums: each block's exact fp32 sum of x (for the minimums)
struct Int8Rows {
  const int8_t* values;  // [M, K]
  const float* scales;   // [M, K/32]
  const float* sums;     // [M, K/32]
  int64_t rows;
  int64_t width;
};

// x [rows, width] fp32 (width a multiple of 32) -> values and scales of Int8Rows: scale = max |x| / 127 over the
// block, value = x * (127 / max |x|) rounded to nearest even (0 for a block of zeros)
void quantize_rows(const float* x, int64_t rows, int64_t width, int8_t* values, float* scales);

// x [rows, width] fp32, or bf16 as its uint16 bits, width a multiple of 32 -> values [rows, width] fp32 and, where
// sums is not null, sums [rows, width / group] (group 16 or 32)
void widen_rows(const float* x, int64_t rows, int64_t width, float* values, float* sums, int64_t group);
void widen_rows(const uint16_t* x, int64_t rows, int64_t width, float* values, float* sums, int64_t group);

// out[m, n] (out is [M, N] fp32) for the output rows of tiles [t0, t1); int4's and uint8 grouped's Scale: float
// (fp32) or uint16_t (fp16 bits), both instantiated
template <typename Scale>
void int4_tiles_avx2(const uint8_t* codes, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t t0,
                     int64_t t1, int64_t N, float* out);
template <typename Scale>
void int4_tiles_avx512(const uint8_t* codes, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t t0,
                       int64_t t1, int64_t N, float* out);
// int4 codes times Int8Rows (AVX2): per block, sum_k code * value in int16 pairs and int32, then
// x scale * input scale + minimum * the block's input sum
template <typename Scale>
void int4_tiles_int8_inputs_avx2(const uint8_t* codes, const Scale* scales, const Scale* mins, const Int8Rows& x,
                                 int64_t t0, int64_t t1, int64_t N, float* out);
void int8_tiles_avx2(const int8_t* weight, const float* scales, const FloatRows& x, int64_t t0, int64_t t1, int64_t N,
                     float* out);
void int8_tiles_avx512(const int8_t* weight, const float* scales, const FloatRows& x, int64_t t0, int64_t t1,
                       int64_t N, float* out);
// bias: null or [N]
void float_tiles_avx2(const float* weight, const float* bias, const FloatRows& x, int64_t t0, int64_t t1, int64_t N,
                      float* out);
void float_tiles_avx512(const float* weight, const float* bias, const FloatRows& x, int64_t t0, int64_t t1, int64_t N,
                        float* out);
// group: 16 or 32 (x's sums are per group)
template <typename Scale>
void uint8_grouped_tiles_avx2(const uint8_t* codes, const Scale* scales, const Scale* mins, int64_t group,
                              const FloatRows& x, int64_t t0, int64_t t1, int64_t N, float* out);
template <typename Scale>
void uint8_grouped_tiles_avx512(const uint8_t* codes, const Scale* scales, const Scale* mins, int64_t group,
                                const FloatRows& x, int64_t t0, int64_t t1, int64_t N, float* out);

// rows(std::integral_constant<int, R>(), m) for input rows m..m+R-1, over all M rows in groups of at most kMaxRows
// (a group's weights are turned into floats once; its FMAs run in R independent chains). In an anonymous namespace:
// each kernel unit instantiates its own, built for its own ISA.
namespace {
template <int kMaxRows, typename Rows>
inline void in_row_groups(int64_t M, Rows&& rows) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) rows(std::integral_constant<int, kMaxRows>(), m);
  if constexpr (kMaxRows > 4) {
    if (m + 4 <= M) rows(std::integral_constant<int, 4>(), m), m += 4;
  }
  if (m + 2 <= M) rows(std::integral_constant<int, 2>(), m), m += 2;
  if (m < M) rows(std::integral_constant<int, 1>(), m);
}

// independent sums per input row: an FMA's result is ready 4 cycles later and two start per cycle, so one row needs
// several chains to keep them busy, four rows one each
template <int R>
constexpr int kChains = R >= 4 ? 1 : 4 / R;
}  // namespace

}  // namespace fasterllm_cpu
