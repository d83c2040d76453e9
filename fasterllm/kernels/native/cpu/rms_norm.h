// RMSNorm with the residual added first, over rows of fp32 or bf16 (as uint16 bits): plain C++, rms_norm.cpp;
// ops.cpp's add_rms_norm checks the tensors and splits the rows over torch's threads.
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

// sum = x + residual rounded to the storage type (written only where residual is given; else x is the sum);
// out = round(round(sum * rsqrt(mean(sum^2) + eps)) * weight), in fp32 between the roundings, as the torch path does
void add_rms_norm(const float* x, const float* residual, const float* weight, float eps, int64_t rows, int64_t width,
                  float* out, float* sum);
void add_rms_norm(const uint16_t* x, const uint16_t* residual, const uint16_t* weight, float eps, int64_t rows,
                  int64_t width, uint16_t* out, uint16_t* sum);

}  // namespace fasterllm_cpu
