// rotary_store.h's fused RoPE and K/V store. Built for AVX2 (vectorized by the compiler); x * cos + swapped * sin
// as torch's mul and addcmul compute it: in bf16 the product and the sum apart, in fp32 one fused multiply-add.
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include "rotary_store.h"

#include "widen.h"

namespace fasterllm_cpu {
namespace {

// scaled + swapped * sin, as torch's addcmul: fp32 fuses it, bf16 (computed in fp32) does not
inline float add_product(float scaled, float swapped, float sin, float) {
  return __builtin_fmaf(swapped, sin, scaled);
}
inline float add_product(float scaled, float swapped, float sin, uint16_t) { return scaled + swapped * sin; }

template <typename T>
void rotate_then_store(T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache, const int64_t* slots,
                       const RotaryStoreShape& s) {
  const int64_t half = s.dim / 2, kv_width = s.kv_heads * s.dim;
  float rotated[512];  // one head (dim <= 512, checked by the caller)
  for (int64_t t = 0; t < s.tokens; ++t) {
    T* row = qkv + t * s.qkv_row;
    const T* c = cos + t * s.table_row;
    const T* n = sin + t * s.table_row;
    for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) {
      T* x = row + h * s.dim;
      for (int64_t d = 0; d < s.dim; ++d) {
        const float scaled = widen(round_to(widen(x[d]) * widen(c[d]), T()));  // x * cos, in the dtype
        rotated[d] = add_product(scaled, widen(x[d < half ? d + half : d - half]), widen(n[d]), T());
      }
      for (int64_t d = 0; d < s.dim; ++d) x[d] = round_to(rotated[d], T());
    }
    if (t >= s.stored) continue;
    const int64_t at = slots[t] * kv_width;  // the cache's slot-th [kv_heads, dim] row
    const T* key = row + s.heads * s.dim;
    for (int64_t i = 0; i < kv_width; ++i) k_cache[at + i] = key[i];
    for (int64_t i = 0; i < kv_width; ++i) v_cache[at + i] = key[kv_width + i];
  }
}

}  // namespace

void rotary_store(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, uint16_t* k_cache, uint16_t* v_cache,
                  const int64_t* slots, const RotaryStoreShape& shape) {
  rotate_then_store(qkv, cos, sin, k_cache, v_cache, slots, shape);
}

void rotary_store(float* qkv, const float* cos, const float* sin, float* k_cache, float* v_cache, const int64_t* slots,
                  const RotaryStoreShape& shape) {
  rotate_then_store(qkv, cos, sin, k_cache, v_cache, slots, shape);
}

}  // namespace fasterllm_cpu
