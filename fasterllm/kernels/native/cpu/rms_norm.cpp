// rms_norm.h's fused add + RMSNorm. Built for AVX2, the least that our kernels run on (vectorized by the compiler),
// with compiler built-ins only, so no inline library function built for this ISA is shared with another unit.
#pragma GCC target("avx2,fma,f16c")
#include "rms_norm.h"
#include "widen.h"

namespace fasterllm_cpu {
namespace {

template <typename T>
void fused(const T* x, const T* residual, const T* weight, float eps, int64_t rows, int64_t width, T* out, T* sum) {
  constexpr int kPartials = 8;  // independent partial sums of squares: the compiler vectorizes them
  for (int64_t r = 0; r < rows; ++r) {
    const T* in = x + r * width;
    const T* summed = in;
    if (residual != nullptr) {
      T* s = sum + r * width;
      for (int64_t j = 0; j < width; ++j) s[j] = round_to(widen(in[j]) + widen(residual[r * width + j]), T());
      summed = s;
    }
    float partial[kPartials] = {};
    int64_t j = 0;
    for (; j + kPartials <= width; j += kPartials)
      for (int p = 0; p < kPartials; ++p) partial[p] += widen(summed[j + p]) * widen(summed[j + p]);
    float squares = 0.f;
    for (int p = 0; p < kPartials; ++p) squares += partial[p];
    for (; j < width; ++j) squares += widen(summed[j]) * widen(summed[j]);
    const float inverse = 1.f / __builtin_sqrtf(squares / static_cast<float>(width) + eps);
    T* o = out + r * width;
    for (j = 0; j < width; ++j) o[j] = round_to(widen(round_to(widen(summed[j]) * inverse, T())) * widen(weight[j]), T());
  }
}

}  // namespace

void add_rms_norm(const float* x, const float* residual, const float* weight, float eps, int64_t rows, int64_t width,
                  float* out, float* sum) {
  fused(x, residual, weight, eps, rows, width, out, sum);
}

void add_rms_norm(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, float eps, int64_t rows,
                  int64_t width, uint16_t* out, uint16_t* sum) {
  fused(x, residual, weight, eps, rows, width, out, sum);
}

}  // namespace fasterllm_cpu
