// The index of a row's largest value, as torch.argmax gives it (argmax_rows.cpp).
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

// the first index of x[0..width) holding its largest value; where the row holds a NaN, the first NaN's (torch
// orders NaN above every number); width >= 1
int64_t argmax_row(const float* x, int64_t width);

}  // namespace fasterllm_cpu
