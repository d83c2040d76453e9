// The AVX2 (+FMA) products of gemv.h: 8 output rows (half a tile) per 256-bit register, a tile's two halves side by
// side, the codes turned into fp32 in registers (int4: a shift, a mask and a conversion; int8: a sign extension and a
// conversion; uint8: a zero extension and a conversion) and multiplied with fp32 FMAs by the inputs as they come.
// Helpers live in an anonymous namespace so no inline function built for this ISA is shared with another unit.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include <algorithm>

#include "gemv.h"

namespace fasterllm_cpu {
namespace {

// input rows per pass over a tile (its two halves of 8 rows side by side): 2 x 2 int4 and 4 x 2 int8 accumulators,
// with the rest of a pass's registers, fit AVX2's 16 (int4 with int8 inputs: 2 x 2 pair sums and 2 x 2 products,
// which GCC's unrolled chunks spill from: not yet tuned)
constexpr int kMaxInt4Rows = 2;
constexpr int kMaxInt8Rows = 4;
constexpr int kMaxFloatRows = 4;  // 4 x 2 accumulators

inline void prefetch(const void* from, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(from) + kPrefetchBytes + line, _MM_HINT_T0);
}

// a tile's 16 lanes (two halves of 8) to out's row, cut at count
inline void store_rows(float* out, const __m256 (&halves)[2], int64_t count) {
  if (count >= 16) {
    _mm256_storeu_ps(out, halves[0]);
    _mm256_storeu_ps(out + 8, halves[1]);
    return;
  }
  float lanes[16];
  _mm256_storeu_ps(lanes, halves[0]);
  _mm256_storeu_ps(lanes + 8, halves[1]);
  for (int64_t r = 0; r < count; ++r) out[r] = lanes[r];
}

// 8 scales or minimums in fp32: fp32 ones as they are, fp16 ones (their bits) converted
inline __m256 load8(const float* from) { return _mm256_loadu_ps(from); }
inline __m256 load8(const uint16_t* from) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
}

// chains per half: the two halves are already two
template <int R>
constexpr int kHalfChains = kChains<R> > 1 ? kChains<R> / 2 : 1;

// the sum of one half-row's accumulator chains
template <int C>
inline __m256 chain_sum(const __m256 (&chains)[C]) {
  __m256 sum = chains[0];
  for (int i = 1; i < C; ++i) sum = _mm256_add_ps(sum, chains[i]);
  return sum;
}

// one group of a grouped tile done: products[r] += scale x (row r's sum of codes x inputs) + minimum x row r's input
// sum over the group (input_sums[r * stride]), each half of the tile
template <int R, int C, typename Scale>
inline void add_group(__m256 (&products)[R][2], const __m256 (&sums)[R][2][C], const Scale* scales, const Scale* mins,
                      const float* input_sums, int64_t stride) {
  for (int h = 0; h < 2; ++h) {
    const __m256 s = load8(scales + 8 * h), minimum = load8(mins + 8 * h);
    for (int r = 0; r < R; ++r) {
      products[r][h] = _mm256_fmadd_ps(chain_sum(sums[r][h]), s, products[r][h]);
      products[r][h] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(input_sums[r * stride]), products[r][h]);
    }
  }
}

// out rows m..m+R-1 of one tile: per block, sum_k code x_k in fp32, then x scale, + minimum x the block's input sum
template <int R, typename Scale>
void int4_tile(const uint8_t* tile, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t m, bool fetch,
               float* out, int64_t N, int64_t count) {
  constexpr int C = kHalfChains<R>;
  const int64_t K = x.width, blocks = K / kBlock;
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  const float* in = x.values + m * K;
  __m256 products[R][2];
  for (int r = 0; r < R; ++r) products[r][0] = products[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * kInt4TileBytes;
    if (fetch) prefetch(block, kInt4TileBytes);
    __m256 sums[R][2][C];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < C; ++i) sums[r][0][i] = sums[r][1][i] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i packed[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * c)),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * c + 32))};
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        __m256 w[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i shifted = _mm256_srli_epi32(packed[h], 4 * p);
          w[h] = _mm256_cvtepi32_ps(p == 7 ? shifted : _mm256_and_si256(shifted, nibble));
        }
        const int64_t k = b * kBlock + 8 * c + p;
        for (int r = 0; r < R; ++r) {
          const __m256 input = _mm256_set1_ps(in[r * K + k]);
          for (int h = 0; h < 2; ++h) sums[r][h][p % C] = _mm256_fmadd_ps(w[h], input, sums[r][h][p % C]);
        }
      }
    }
    add_group(products, sums, scales + b * kTileRows, mins + b * kTileRows, x.sums + m * blocks + b, blocks);
  }
  for (int r = 0; r < R; ++r) store_rows(out + (m + r) * N, products[r], count);
}

