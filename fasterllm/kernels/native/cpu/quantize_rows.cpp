// Input rows quantized to int8 per block of 32 (gemv.h's Int8Rows). Built for AVX2, the least that the kernels run
// on (vectorized by the compiler where it can), with compiler built-ins only, so no inline library function built for
// this ISA is shared with another unit.
#pragma GCC target("avx2,fma,f16c")
#include "gemv.h"

namespace fasterllm_cpu {

void quantize_rows(const float* x, int64_t rows, int64_t width, int8_t* values, float* scales) {
  const int64_t blocks = rows * width / kBlock;
  for (int64_t block = 0; block < blocks; ++block) {
    const float* in = x + block * kBlock;
    float largest = 0.f;
    for (int k = 0; k < kBlock; ++k) largest = __builtin_fmaxf(largest, __builtin_fabsf(in[k]));
    const float inverse = largest > 0.f ? 127.f / largest : 0.f;
    scales[block] = largest / 127.f;
    int8_t* out = values + block * kBlock;
    for (int c = 0; c < kBlock / 8; ++c)
      for (int j = 0; j < 4; ++j) {  // the even inputs of the chunk, then the odd ones
        out[8 * c + j] = static_cast<int8_t>(__builtin_rintf(in[8 * c + 2 * j] * inverse));
        out[8 * c + 4 + j] = static_cast<int8_t>(__builtin_rintf(in[8 * c + 2 * j + 1] * inverse));
      }
  }
}

}  // namespace fasterllm_cpu
