// Input rows quantized to int8 per block of 32 (gemv.h's Int8Rows). Built for AVX2, the least that the kernels run
// on; its intrinsics are inline functions built for this unit's ISA only.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "gemv.h"

namespace fasterllm_cpu {

// Vectorized: a decode step quantizes its input row once per product (about 120 per step for SmolLM2), and the
// scalar loop cost 1-2 us a call, as much as a small product's whole arithmetic.
void quantize_rows(const float* x, int64_t rows, int64_t width, int8_t* values, float* scales) {
  const int64_t blocks = rows * width / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // the two packs (below) leave the 32 bytes as 4-byte words of inputs 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23,
  // 28-31: this permute puts them back in order
  const __m256i word_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // int4's order: per chunk of 8 inputs the even ones, then the odd ones (within each 16-byte lane)
  const __m256i even_then_odd = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
  for (int64_t block = 0; block < blocks; ++block) {
    const float* in = x + block * kBlock;
    __m256 v[4], largest = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(in + 8 * i);
      largest = _mm256_max_ps(largest, _mm256_and_ps(v[i], magnitude));
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
    const float most = _mm_cvtss_f32(half);
    const float inverse = most > 0.f ? 127.f / most : 0.f;
    scales[block] = most / 127.f;
    // x * inverse rounded to nearest even (the default rounding mode), as rintf
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    const __m256i ordered = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(bytes, word_order), even_then_odd);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + block * kBlock), ordered);
  }
}

}  // namespace fasterllm_cpu
