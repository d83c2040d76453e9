// decode_attention.h's one-sequence decode attention. Built for AVX2, the least that our kernels run on (vectorized
// by the compiler over the head dimension), with compiler built-ins only, as rms_norm.cpp.
#pragma GCC target("avx2,fma,f16c")
#include "decode_attention.h"

#include "widen.h"

namespace fasterllm_cpu {
namespace {

constexpr int kPartials = 8;  // independent partial sums: the compiler vectorizes them

// a · b over n floats
float dot(const float* a, const float* b, int64_t n) {
  float partial[kPartials] = {};
  int64_t j = 0;
  for (; j + kPartials <= n; j += kPartials)
    for (int p = 0; p < kPartials; ++p) partial[p] += a[j + p] * b[j + p];
  float total = 0.f;
  for (int p = 0; p < kPartials; ++p) total += partial[p];
  for (; j < n; ++j) total += a[j] * b[j];
  return total;
}

template <typename T>
void to_floats(const T* in, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = widen(in[j]);
}

template <typename T>
void attend(const T* query, const T* k_cache, const T* v_cache, const PagedKeys& keys, int64_t group, float scale,
            int64_t h0, int64_t h1, T* out, float* scratch) {
  const int64_t dim = keys.head_dim, count = keys.key_end - keys.key_start;
  for (int64_t h = h0; h < h1; ++h) {
    // this head's queries and outputs in fp32, one key or value row in fp32, and the scores
    float *q = scratch + h * (group * (2 * dim + count) + dim), *acc = q + group * dim, *row = acc + group * dim,
          *scores = row + dim;
    to_floats(query + h * group * dim, group * dim, q);
    auto at = [&](const T* cache, int64_t p) {  // key position p's row of KV head h
      const int64_t index = p / keys.block_size;
      const int64_t block = keys.block_ids ? keys.block_ids[index] : keys.first_block + index;
      return cache + ((block * keys.block_size + p % keys.block_size) * keys.num_kv_heads + h) * dim;
    };
    for (int64_t p = 0; p < count; ++p) {
      to_floats(at(k_cache, keys.key_start + p), dim, row);
      for (int64_t g = 0; g < group; ++g) scores[g * count + p] = dot(q + g * dim, row, dim) * scale;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * count;
      float top = s[0];
      for (int64_t p = 1; p < count; ++p) top = s[p] > top ? s[p] : top;
      float total = 0.f;
      for (int64_t p = 0; p < count; ++p) {
        s[p] = __builtin_expf(s[p] - top);
        total += s[p];
      }
      for (int64_t p = 0; p < count; ++p) s[p] /= total;
    }
    for (int64_t i = 0; i < group * dim; ++i) acc[i] = 0.f;
    for (int64_t p = 0; p < count; ++p) {
      to_floats(at(v_cache, keys.key_start + p), dim, row);
      for (int64_t g = 0; g < group; ++g) {
        const float weight = scores[g * count + p];
        float* a = acc + g * dim;
        for (int64_t d = 0; d < dim; ++d) a[d] += weight * row[d];
      }
    }
    for (int64_t i = 0; i < group * dim; ++i) out[h * group * dim + i] = round_to(acc[i], T());
  }
}

}  // namespace

void decode_attention(const float* query, const float* k_cache, const float* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, float* out, float* scratch) {
  attend(query, k_cache, v_cache, keys, group, scale, h0, h1, out, scratch);
}

void decode_attention(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, uint16_t* out, float* scratch) {
  attend(query, k_cache, v_cache, keys, group, scale, h0, h1, out, scratch);
}

}  // namespace fasterllm_cpu
