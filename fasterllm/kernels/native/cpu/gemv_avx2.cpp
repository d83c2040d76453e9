// The AVX2 (+FMA) products of gemv.h: integer dot products through maddubs (u8 x s8 pairs to int16) and madd (pairs
// to int32), each block's sums scaled in fp32. int4: one int32 lane per output row (8 rows of a tile at a time), 4
// inputs broadcast to all lanes, so a block's scales apply to 8 rows at once and no horizontal sum is needed.
// int8 (row-major): one 256-bit register per block of a row.
// Helpers live in an anonymous namespace so no inline function built for this ISA is shared with another unit.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "gemv.h"

namespace fasterllm_cpu {
namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// int32 sums of 4 adjacent u8 x s8 products: no int16 saturation while |u * s| * 2 < 32768
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// the int32 sums of 8 rows of a tile (half 0: rows 0-7, half 1: rows 8-15) over block b, gemv.h's tile order:
// maddubs of 4 codes x 4 inputs broadcast to all lanes, added in int16 (8 of them stay below 8 x 2 x 15 x 127 =
// 30480 < 32768) in two chains, then to int32 once per block
inline __m256i int4_tile_block(const uint8_t* tile, int half, const int8_t* q) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int c = 0; c < 4; ++c) {
    const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * c + 32 * half));
    const __m256i low = _mm256_and_si256(packed, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    const __m256i first = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 8 * c));
    const __m256i second = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 8 * c + 4));
    sums[0] = _mm256_add_epi16(sums[0], _mm256_maddubs_epi16(low, first));
    sums[1] = _mm256_add_epi16(sums[1], _mm256_maddubs_epi16(high, second));
  }
  return _mm256_madd_epi16(_mm256_add_epi16(sums[0], sums[1]), _mm256_set1_epi16(1));
}

inline __m256 int8_block(const int8_t* w, const int8_t* q, const float* lane_scales, __m256 acc) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  // |w| x (q with w's sign): u8 x s8 products equal to w x q
  const __m256i sums = dot_u8_s8(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(lane_scales), acc);
}

}  // namespace

void int4_tiles_avx2(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                     int64_t t0, int64_t t1, int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = codes + t * blocks * kTileBytes;
    for (int half = 0; half < 2; ++half) {
      const float* tile_scales = scales + t * blocks * kTileRows + 8 * half;
      const float* tile_mins = mins + t * blocks * kTileRows + 8 * half;
      const int64_t n = t * kTileRows + 8 * half;
      if (n >= N) break;
      for (int64_t m = 0; m < x.rows; ++m) {
        const int8_t* q = x.codes + m * K;
        const float* block_scales = x.scales + m * blocks * kLanes;
        const float* sums = x.sums + m * blocks;
        const float* errors = x.errors + m * blocks;
        __m256 products = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          const __m256i dots = int4_tile_block(tile + b * kTileBytes, half, q + b * kBlock);
          const __m256 s = _mm256_loadu_ps(tile_scales + b * kTileRows);
          products = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots),
                                     _mm256_mul_ps(s, _mm256_set1_ps(block_scales[b * kLanes])), products);
          // + minimum x the block's input sum + scale x its rounding error (gemv.h)
          offsets = _mm256_fmadd_ps(_mm256_loadu_ps(tile_mins + b * kTileRows), _mm256_set1_ps(sums[b]), offsets);
          offsets = _mm256_fmadd_ps(s, _mm256_set1_ps(errors[b]), offsets);
        }
        const __m256 result = _mm256_add_ps(products, offsets);
        if (n + 8 <= N) {
          _mm256_storeu_ps(out + m * N + n, result);
        } else {
          float lanes[8];
          _mm256_storeu_ps(lanes, result);
          for (int64_t r = 0; r < N - n; ++r) out[m * N + n + r] = lanes[r];
        }
      }
    }
  }
}

void int8_rows_avx2(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n0, int64_t n1,
                    int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* row = weight + n * K;
    for (int64_t m = 0; m < x.rows; ++m) {
      const int8_t* q = x.codes + m * K;
      const float* lane_scales = x.scales + m * blocks * kLanes;
      __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 2 <= blocks; b += 2) {
        even = int8_block(row + kBlock * b, q + kBlock * b, lane_scales + kLanes * b, even);
        odd = int8_block(row + kBlock * (b + 1), q + kBlock * (b + 1), lane_scales + kLanes * (b + 1), odd);
      }
      if (b < blocks) even = int8_block(row + kBlock * b, q + kBlock * b, lane_scales + kLanes * b, even);
      out[m * N + n] = scales[n] * horizontal_sum(_mm256_add_ps(even, odd));
    }
  }
}

}  // namespace fasterllm_cpu
