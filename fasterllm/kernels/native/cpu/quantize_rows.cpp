// Input rows to int8 codes per block of 32, with each block's scale and sum (gemv.h); built for the baseline ISA:
// it touches K values per row where the products read N x K weights.
#include <cmath>

#include "gemv.h"

namespace fasterllm_cpu {

void quantize_rows(const float* x, int64_t rows, int64_t width, int8_t* codes, float* scales, float* sums,
                   float* errors) {
  const int64_t blocks = width / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * width + b * kBlock;
      float amax = 0.f, sum = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) {
        amax = std::fmax(amax, std::fabs(v[j]));
        sum += v[j];
      }
      const float scale = amax / 127.f;
      const float inverse = scale > 0.f ? 1.f / scale : 0.f;
      int8_t* q = codes + r * width + b * kBlock;
      int32_t code_sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));
        code_sum += q[j];
      }
      float* lanes = scales + (r * blocks + b) * kLanes;
      for (int64_t l = 0; l < kLanes; ++l) lanes[l] = scale;
      sums[r * blocks + b] = sum;
      errors[r * blocks + b] = 8.f * (sum - scale * static_cast<float>(code_sum));
    }
  }
}

}  // namespace fasterllm_cpu
