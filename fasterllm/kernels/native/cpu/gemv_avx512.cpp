// The AVX-512 products of gemv.h, integer dot products through VNNI's dpbusd (u8 x s8 quads to int32), each block's
// sums scaled in fp32. int4: one int32 lane per output row of a tile, 4 inputs broadcast to all lanes, so a block's
// scales apply to 16 rows at once and no horizontal sum is needed. int8 (row-major): one 512-bit register per two
// blocks of a row (int32 lanes 0-7 the first block's, 8-15 the second's), an odd last block through masked loads,
// rows in groups of 4 sharing each input load and one horizontal reduction. Needs avx512f/bw/dq/vl and avx512_vnni.
// Helpers live in an anonymous namespace so no inline function built for this ISA is shared with another unit.
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include "gemv.h"

namespace fasterllm_cpu {
namespace {

constexpr int kGroup = 4;  // output rows per pass over an input row

// the first `count` of 16 (or 64) lanes
inline __mmask16 first16(int64_t count) { return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1); }

// R accumulators' lane sums to out[0], out[1], ... (R == 4: one tree of horizontal adds)
template <int R>
inline void store_sums(const __m512* acc, float* out) {
  if constexpr (R == kGroup) {
    __m256 half[kGroup];
    for (int r = 0; r < kGroup; ++r)
      half[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(half[0], half[1]), _mm256_hadd_ps(half[2], half[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
  } else {
    for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
  }
}

// the int32 sums of one tile's 16 rows over block b: 8 dpbusd of 4 codes x 4 inputs each (gemv.h's tile order),
// in 4 chains to hide their latency
inline __m512i int4_tile_block(const uint8_t* tile, const int8_t* q) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i sums[4];
  for (int c = 0; c < 4; c += 2) {
    for (int h = 0; h < 2; ++h) {
      const __m512i packed = _mm512_loadu_si512(tile + 64 * (c + h));
      const __m512i low = _mm512_and_si512(packed, nibble);
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      const int8_t* k = q + 8 * (c + h);
      const __m512i first = _mm512_broadcastd_epi32(_mm_loadu_si32(k));
      const __m512i second = _mm512_broadcastd_epi32(_mm_loadu_si32(k + 4));
      if (c == 0) {
        sums[2 * h] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, first);
        sums[2 * h + 1] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), high, second);
      } else {
        sums[2 * h] = _mm512_dpbusd_epi32(sums[2 * h], low, first);
        sums[2 * h + 1] = _mm512_dpbusd_epi32(sums[2 * h + 1], high, second);
      }
    }
  }
  return _mm512_add_epi32(_mm512_add_epi32(sums[0], sums[1]), _mm512_add_epi32(sums[2], sums[3]));
}

template <int R>
void int8_group(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n, int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t m = 0; m < x.rows; ++m) {
    const int8_t* q = x.codes + m * K;
    const float* lane_scales = x.scales + m * blocks * kLanes;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
      const __mmask64 bytes = b + 1 < blocks ? ~__mmask64(0) : __mmask64(0xFFFFFFFF);
      const __m512i qv = _mm512_maskz_loadu_epi8(bytes, q + kBlock * b);
      const __m512 lanes = _mm512_maskz_loadu_ps(b + 1 < blocks ? __mmask16(0xFFFF) : __mmask16(0xFF),
                                                 lane_scales + kLanes * b);
      for (int r = 0; r < R; ++r) {
        const __m512i w = _mm512_maskz_loadu_epi8(bytes, weight + (n + r) * K + kBlock * b);
        // |w| x (q with w's sign): u8 x s8 products equal to w x q
        const __m512i signed_q = _mm512_mask_sub_epi8(qv, _mm512_movepi8_mask(w), _mm512_setzero_si512(), qv);
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), signed_q);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), lanes, acc[r]);
      }
    }
    float totals[R];
    store_sums<R>(acc, totals);
    for (int r = 0; r < R; ++r) out[m * N + n + r] = scales[n + r] * totals[r];
  }
}

}  // namespace

void int4_tiles_avx512(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                       int64_t t0, int64_t t1, int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = codes + t * blocks * kTileBytes;
    const float* tile_scales = scales + t * blocks * kTileRows;
    const float* tile_mins = mins + t * blocks * kTileRows;
    const int64_t n = t * kTileRows;
    for (int64_t m = 0; m < x.rows; ++m) {
      const int8_t* q = x.codes + m * K;
      const float* block_scales = x.scales + m * blocks * kLanes;
      const float* sums = x.sums + m * blocks;
      const float* errors = x.errors + m * blocks;
      __m512 products = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const __m512i dots = int4_tile_block(tile + b * kTileBytes, q + b * kBlock);
        const __m512 s = _mm512_loadu_ps(tile_scales + b * kTileRows);
        products = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(s, _mm512_set1_ps(block_scales[b * kLanes])),
                                   products);
        // + minimum x the block's input sum + scale x its rounding error (gemv.h)
        offsets = _mm512_fmadd_ps(_mm512_loadu_ps(tile_mins + b * kTileRows), _mm512_set1_ps(sums[b]), offsets);
        offsets = _mm512_fmadd_ps(s, _mm512_set1_ps(errors[b]), offsets);
      }
      _mm512_mask_storeu_ps(out + m * N + n, first16(N - n), _mm512_add_ps(products, offsets));
    }
  }
}

void int8_rows_avx512(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n0, int64_t n1,
                      int64_t N, float* out) {
  int64_t n = n0;
  for (; n + kGroup <= n1; n += kGroup) int8_group<kGroup>(weight, scales, x, n, N, out);
  for (; n < n1; ++n) int8_group<1>(weight, scales, x, n, N, out);
}

}  // namespace fasterllm_cpu
