// The AVX-512 products of gemv.h: 16 output rows (a tile) per 512-bit register, integer dot products through VNNI's
// dpbusd (u8 x s8 quads to int32), each block's sums scaled in fp32. Needs avx512f/bw/dq/vl and avx512_vnni.
// Helpers live in an anonymous namespace so no inline function built for this ISA is shared with another unit.
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "gemv.h"

namespace fasterllm_cpu {
namespace {

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

inline __m512i broadcast4(const int8_t* k) { return _mm512_broadcastd_epi32(_mm_loadu_si32(k)); }

inline void prefetch(const void* from, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(from) + kPrefetchBytes + line, _MM_HINT_T0);
}

// a tile's int32 sums over one block (4 chunks): dpbusd of 4 codes x 4 inputs, in 4 chains to hide their latency
inline __m512i int4_tile_block(const uint8_t* tile, const int8_t* q) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int c = 0; c < 4; ++c) {
    const __m512i packed = _mm512_loadu_si512(tile + 64 * c);
    const __m512i low = _mm512_and_si512(packed, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
    const int chain = 2 * (c % 2);
    sums[chain] = _mm512_dpbusd_epi32(sums[chain], low, broadcast4(q + 8 * c));
    sums[chain + 1] = _mm512_dpbusd_epi32(sums[chain + 1], high, broadcast4(q + 8 * c + 4));
  }
  return _mm512_add_epi32(_mm512_add_epi32(sums[0], sums[1]), _mm512_add_epi32(sums[2], sums[3]));
}

// a tile's int32 sums over one block (8 chunks): |w| x (inputs with w's sign), u8 x s8 products equal to w x input
inline __m512i int8_tile_block(const int8_t* tile, const int8_t* q) {
  __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int c = 0; c < 8; ++c) {
    const __m512i w = _mm512_loadu_si512(tile + 64 * c);
    const __m512i k = broadcast4(q + 4 * c);
    const __m512i signed_k = _mm512_mask_sub_epi8(k, _mm512_movepi8_mask(w), _mm512_setzero_si512(), k);
    sums[c % 4] = _mm512_dpbusd_epi32(sums[c % 4], _mm512_abs_epi8(w), signed_k);
  }
  return _mm512_add_epi32(_mm512_add_epi32(sums[0], sums[1]), _mm512_add_epi32(sums[2], sums[3]));
}

}  // namespace

void int4_tiles_avx512(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                       int64_t t0, int64_t t1, int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = codes + t * blocks * kInt4TileBytes;
    const float* tile_scales = scales + t * blocks * kTileRows;
    const float* tile_mins = mins + t * blocks * kTileRows;
    const int64_t n = t * kTileRows;
    for (int64_t m = 0; m < x.rows; ++m) {
      const int8_t* q = x.codes + m * K;
      const float *block_scales = x.scales + m * blocks, *sums = x.sums + m * blocks, *errors = x.errors + m * blocks;
      __m512 products = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        prefetch(tile + b * kInt4TileBytes, kInt4TileBytes);
        const __m512i dots = int4_tile_block(tile + b * kInt4TileBytes, q + b * kBlock);
        const __m512 s = _mm512_loadu_ps(tile_scales + b * kTileRows);
        products = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(s, _mm512_set1_ps(block_scales[b])),
                                   products);
        // + minimum x the block's input sum + scale x its rounding error (gemv.h)
        offsets = _mm512_fmadd_ps(_mm512_loadu_ps(tile_mins + b * kTileRows), _mm512_set1_ps(sums[b]), offsets);
        offsets = _mm512_fmadd_ps(s, _mm512_set1_ps(errors[b]), offsets);
      }
      _mm512_mask_storeu_ps(out + m * N + n, first_lanes(N - n), _mm512_add_ps(products, offsets));
    }
  }
}

void int8_tiles_avx512(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t t0, int64_t t1,
                       int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* tile = weight + t * blocks * kInt8TileBytes;
    const __m512 row_scales = _mm512_loadu_ps(scales + t * kTileRows);
    const int64_t n = t * kTileRows;
    for (int64_t m = 0; m < x.rows; ++m) {
      const int8_t* q = x.codes + m * K;
      const float* block_scales = x.scales + m * blocks;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        prefetch(tile + b * kInt8TileBytes, kInt8TileBytes);
        const __m512i dots = int8_tile_block(tile + b * kInt8TileBytes, q + b * kBlock);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(block_scales[b]), acc);
      }
      _mm512_mask_storeu_ps(out + m * N + n, first_lanes(N - n), _mm512_mul_ps(acc, row_scales));
    }
  }
}

}  // namespace fasterllm_cpu
