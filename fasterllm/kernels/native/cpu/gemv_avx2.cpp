// The AVX2 (+FMA) products of gemv.h: 8 output rows (half a tile) per 256-bit register, integer dot products through
// maddubs (u8 x s8 pairs to int16) and madd (pairs to int32), each block's sums scaled in fp32.
// Helpers live in an anonymous namespace so no inline function built for this ISA is shared with another unit.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "gemv.h"

namespace fasterllm_cpu {
namespace {

inline __m256i broadcast4(const int8_t* k) { return _mm256_broadcastd_epi32(_mm_loadu_si32(k)); }

inline void prefetch(const void* from, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(from) + kPrefetchBytes + line, _MM_HINT_T0);
}

// rows n.. of out's row m from 8 lanes, the last half tile cut at N
inline void store_rows(float* out, __m256 result, int64_t count) {
  if (count >= 8) {
    _mm256_storeu_ps(out, result);
    return;
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, result);
  for (int64_t r = 0; r < count; ++r) out[r] = lanes[r];
}

// the int32 sums of half a tile (half 0: rows 0-7, half 1: rows 8-15) over one block (4 chunks): maddubs of 4
// codes x 4 inputs, added in int16 (8 of them stay below 8 x 2 x 15 x 127 = 30480 < 32768) in two chains, then to
// int32 once
inline __m256i int4_tile_block(const uint8_t* tile, int half, const int8_t* q) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int c = 0; c < 4; ++c) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * c + 32 * half));
    const __m256i low = _mm256_and_si256(packed, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    sums[0] = _mm256_add_epi16(sums[0], _mm256_maddubs_epi16(low, broadcast4(q + 8 * c)));
    sums[1] = _mm256_add_epi16(sums[1], _mm256_maddubs_epi16(high, broadcast4(q + 8 * c + 4)));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(sums[0], sums[1]), _mm256_set1_epi16(1));
}

// the int32 sums of half a tile over one block (8 chunks): |w| x (inputs with w's sign), u8 x s8 products equal to
// w x input (a pair of them reaches 2 x 127 x 127, so each goes to int32 at once)
inline __m256i int8_tile_block(const int8_t* tile, int half, const int8_t* q) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int c = 0; c < 8; ++c) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * c + 32 * half));
    const __m256i products = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(broadcast4(q + 4 * c), w));
    sums[c % 2] = _mm256_add_epi32(sums[c % 2], _mm256_madd_epi16(products, ones));
  }
  return _mm256_add_epi32(sums[0], sums[1]);
}

}  // namespace

void int4_tiles_avx2(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                     int64_t t0, int64_t t1, int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = codes + t * blocks * kInt4TileBytes;
    for (int half = 0; half < 2 && t * kTileRows + 8 * half < N; ++half) {
      const float* tile_scales = scales + t * blocks * kTileRows + 8 * half;
      const float* tile_mins = mins + t * blocks * kTileRows + 8 * half;
      const int64_t n = t * kTileRows + 8 * half;
      for (int64_t m = 0; m < x.rows; ++m) {
        const int8_t* q = x.codes + m * K;
        const float *block_scales = x.scales + m * blocks, *sums = x.sums + m * blocks;
        const float* errors = x.errors + m * blocks;
        __m256 products = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          if (half == 0) prefetch(tile + b * kInt4TileBytes, kInt4TileBytes);
          const __m256i dots = int4_tile_block(tile + b * kInt4TileBytes, half, q + b * kBlock);
          const __m256 s = _mm256_loadu_ps(tile_scales + b * kTileRows);
          products = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(s, _mm256_set1_ps(block_scales[b])),
                                     products);
          // + minimum x the block's input sum + scale x its rounding error (gemv.h)
          offsets = _mm256_fmadd_ps(_mm256_loadu_ps(tile_mins + b * kTileRows), _mm256_set1_ps(sums[b]), offsets);
          offsets = _mm256_fmadd_ps(s, _mm256_set1_ps(errors[b]), offsets);
        }
        store_rows(out + m * N + n, _mm256_add_ps(products, offsets), N - n);
      }
    }
  }
}

void int8_tiles_avx2(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t t0, int64_t t1,
                     int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* tile = weight + t * blocks * kInt8TileBytes;
    for (int half = 0; half < 2 && t * kTileRows + 8 * half < N; ++half) {
      const __m256 row_scales = _mm256_loadu_ps(scales + t * kTileRows + 8 * half);
      const int64_t n = t * kTileRows + 8 * half;
      for (int64_t m = 0; m < x.rows; ++m) {
        const int8_t* q = x.codes + m * K;
        const float* block_scales = x.scales + m * blocks;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          if (half == 0) prefetch(tile + b * kInt8TileBytes, kInt8TileBytes);
          const __m256i dots = int8_tile_block(tile + b * kInt8TileBytes, half, q + b * kBlock);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(block_scales[b]), acc);
        }
        store_rows(out + m * N + n, _mm256_mul_ps(acc, row_scales), N - n);
      }
    }
  }
}

}  // namespace fasterllm_cpu
