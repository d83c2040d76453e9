// decode_attention.h's one-sequence decode attention over bf16 or fp32 paged K/V, in AVX2 / FMA intrinsics (the
// least our kernels run on). Per KV head: the scores of its query heads, key by key (each key row widened once for
// all of them), an exp2 in eight lanes at a time, then the weighted sum of the value rows, with the head's
// accumulators in registers (the head dimension is a template parameter).
#pragma GCC target("avx2,fma,f16c")
#include "decode_attention.h"

#include <immintrin.h>

#include <cmath>

#include "widen.h"

namespace fasterllm_cpu {
namespace {

// 8 bf16 (their bits) or fp32 -> 8 fp32
inline __m256 widen8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

inline float sum8(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// 2^x for x <= 0 in eight lanes: 2^round(x) by the exponent bits times 2^f, f in [-1/2, 1/2], by the degree-6
// Taylor polynomial of e^(f ln 2) (relative error under 2e-7); x below -126 gives 2^-126
inline __m256 exp2_8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 whole = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 t = _mm256_mul_ps(_mm256_sub_ps(x, whole), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

template <int kChunks, typename T>  // head_dim / 8; T: bf16 bits (uint16_t) or float
void attend_head(const T* query, const T* k_cache, const T* v_cache, const PagedKeys& keys, int64_t group,
                 float scale_log2, int64_t h, float* scratch, T* out) {
  constexpr int64_t dim = kChunks * 8;
  const int64_t count = keys.key_end - keys.key_start, padded = (count + 7) / 8 * 8;
  float* q = scratch;  // the group's queries in fp32, times scale * log2(e): [group, dim]
  float* scores = q + group * dim;  // [group, padded]
  // each key's row of KV head h, in order: visit(i, row) for the i-th key (position key_start + i), block by block
  const int64_t row_stride = keys.num_kv_heads * dim;
  auto for_each_row = [&](const T* cache, auto&& visit) {
    for (int64_t b = keys.key_start / keys.block_size, first = b * keys.block_size; first < keys.key_end;
         ++b, first += keys.block_size) {
      const int64_t block = keys.block_ids[b];
      const T* base = cache + block * keys.block_size * row_stride + h * dim;
      const int64_t lo = first > keys.key_start ? first : keys.key_start;
      const int64_t hi = first + keys.block_size < keys.key_end ? first + keys.block_size : keys.key_end;
      for (int64_t p = lo; p < hi; ++p) visit(p - keys.key_start, base + (p - first) * row_stride);
    }
  };
  for (int64_t i = 0; i < group * kChunks; ++i)
    _mm256_storeu_ps(q + 8 * i, _mm256_mul_ps(widen8(query + h * group * dim + 8 * i), _mm256_set1_ps(scale_log2)));
  for_each_row(k_cache, [&](int64_t p, const T* k_row) {  // each key row widened once for every query head
    __m256 k[kChunks];
    for (int c = 0; c < kChunks; ++c) k[c] = widen8(k_row + 8 * c);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * dim;
      __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
      for (int c = 0; c + 1 < kChunks; c += 2) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), k[c], even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c + 8), k[c + 1], odd);
      }
      if (kChunks % 2) even = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * (kChunks - 1)), k[kChunks - 1], even);
      scores[g * padded + p] = sum8(_mm256_add_ps(even, odd));
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * padded;
    float top = -INFINITY;
    for (int64_t p = 0; p < count; ++p) top = s[p] > top ? s[p] : top;
    for (int64_t p = count; p < padded; ++p) s[p] = -INFINITY;
    __m256 total = _mm256_setzero_ps();  // the padding's lanes add 2^-126 each: nothing beside the top key's 1
    for (int64_t p = 0; p < padded; p += 8) {
      const __m256 weight = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(s + p), _mm256_set1_ps(top)));
      _mm256_storeu_ps(s + p, weight);
      total = _mm256_add_ps(total, weight);
    }
    __m256 acc[kChunks];  // this query head's output, in registers (a value row is widened once per query head)
    for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_setzero_ps();
    for_each_row(v_cache, [&](int64_t p, const T* v) {
      const __m256 weight = _mm256_set1_ps(s[p]);
      for (int c = 0; c < kChunks; ++c) acc[c] = _mm256_fmadd_ps(weight, widen8(v + 8 * c), acc[c]);
    });
    const float inverse = 1.f / sum8(total);
    T* o = out + (h * group + g) * dim;
    for (int c = 0; c < kChunks; ++c) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, _mm256_mul_ps(acc[c], _mm256_set1_ps(inverse)));
      for (int i = 0; i < 8; ++i) o[8 * c + i] = round_to(lanes[i], T());
    }
  }
}

}  // namespace

bool decode_attention_supports(int64_t head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

int64_t decode_attention_scratch(int64_t group, int64_t head_dim, int64_t key_count) {
  return group * (head_dim + (key_count + 7) / 8 * 8);
}

namespace {

template <typename T>
void attend(const T* query, const T* k_cache, const T* v_cache, const PagedKeys& keys, int64_t group, float scale,
            int64_t h0, int64_t h1, float* scratch, T* out) {
  const float scale_log2 = scale * 1.4426950408889634f;
  const int64_t per_head = decode_attention_scratch(group, keys.head_dim, keys.key_end - keys.key_start);
  for (int64_t h = h0; h < h1; ++h) {
    float* s = scratch + h * per_head;
    switch (keys.head_dim) {
      case 64: attend_head<8>(query, k_cache, v_cache, keys, group, scale_log2, h, s, out); break;
      case 80: attend_head<10>(query, k_cache, v_cache, keys, group, scale_log2, h, s, out); break;
      case 96: attend_head<12>(query, k_cache, v_cache, keys, group, scale_log2, h, s, out); break;
      case 128: attend_head<16>(query, k_cache, v_cache, keys, group, scale_log2, h, s, out); break;
      default: attend_head<32>(query, k_cache, v_cache, keys, group, scale_log2, h, s, out); break;
    }
  }
}

}  // namespace

void decode_attention(const uint16_t* query, const uint16_t* k_cache, const uint16_t* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, float* scratch, uint16_t* out) {
  attend(query, k_cache, v_cache, keys, group, scale, h0, h1, scratch, out);
}

void decode_attention(const float* query, const float* k_cache, const float* v_cache, const PagedKeys& keys,
                      int64_t group, float scale, int64_t h0, int64_t h1, float* scratch, float* out) {
  attend(query, k_cache, v_cache, keys, group, scale, h0, h1, scratch, out);
}

}  // namespace fasterllm_cpu
