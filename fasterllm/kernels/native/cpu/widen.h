// fp32 from fp32 or from bf16 (as its uint16 bits), for the units that read either (widen_rows.cpp, rms_norm.cpp).
// In an anonymous namespace: each unit keeps its own copy, built for its own ISA.
#pragma once
#include <cstdint>

namespace fasterllm_cpu {
namespace {

inline float widen(float v) { return v; }

inline float widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

}  // namespace
}  // namespace fasterllm_cpu
