// The AVX-512 products of gemv.h: one 512-bit register per two blocks of 32 (int32 lanes 0-7 the first block's,
// 8-15 the second's), integer dot products through VNNI's dpbusd (u8 x s8 quads to int32), each block's sums scaled
// in fp32; an odd last block through masked loads. Output rows go in groups of 4 that share each input load and one
// horizontal reduction. Needs avx512f/bw/dq/vl and avx512_vnni.
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

// two blocks' 64 codes in order from their 32 bytes (code j: low nibble of byte j; code j + 16: its high nibble);
// `bytes` masks the load (an odd last block: its 16 bytes, the rest zero)
inline __m512i unpack_int4_pair(const uint8_t* p, __mmask32 bytes) {
  const __m256i packed = _mm256_maskz_loadu_epi8(bytes, p);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i low = _mm256_and_si256(packed, nibble), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
  const __m512i halves = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);  // low0 low1 high0 high1
  return _mm512_shuffle_i64x2(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));             // low0 high0 low1 high1
}

template <int R>
void int4_group(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x, int64_t n,
                int64_t N, float* out) {
  const int64_t K = x.width, blocks = K / kBlock;
  for (int64_t m = 0; m < x.rows; ++m) {
    const int8_t* q = x.codes + m * K;
    const float* lane_scales = x.scales + m * blocks * kLanes;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
      const bool pair = b + 1 < blocks;
      const __m512i qv = _mm512_maskz_loadu_epi8(pair ? ~__mmask64(0) : __mmask64(0xFFFFFFFF), q + kBlock * b);
      const __m512 lanes = _mm512_maskz_loadu_ps(pair ? __mmask16(0xFFFF) : __mmask16(0xFF), lane_scales + kLanes * b);
      for (int r = 0; r < R; ++r) {
        const int64_t row = n + r;
        const __m512i w = unpack_int4_pair(codes + row * (K / 2) + 16 * b, pair ? ~__mmask32(0) : __mmask32(0xFFFF));
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, qv);
        const float* s = scales + row * blocks + b;
        const __m512 s2 = _mm512_insertf32x8(_mm512_set1_ps(s[0]), _mm256_set1_ps(pair ? s[1] : 0.f), 1);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(lanes, s2), acc[r]);
      }
    }
    // + minimum x the block's input sum + scale x its rounding error (gemv.h), 16 blocks at a time
    for (int64_t b = 0; b < blocks; b += 16) {
      const __mmask16 valid = first16(blocks - b);
      const __m512 sums = _mm512_maskz_loadu_ps(valid, x.sums + m * blocks + b);
      const __m512 errors = _mm512_maskz_loadu_ps(valid, x.errors + m * blocks + b);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (n + r) * blocks + b;
        acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(valid, mins + at), sums, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(valid, scales + at), errors, acc[r]);
      }
    }
    store_sums<R>(acc, out + m * N + n);
  }
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

void int4_rows_avx512(const uint8_t* codes, const float* scales, const float* mins, const QuantizedRows& x,
                      int64_t n0, int64_t n1, int64_t N, float* out) {
  int64_t n = n0;
  for (; n + kGroup <= n1; n += kGroup) int4_group<kGroup>(codes, scales, mins, x, n, N, out);
  for (; n < n1; ++n) int4_group<1>(codes, scales, mins, x, n, N, out);
}

void int8_rows_avx512(const int8_t* weight, const float* scales, const QuantizedRows& x, int64_t n0, int64_t n1,
                      int64_t N, float* out) {
  int64_t n = n0;
  for (; n + kGroup <= n1; n += kGroup) int8_group<kGroup>(weight, scales, x, n, N, out);
  for (; n < n1; ++n) int8_group<1>(weight, scales, x, n, N, out);
}

}  // namespace fasterllm_cpu