// out rows m..m+R-1 of one tile, the inputs quantized (Int8Rows): each 32-bit lane (one output row) of a chunk holds
// 8 codes; its low nibbles times the chunk's 4 even inputs and its high nibbles times the 4 odd ones, multiplied and
// summed in pairs into int16 (maddubs: at most 2 x 15 x 127 each, 8 of them per block stay below 2^15), then the
// block's pairs summed into int32, turned into fp32 once per block and scaled
template <int R, typename Scale>
void int4_tile_int8_inputs(const uint8_t* tile, const Scale* scales, const Scale* mins, const Int8Rows& x, int64_t m,
                           bool fetch, float* out, int64_t N, int64_t count) {
  const int64_t K = x.width, blocks = K / kBlock;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 products[R][2];
  for (int r = 0; r < R; ++r) products[r][0] = products[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * kInt4TileBytes;
    if (fetch) prefetch(block, kInt4TileBytes);
    __m256i pairs[R][2];
    for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m256i low[2], high[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * c + 32 * h));
        low[h] = _mm256_and_si256(packed, low_nibbles);
        high[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* in = x.values + (m + r) * K + b * kBlock + 8 * c;
        int32_t even, odd;
        __builtin_memcpy(&even, in, 4);
        __builtin_memcpy(&odd, in + 4, 4);
        const __m256i inputs[2] = {_mm256_set1_epi32(even), _mm256_set1_epi32(odd)};
        for (int h = 0; h < 2; ++h)
          pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(low[h], inputs[0]),
                                                                       _mm256_maddubs_epi16(high[h], inputs[1])));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m + r) * blocks + b;
      const __m256 input_scale = _mm256_set1_ps(x.scales[at]), input_sum = _mm256_set1_ps(x.sums[at]);
      for (int h = 0; h < 2; ++h) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs[r][h], ones));
        const __m256 scale = _mm256_mul_ps(load8(scales + b * kTileRows + 8 * h), input_scale);
        products[r][h] = _mm256_fmadd_ps(dot, scale, products[r][h]);
        products[r][h] = _mm256_fmadd_ps(load8(mins + b * kTileRows + 8 * h), input_sum, products[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store_rows(out + (m + r) * N, products[r], count);
}

// a tile's 16 weights at k = 32b + j in fp32 (two halves of 8): int8 codes sign-extended and converted, fp32 weights
// as they are
inline void load_tile_weights(const int8_t* block, int j, __m256 (&w)[2]) {
  for (int h = 0; h < 2; ++h) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + kTileRows * j + 8 * h));
    w[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}
inline void load_tile_weights(const float* block, int j, __m256 (&w)[2]) {
  for (int h = 0; h < 2; ++h) w[h] = _mm256_loadu_ps(block + kTileRows * j + 8 * h);
}

