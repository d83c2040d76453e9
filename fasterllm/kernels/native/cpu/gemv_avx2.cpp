// The AVX2 (+FMA) products of gemv.h: one 256-bit register per block of 32, integer dot products through
// maddubs (u8 x s8 pairs to int16) and madd (pairs to int32), each block's sums scaled in fp32.
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

// a block's 32 codes in order from its 16 bytes (code j: low nibble of byte j; code j + 16: its high nibble)
inline __m256i unpack_int4_block(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
}

// sum over blocks of minimum * (the block's input sum)
inline float minimums_term(const float* mins, const float* sums, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b), _mm256_loadu_ps(sums + b), acc);
  float total = horizontal_sum(acc);
  for (; b < blocks; ++b) total += mins[b] * sums[b];
  return total;
}

inline __m256 int4_block(const uint8_t* codes, const int8_t* q, const float* lane_scales, float scale, __m256 acc) {
  const __m256i sums = dot_u8_s8(unpack_int4_block(codes), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(lane_scales), _mm256_set1_ps(scale));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, acc);
}

inline __m256 int8_block(const int8_t* w, const int8_t* q, const float* lane_scales, __m256 acc) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  // |w| x (q with w's sign): u8 x s8 products equal to w x q
  const __m256i sums = dot_u8_s8(_mm256_abs_epi8(wv), _mm256_sign_epi8(qv, wv));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(lane_scales), acc);
}

}  // namespace

void int4_rows_avx2(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                    int64_t n0, int64_t n1, int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = codes + n * (K / 2);
    const float* row_scales = scales + n * blocks;
    for (int64_t m = 0; m < x.rows; ++m) {
      const int8_t* q = x.codes + m * K;
      const float* lane_scales = x.scales + m * blocks * kLanes;
      __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();  // two chains hide the FMA latency
      int64_t b = 0;
      for (; b + 2 <= blocks; b += 2) {
        even = int4_block(row + 16 * b, q + kBlock * b, lane_scales + kLanes * b, row_scales[b], even);
        odd = int4_block(row + 16 * (b + 1), q + kBlock * (b + 1), lane_scales + kLanes * (b + 1),
                         row_scales[b + 1], odd);
      }
      if (b < blocks) even = int4_block(row + 16 * b, q + kBlock * b, lane_scales + kLanes * b, row_scales[b], even);
      out[m * N + n] = horizontal_sum(_mm256_add_ps(even, odd)) +
                       minimums_term(mins + n * blocks, x.sums + m * blocks, blocks);
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
