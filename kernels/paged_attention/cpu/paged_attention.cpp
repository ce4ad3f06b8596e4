// Paged attention on CPU: float32, AVX2/FMA, parallel over (token, kv head).
//
// Each query token attends to the keys of its own request at positions <= its own position
// (and within the sliding window), read straight from the paged cache through the request's
// block table: no gather into a padded copy, no mask tensor. The query heads that share a kv
// head (GQA) are processed together, so each key and value row is loaded once per group.
// Softmax is computed online (running max and sum) one cache block at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;      // query heads per kv head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 256;

inline float dot(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  sum4 = _mm_hadd_ps(sum4, sum4);
  sum4 = _mm_hadd_ps(sum4, sum4);
  return _mm_cvtss_f32(sum4);  // head_dim is a multiple of 8 (checked by the launcher)
}

// y = y * scale + w * x
inline void scale_add(float* y, float scale, float w, const float* x, int n) {
  const __m256 vs = _mm256_set1_ps(scale), vw = _mm256_set1_ps(w);
  for (int i = 0; i < n; i += 8) {
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(y + i), vs);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), vw, v));
  }
}

inline void add_scaled(float* y, float w, const float* x, int n) {
  const __m256 vw = _mm256_set1_ps(w);
  for (int i = 0; i < n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), vw, _mm256_loadu_ps(y + i)));
  }
}

}  // namespace

// Writes each new token's key and value into its cache slot.
void write_kv_cache(const torch::Tensor& key,          // [num_tokens, kv_heads, head_dim]
                    const torch::Tensor& value,        // [num_tokens, kv_heads, head_dim]
                    torch::Tensor& key_cache,          // [num_blocks, block_size, kv_heads, head_dim]
                    torch::Tensor& value_cache,        // same
                    const torch::Tensor& slot_mapping  // [num_tokens] int64
) {
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  float* kc = key_cache.data_ptr<float>();
  float* vc = value_cache.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::copy(k + t * row, k + (t + 1) * row, kc + slots[t] * row);
    std::copy(v + t * row, v + (t + 1) * row, vc + slots[t] * row);
  }
}

torch::Tensor paged_attention(const torch::Tensor& query,         // [num_tokens, heads, head_dim]
                              const torch::Tensor& key_cache,     // [num_blocks, block_size, kv_heads, head_dim]
                              const torch::Tensor& value_cache,   // same
                              const torch::Tensor& block_tables,  // [num_reqs, max_blocks] int32
                              const torch::Tensor& token_req,     // [num_tokens] int32: request of each token
                              const torch::Tensor& positions,     // [num_tokens] int64: position of each token
                              double scale, int64_t sliding_window /* <= 0: none */) {
  const int num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(query);  // [num_tokens, heads, head_dim]

  const float* q_ptr = query.data_ptr<float>();
  const float* kc = key_cache.data_ptr<float>();
  const float* vc = value_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* reqs = token_req.data_ptr<int32_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t token_row = int64_t(block_size) * num_kv_heads * head_dim;  // floats per cache block
  const int64_t slot_row = int64_t(num_kv_heads) * head_dim;                // floats per cache slot
  const float fscale = float(scale);

  at::parallel_for(0, int64_t(num_tokens) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    float acc[kMaxGroup][kMaxHeadDim];
    float scores[kMaxGroup][kMaxBlockSize];
    float running_max[kMaxGroup], running_sum[kMaxGroup];
    for (int64_t item = begin; item < end; ++item) {
      const int t = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t last = pos[t];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, last - sliding_window + 1) : 0;
      const int32_t* table = tables + int64_t(reqs[t]) * max_blocks;
      const float* q = q_ptr + (int64_t(t) * num_heads + int64_t(kv_head) * group) * head_dim;
      for (int g = 0; g < group; ++g) {
        running_max[g] = -std::numeric_limits<float>::infinity();
        running_sum[g] = 0.f;
        std::fill(acc[g], acc[g] + head_dim, 0.f);
      }
      for (int64_t block_start = first - first % block_size; block_start <= last; block_start += block_size) {
        const int64_t lo = std::max(block_start, first), hi = std::min<int64_t>(block_start + block_size - 1, last);
        const int64_t base = int64_t(table[block_start / block_size]) * token_row + int64_t(kv_head) * head_dim;
        const int n = int(hi - lo + 1), offset = int(lo - block_start);
        for (int g = 0; g < group; ++g) {
          float block_max = running_max[g];
          for (int j = 0; j < n; ++j) {
            const float s = dot(q + g * head_dim, kc + base + (offset + j) * slot_row, head_dim) * fscale;
            scores[g][j] = s;
            block_max = std::max(block_max, s);
          }
          // Rescale what was accumulated under the old maximum, then add this block's values.
          const float correction = std::exp(running_max[g] - block_max);
          running_max[g] = block_max;
          float sum = running_sum[g] * correction;
          bool first_value = true;
          for (int j = 0; j < n; ++j) {
            const float p = std::exp(scores[g][j] - block_max);
            sum += p;
            const float* v = vc + base + (offset + j) * slot_row;
            if (first_value) {
              scale_add(acc[g], correction, p, v, head_dim);
              first_value = false;
            } else {
              add_scaled(acc[g], p, v, head_dim);
            }
          }
          running_sum[g] = sum;
        }
      }
      float* o = o_ptr + (int64_t(t) * num_heads + int64_t(kv_head) * group) * head_dim;
      for (int g = 0; g < group; ++g) {
        const float inv = 1.f / running_sum[g];
        for (int d = 0; d < head_dim; ++d) o[g * head_dim + d] = acc[g][d] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv_cache", &write_kv_cache, "Write new keys and values into their cache slots");
  m.def("paged_attention", &paged_attention, "Causal attention of each token over its request's paged cache");
}