// out rows m..m+R-1 of one tile of one value per weight (int8 codes, fp32 weights): sum_k w_k x_k in fp32, then
// finish(sum, h) of each half h (the int8 rows' scales, or the fp32 rows' bias)
template <int R, typename Weight, typename Finish>
void ungrouped_tile(const Weight* tile, const FloatRows& x, int64_t m, bool fetch, float* out, int64_t N,
                    int64_t count, Finish&& finish) {
  constexpr int C = kHalfChains<R>;
  const int64_t K = x.width, blocks = K / kBlock;
  const float* in = x.values + m * K;
  __m256 sums[R][2][C];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < C; ++i) sums[r][0][i] = sums[r][1][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const Weight* block = tile + b * kTileRows * kBlock;
    if (fetch) prefetch(block, kTileRows * kBlock * sizeof(Weight));
#pragma GCC unroll 32
    for (int j = 0; j < kBlock; ++j) {
      __m256 w[2];
      load_tile_weights(block, j, w);
      const int64_t k = b * kBlock + j;
      for (int r = 0; r < R; ++r) {
        const __m256 input = _mm256_set1_ps(in[r * K + k]);
        for (int h = 0; h < 2; ++h) sums[r][h][j % C] = _mm256_fmadd_ps(w[h], input, sums[r][h][j % C]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 result[2];
    for (int h = 0; h < 2; ++h) result[h] = finish(chain_sum(sums[r][h]), h);
    store_rows(out + (m + r) * N, result, count);
  }
}

// out rows m..m+R-1 of one tile of uint8 codes in groups of G: per group, sum_k code x_k in fp32, then x scale, +
// minimum x the group's input sum
template <int R, int G, typename Scale>
void uint8_grouped_tile(const uint8_t* tile, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t m,
                        bool fetch, float* out, int64_t N, int64_t count) {
  constexpr int C = kHalfChains<R>;
  const int64_t K = x.width, blocks = K / kBlock, groups = K / G;
  const float* in = x.values + m * K;
  __m256 products[R][2];
  for (int r = 0; r < R; ++r) products[r][0] = products[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * kInt8TileBytes;
    if (fetch) prefetch(block, kInt8TileBytes);
#pragma GCC unroll 2
    for (int first = 0; first < kBlock; first += G) {
      __m256 sums[R][2][C];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < C; ++i) sums[r][0][i] = sums[r][1][i] = _mm256_setzero_ps();
#pragma GCC unroll 32
      for (int j = first; j < first + G; ++j) {
        __m256 w[2];
        for (int h = 0; h < 2; ++h) {
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + kTileRows * j + 8 * h));
          w[h] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
        }
        const int64_t k = b * kBlock + j;
        for (int r = 0; r < R; ++r) {
          const __m256 input = _mm256_set1_ps(in[r * K + k]);
          for (int h = 0; h < 2; ++h) sums[r][h][j % C] = _mm256_fmadd_ps(w[h], input, sums[r][h][j % C]);
        }
      }
      const int64_t g = (b * kBlock + first) / G;
      add_group(products, sums, scales + g * kTileRows, mins + g * kTileRows, x.sums + m * groups + g, groups);
    }
  }
  for (int r = 0; r < R; ++r) store_rows(out + (m + r) * N, products[r], count);
}

template <int G, typename Scale>
void uint8_grouped_tiles(const uint8_t* codes, const Scale* scales, const Scale* mins, const FloatRows& x,
                         int64_t t0, int64_t t1, int64_t N, float* out) {
  const int64_t blocks = x.width / kBlock, groups = x.width / G;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    in_row_groups<kMaxInt4Rows>(x.rows, [&](auto rows, int64_t m) {
      uint8_grouped_tile<decltype(rows)::value, G, Scale>(codes + t * blocks * kInt8TileBytes,
                                                          scales + t * groups * kTileRows,
                                                          mins + t * groups * kTileRows, x, m, m == 0, out + n, N,
                                                          N - n);
    });
  }
}

}  // namespace

template <typename Scale>
void uint8_grouped_tiles_avx2(const uint8_t* codes, const Scale* scales, const Scale* mins, int64_t group,
                              const FloatRows& x, int64_t t0, int64_t t1, int64_t N, float* out) {
  if (group == 16) uint8_grouped_tiles<16>(codes, scales, mins, x, t0, t1, N, out);
  else uint8_grouped_tiles<32>(codes, scales, mins, x, t0, t1, N, out);
}

