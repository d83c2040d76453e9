// Input rows to fp32 with each group's sum (gemv.h's FloatRows). Built for AVX2, the least that the kernels run
// on (vectorized by the compiler), with compiler built-ins only, so no inline library function built for this ISA is
// shared with another unit.
#pragma GCC target("avx2,fma,f16c")
#include "gemv.h"
#include "widen.h"

namespace fasterllm_cpu {
namespace {

template <typename T>
void widen_all(const T* x, int64_t rows, int64_t width, float* values, float* sums, int64_t group) {
  for (int64_t i = 0; i < rows * width; ++i) values[i] = widen(x[i]);
  if (sums == nullptr) return;
  constexpr int kPartials = 8;  // independent partial sums: the compiler vectorizes them
  for (int64_t block = 0; block < rows * width / group; ++block) {
    float partial[kPartials] = {};
    for (int64_t j = 0; j < group; j += kPartials)
      for (int p = 0; p < kPartials; ++p) partial[p] += values[block * group + j + p];
    float sum = 0.f;
    for (int p = 0; p < kPartials; ++p) sum += partial[p];
    sums[block] = sum;
  }
}

}  // namespace

void widen_rows(const float* x, int64_t rows, int64_t width, float* values, float* sums, int64_t group) {
  widen_all(x, rows, width, values, sums, group);
}

void widen_rows(const uint16_t* x, int64_t rows, int64_t width, float* values, float* sums, int64_t group) {
  widen_all(x, rows, width, values, sums, group);
}

}  // namespace fasterllm_cpu
