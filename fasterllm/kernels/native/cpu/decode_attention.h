// One sequence's decode-step attention over its paged KV cache, for single-stream decoding on the CPU: plain C++,
// decode_attention.cpp; ops.cpp's decode_attention checks the tensors and gives each thread whole KV heads.
#pragma once
#include <cstdint>

namespace fasterllm_cpu {

// Where a sequence's keys are: key position p is in block block_ids[p / block_size] (or first_block + p /
// block_size where block_ids is null: consecutive blocks), at row p % block_size; keys [key_start, key_end) are read.
struct PagedKeys {
  const int64_t* block_ids;
  int64_t first_block, block_size, num_kv_heads, head_dim, key_start, key_end;
};

// The query heads of KV heads [h0, h1) (group of them per KV head, rows of head_dim: query [Hq, D]) against their
// keys and values (k_cache, v_cache [num_blocks, block_size, Hkv, D]): softmax(q k * scale) v in fp32, each output
// row rounded once to the storage type. scratch: group * (2 * head_dim + keys) + head_dim floats for each KV head
// (head h uses the h-th such part), so threads on different heads share nothing.
void decode_attention(const float* query, const float* k_cache, const float* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, float* out, float* scratch);
void decode_attention(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, uint16_t* out, float* scratch);

}  // namespace fasterllm_cpu