template void uint8_grouped_tiles_avx2(const uint8_t*, const float*, const float*, int64_t, const FloatRows&, int64_t,
                                       int64_t, int64_t, float*);
template void uint8_grouped_tiles_avx2(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const FloatRows&,
                                       int64_t, int64_t, int64_t, float*);

template <typename Scale>
void int4_tiles_avx2(const uint8_t* codes, const Scale* scales, const Scale* mins, const FloatRows& x, int64_t t0,
                     int64_t t1, int64_t N, float* out) {
  const int64_t blocks = x.width / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    in_row_groups<kMaxInt4Rows>(x.rows, [&](auto rows, int64_t m) {
      int4_tile<decltype(rows)::value, Scale>(codes + t * blocks * kInt4TileBytes, scales + t * blocks * kTileRows,
                                              mins + t * blocks * kTileRows, x, m, m == 0, out + n, N, N - n);
    });
  }
}

template <typename Scale>
void int4_tiles_int8_inputs_avx2(const uint8_t* codes, const Scale* scales, const Scale* mins, const Int8Rows& x,
                                 int64_t t0, int64_t t1, int64_t N, float* out) {
  const int64_t blocks = x.width / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    in_row_groups<kMaxInt4Rows>(x.rows, [&](auto rows, int64_t m) {
      int4_tile_int8_inputs<decltype(rows)::value, Scale>(codes + t * blocks * kInt4TileBytes,
                                                          scales + t * blocks * kTileRows,
                                                          mins + t * blocks * kTileRows, x, m, m == 0, out + n, N,
                                                          N - n);
    });
  }
}

template void int4_tiles_avx2(const uint8_t*, const float*, const float*, const FloatRows&, int64_t, int64_t, int64_t,
                              float*);
template void int4_tiles_avx2(const uint8_t*, const uint16_t*, const uint16_t*, const FloatRows&, int64_t, int64_t,
                              int64_t, float*);
template void int4_tiles_int8_inputs_avx2(const uint8_t*, const float*, const float*, const Int8Rows&, int64_t,
                                          int64_t, int64_t, float*);
template void int4_tiles_int8_inputs_avx2(const uint8_t*, const uint16_t*, const uint16_t*, const Int8Rows&, int64_t,
                                          int64_t, int64_t, float*);

void int8_tiles_avx2(const int8_t* weight, const float* scales, const FloatRows& x, int64_t t0, int64_t t1, int64_t N,
                     float* out) {
  const int64_t blocks = x.width / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    const __m256 row_scales[2] = {_mm256_loadu_ps(scales + n), _mm256_loadu_ps(scales + n + 8)};
    in_row_groups<kMaxInt8Rows>(x.rows, [&](auto rows, int64_t m) {
      ungrouped_tile<decltype(rows)::value>(weight + t * blocks * kInt8TileBytes, x, m, m == 0, out + n, N, N - n,
                                            [&](__m256 sum, int h) { return _mm256_mul_ps(sum, row_scales[h]); });
    });
  }
}

void float_tiles_avx2(const float* weight, const float* bias, const FloatRows& x, int64_t t0, int64_t t1, int64_t N,
                      float* out) {
  const int64_t floats = x.width * kTileRows;  // one tile's
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kTileRows;
    float lanes[kTileRows] = {};  // the tile's bias, zero past N
    if (bias != nullptr) __builtin_memcpy(lanes, bias + n, sizeof(float) * std::min(N - n, kTileRows));
    const __m256 biases[2] = {_mm256_loadu_ps(lanes), _mm256_loadu_ps(lanes + 8)};
    in_row_groups<kMaxFloatRows>(x.rows, [&](auto rows, int64_t m) {
      ungrouped_tile<decltype(rows)::value>(weight + t * floats, x, m, m == 0, out + n, N, N - n,
                                            [&](__m256 sum, int h) {
                                              return bias == nullptr ? sum : _mm256_add_ps(sum, biases[h]);
                                            });
    });
  }
}

}  // namespace fasterllm_cpu
