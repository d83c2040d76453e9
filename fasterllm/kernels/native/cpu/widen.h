// fp32 from fp32 or from bf16 (as its uint16 bits), and back, for the units that read and write either
// (widen_rows.cpp, rms_norm.cpp, decode_attention.cpp).
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

inline float round_to(float v, float) { return v; }

// v rounded to bf16 (to nearest, ties to even), as its bits
inline uint16_t round_to(float v, uint16_t) {
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace
}  // namespace fasterllm_cpu
