// The AVX-512 products of gemv.h: 16 output rows (a tile) per 512-bit register, the codes turned into fp32 in
// registers (int4: a permute of a 16-entry table by each lane's nibble; int8: a sign extension and a conversion;
// uint8: a zero extension and a conversion) and multiplied with fp32 FMAs by the inputs as they come. Needs avx512f
// only.
// Helpers live in an anonymous namespace so no inline function built for this ISA is shared with another unit.
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>

#include "gemv.h"

namespace fasterllm_cpu {
namespace {

constexpr int kMaxRows = 8;  // input rows per pass over a tile: 8 x 3 accumulators fit AVX-512's 32 registers

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

inline void prefetch(const void* from, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(from) + kPrefetchBytes + line, _MM_HINT_T0);
}

// the sum of one row's accumulator chains
template <int C>
inline __m512 chain_sum(const __m512 (&chains)[C]) {
  __m512 sum = chains[0];
  for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, chains[i]);
  return sum;
}

// 16 scales or minimums in fp32: fp32 ones as they are, fp16 ones (their bits) converted
inline __m512 load16(const float* from) { return _mm512_loadu_ps(from); }
inline __m512 load16(const uint16_t* from) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
}

// one group of a grouped tile done: products[r] += scale x (row r's sum of codes x inputs) + minimum x row r's input
// sum over the group (input_sums[r * stride])
template <int R, int C, typename Scale>
inline void add_group(__m512 (&products)[R], const __m512 (&sums)[R][C], const Scale* scales, const Scale* mins,
                      const float* input_sums, int64_t stride) {
  const __m512 s = load16(scales), minimum = load16(mins);
  for (int r = 0; r < R; ++r) {
    products[r] = _mm512_fmadd_ps(chain_sum(sums[r]), s, products[r]);
    products[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(input_sums[r * stride]), products[r]);
  }
}

// out rows m..m+R-1 of one tile: per block, sum_k code x_k in fp32, then x scale, + minimum x the block's input sum
template <int R, typename Scale>
void int4_tile(const uint8_t* tile, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t m, bool fetch,
               float* out, int64_t N, __mmask16 lanes) {
  constexpr int C = kChains<R>;
  const int64_t K = x.width, blocks = K / kBlock;
  const __m512 code_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const float* in = x.values + m * K;
  __m512 products[R];
  for (int r = 0; r < R; ++r) products[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * kInt4TileBytes;
    if (fetch) prefetch(block, kInt4TileBytes);
    __m512 sums[R][C];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) sums[r][i] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i packed = _mm512_loadu_si512(block + 64 * c);
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        // the permute reads only each lane's low 4 bits: nibble p
        const __m512 w = _mm512_permutexvar_ps(_mm512_srli_epi32(packed, 4 * p), code_values);
        const int64_t k = b * kBlock + 8 * c + p;
        for (int r = 0; r < R; ++r)
          sums[r][p % C] = _mm512_fmadd_ps(w, _mm512_set1_ps(in[r * K + k]), sums[r][p % C]);
      }
    }
    add_group(products, sums, scales + b * kTileRows, mins + b * kTileRows, x.sums + m * blocks + b, blocks);
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m + r) * N, lanes, products[r]);
}

// a tile's 16 weights at k = 32b + j in fp32: int8 codes sign-extended and converted, fp32 weights as they are
inline __m512 load_tile_weights(const int8_t* block, int j) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kTileRows * j));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
inline __m512 load_tile_weights(const float* block, int j) { return _mm512_loadu_ps(block + kTileRows * j); }

// out rows m..m+R-1 of one tile of one value per weight (int8 codes, fp32 weights): sum_k w_k x_k in fp32, then
// finish(sum) (the int8 rows' scales, or the fp32 rows' bias)
template <int R, typename Weight, typename Finish>
void ungrouped_tile(const Weight* tile, const FloatRows& x, int64_t m, bool fetch, float* out, int64_t N,
                    __mmask16 lanes, Finish&& finish) {
  constexpr int C = kChains<R>;
  const int64_t K = x.width, blocks = K / kBlock;
  const float* in = x.values + m * K;
  __m512 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < C; ++i) sums[r][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Weight* block = tile + b * kTileRows * kBlock;
    if (fetch) prefetch(block, kTileRows * kBlock * sizeof(Weight));
#pragma GCC unroll 32
    for (int j = 0; j < kBlock; ++j) {
      const __m512 w = load_tile_weights(block, j);
      const int64_t k = b * kBlock + j;
      for (int r = 0; r < R; ++r) sums[r][j % C] = _mm512_fmadd_ps(w, _mm512_set1_ps(in[r * K + k]), sums[r][j % C]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m + r) * N, lanes, finish(chain_sum(sums[r])));
}

