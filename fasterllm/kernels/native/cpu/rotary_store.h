// A decode step's RoPE on Q and K and its K/V store into the paged cache, in one pass (CPU), rounded as the torch
// path rounds (layers/rotary.apply_rotary, layers/attention.store_kv), so the two give the same bits.
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

struct RotaryStoreShape {
  int64_t tokens, heads, kv_heads, dim;
  int64_t qkv_row, table_row;  // elements from one token's qkv row (table row) to the next
  int64_t stored;  // the first `stored` tokens have a slot (the rest are padding)
};

// qkv [tokens, heads + 2 kv_heads, dim]: the query and key heads rotated in place, x * cos + swap_halves(x) * sin
// (cos, sin: full-width rows, sin signed; each product rounded to the dtype as torch's mul and addcmul round), then
// each stored token's key and value heads copied to its slot of k_cache / v_cache [blocks, block_size, kv_heads, dim]
void rotary_store(uint16_t* qkv, const uint16_t* cos, const uint16_t* sin, uint16_t* k_cache, uint16_t* v_cache,
                  const int64_t* slots, const RotaryStoreShape& shape);
void rotary_store(float* qkv, const float* cos, const float* sin, float* k_cache, float* v_cache, const int64_t* slots,
                  const RotaryStoreShape& shape);

}  // namespace fasterllm_cpu
