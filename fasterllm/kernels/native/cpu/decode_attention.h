// One sequence's decode-step attention over its paged K/V cache (bf16 or fp32), for single-stream CPU decoding: the new
// token's query heads against the keys at positions key_start..key_end - 1 of its blocks, read in place.
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

struct PagedKeys {
  const int64_t* block_ids;  // the sequence's blocks in order
  int64_t block_size, num_kv_heads, head_dim, key_start, key_end;
};

// whether decode_attention runs this head dimension
bool decode_attention_supports(int64_t head_dim);

// the floats of scratch decode_attention uses per KV head
int64_t decode_attention_scratch(int64_t group, int64_t head_dim, int64_t key_count);

// KV heads h0..h1-1 (each with its `group` query heads, consecutive in query and out, [Hq, head_dim]) of
// softmax(q k^T * scale) v; the caches are [num_blocks, block_size, num_kv_heads, head_dim]; bf16 (as its bits) or
// fp32 throughout; scratch: num_kv_heads * decode_attention_scratch(...) floats
void decode_attention(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, float* scratch, uint16_t* out);
void decode_attention(const float* query, const float* k_cache, const float* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, float* scratch, float* out);

}  // namespace fasterllm_cpu
