// Input rows to int8 codes per block of 32, with each block's scale, sum and rounding error (gemv.h). Built for
// AVX2, the least that kernels run on (vectorized by the compiler, rounding inlined as vroundps), with compiler
// built-ins only, so no inline library function built for this ISA is shared with another unit.
#pragma GCC target("avx2,fma,f16c")
#include "gemv.h"
#include "widen.h"

namespace fasterllm_cpu {
namespace {

template <typename T>
void quantize(const T* x, int64_t rows, int64_t width, int8_t* codes, float* scales, float* sums, float* errors) {
  const int64_t blocks = width / kBlock;
  float v[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* in = x + r * width + b * kBlock;
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) {
        v[j] = widen(in[j]);
        const float magnitude = __builtin_fabsf(v[j]);
        amax = magnitude > amax ? magnitude : amax;
        sum += v[j];
      }
      const float scale = amax / 127.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;
      int8_t* q = codes + r * width + b * kBlock;
      int32_t code_sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(__builtin_nearbyintf(v[j] * inverse));
        code_sum += q[j];
      }
      scales[r * blocks + b] = scale;
      sums[r * blocks + b] = sum;
      errors[r * blocks + b] = 8.f * (sum - scale * static_cast<float>(code_sum));
    }
  }
}

}  // namespace

void quantize_rows(const float* x, int64_t rows, int64_t width, int8_t* codes, float* scales, float* sums,
                   float* errors) {
  quantize(x, rows, width, codes, scales, sums, errors);
}

void quantize_rows(const uint16_t* x, int64_t rows, int64_t width, int8_t* codes, float* scales, float* sums,
                   float* errors) {
  quantize(x, rows, width, codes, scales, sums, errors);
}

}  // namespace fasterllm_cpu