// out rows m..m+R-1 of one tile of uint8 codes in groups of G: per group, sum_k code x_k in fp32, then x scale, +
// minimum x the group's input sum
template <int R, int G, typename Scale>
void uint8_grouped_tile(const uint8_t* tile, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t m,
                        bool fetch, float* out, int64_t N, __mmask16 lanes) {
  constexpr int C = kChains<R>;
  const int64_t K = x.width, blocks = K / kBlock, groups = K / G;
  const float* in = x.values + m * K;
  __m512 products[R];
  for (int r = 0; r < R; ++r) products[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * kInt8TileBytes;
    if (fetch) prefetch(block, kInt8TileBytes);
#pragma GCC unroll 2
    for (int first = 0; first < kBlock; first += G) {
      __m512 sums[R][C];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < C; ++i) sums[r][i] = _mm512_setzero_ps();
#pragma GCC unroll 32
      for (int j = first; j < first + G; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kTileRows * j));
        const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
        const int64_t k = b * kBlock + j;
        for (int r = 0; r < R; ++r)
          sums[r][j % C] = _mm512_fmadd_ps(w, _mm512_set1_ps(in[r * K + k]), sums[r][j % C]);
      }
      const int64_t g = (b * kBlock + first) / G;
      add_group(products, sums, scales + g * kTileRows, mins + g * kTileRows, x.sums + m * groups + g, groups);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m + r) * N, lanes, products[r]);
}

template <int G, typename Scale>
void uint8_grouped_tiles(const uint8_t* codes, const Scale* scales, const Scale* mins, const FloatRows& x,
                         int64_t t0, int64_t t1, int64_t N, float* out) {
  const int64_t blocks = x.width / kBlock, groups = x.width / G;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    in_row_groups<kMaxRows>(x.rows, [&](auto rows, int64_t m) {
      uint8_grouped_tile<decltype(rows)::value, G, Scale>(codes + t * blocks * kInt8TileBytes,
                                                          scales + t * groups * kTileRows,
                                                          mins + t * groups * kTileRows, x, m, m == 0, out + n, N,
                                                          first_lanes(N - n));
    });
  }
}

}  // namespace

template <typename Scale>
void uint8_grouped_tiles_avx512(const uint8_t* codes, const Scale* scales, const Scale* mins, int64_t group,
                                const FloatRows& x, int64_t t0, int64_t t1, int64_t N, float* out) {
  if (group == 16) uint8_grouped_tiles<16>(codes, scales, mins, x, t0, t1, N, out);
  else uint8_grouped_tiles<32>(codes, scales, mins, x, t0, t1, N, out);
}

template void uint8_grouped_tiles_avx512(const uint8_t*, const float*, const float*, int64_t, const FloatRows&, int64_t,
                                         int64_t, int64_t, float*);
template void uint8_grouped_tiles_avx512(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const FloatRows&,
                                         int64_t, int64_t, int64_t, float*);

template <typename Scale>
void int4_tiles_avx512(const uint8_t* codes, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t t0,
                       int64_t t1, int64_t N, float* out) {
  const int64_t blocks = x.width / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    in_row_groups<kMaxRows>(x.rows, [&](auto rows, int64_t m) {
      int4_tile<decltype(rows)::value, Scale>(codes + t * blocks * kInt4TileBytes, scales + t * blocks * kTileRows,
                                              mins + t * blocks * kTileRows, x, m, m == 0, out + n, N,
                                              first_lanes(N - n));
    });
  }
}

template void int4_tiles_avx512(const uint8_t*, const float*, const float*, const FloatRows&, int64_t, int64_t,
                                int64_t, float*);
template void int4_tiles_avx512(const uint8_t*, const uint16_t*, const uint16_t*, const FloatRows&, int64_t, int64_t,
                                int64_t, float*);

void int8_tiles_avx512(const int8_t* weight, const float* scales, const FloatRows& x, int64_t t0, int64_t t1,
                       int64_t N, float* out) {
  const int64_t blocks = x.width / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    const __m512 row_scales = _mm512_loadu_ps(scales + n);
    in_row_groups<kMaxRows>(x.rows, [&](auto rows, int64_t m) {
      ungrouped_tile<decltype(rows)::value>(weight + t * blocks * kInt8TileBytes, x, m, m == 0, out + n, N,
                                            first_lanes(N - n),
                                            [&](__m512 sum) { return _mm512_mul_ps(sum, row_scales); });
    });
  }
}

void float_tiles_avx512(const float* weight, const float* bias, const FloatRows& x, int64_t t0, int64_t t1, int64_t N,
                        float* out) {
  const int64_t floats = x.width * kTileRows;  // one tile's
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    const __mmask16 lanes = first_lanes(N - n);
    const __m512 biases = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes, bias + n);
    in_row_groups<kMaxRows>(x.rows, [&](auto rows, int64_t m) {
      ungrouped_tile<decltype(rows)::value>(weight + t * floats, x, m, m == 0, out + n, N, lanes, [&](__m512 sum) {
        return bias == nullptr ? sum : _mm512_add_ps(sum, biases);
      });
    });
  }
}

}  // namespace fasterllm_cpu
