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

// The dot products of q with 8 rows at once, as one vector: the horizontal sums of the 8
// accumulators share one reduction tree instead of one reduction each.
inline __m256 dot8(const float* q, const float* const rows[8], int n) {
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 vq = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(vq, _mm256_loadu_ps(rows[r] + i), acc[r]);
  }
  // hadd works within 128-bit lanes: after two rounds each lane holds four rows' partial sums.
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  const __m128 s0123 = _mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1));
  const __m128 s4567 = _mm_add_ps(_mm256_castps256_ps128(h4567), _mm256_extractf128_ps(h4567, 1));
  return _mm256_set_m128(s4567, s0123);
}

// e^x for 8 floats (Cephes' polynomial, relative error ~2e-7); inputs below -88 give ~0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37626f)), _mm256_set1_ps(-88.37626f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
}

// Inputs are checked here, before the kernels index raw pointers: TORCH_CHECK_VALUE surfaces in
// Python as ValueError, and costs far less than the same checks in Python twice per layer per step.
void check_float(const torch::Tensor& t, const char* name, int64_t dim, const char* expected) {
  TORCH_CHECK_VALUE(t.dim() == dim && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                    name, " must be a contiguous float32 CPU tensor ", expected, ", got ", t.scalar_type(), " ",
                    t.sizes());
}

void check_cache(const torch::Tensor& key_cache, const torch::Tensor& value_cache) {
  check_float(key_cache, "key_cache", 4, "[num_blocks, block_size, kv_heads, head_dim]");
  check_float(value_cache, "value_cache", 4, "[num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes(), "key and value caches differ: ", key_cache.sizes(),
                    " vs ", value_cache.sizes());
  TORCH_CHECK_VALUE(key_cache.size(1) <= kMaxBlockSize && key_cache.size(3) <= kMaxHeadDim && key_cache.size(3) % 8 == 0,
                    "block_size must be <= ", kMaxBlockSize, " and head_dim a multiple of 8 up to ", kMaxHeadDim,
                    ", got ", key_cache.size(1), " and ", key_cache.size(3));
}

void check_index(const torch::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim && t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(), name,
                    " must be a contiguous ", dim, "-D ", dtype, " CPU tensor, got ", t.scalar_type(), " ",
                    t.sizes());
}

}  // namespace

// Writes each new token's key and value into its cache slot.
void write_kv_cache(const torch::Tensor& key,          // [num_tokens, kv_heads, head_dim]
                    const torch::Tensor& value,        // [num_tokens, kv_heads, head_dim]
                    torch::Tensor& key_cache,          // [num_blocks, block_size, kv_heads, head_dim]
                    torch::Tensor& value_cache,        // same
                    const torch::Tensor& slot_mapping  // [num_tokens] int64
) {
  check_cache(key_cache, value_cache);
  check_index(slot_mapping, "slot_mapping", at::kLong, 1);
  for (const auto* t : {&key, &value}) {
    check_float(*t, t == &key ? "key" : "value", 3, "[num_tokens, kv_heads, head_dim]");
    TORCH_CHECK_VALUE(t->size(0) == slot_mapping.size(0) && t->size(1) == key_cache.size(2) &&
                          t->size(2) == key_cache.size(3),
                      "key and value must be [", slot_mapping.size(0), ", ", key_cache.size(2), ", ",
                      key_cache.size(3), "], got ", t->sizes());
  }
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
  check_cache(key_cache, value_cache);
  check_float(query, "query", 3, "[num_tokens, heads, head_dim]");
  check_index(block_tables, "block_tables", at::kInt, 2);
  check_index(token_req, "token_req", at::kInt, 1);
  check_index(positions, "positions", at::kLong, 1);
  TORCH_CHECK_VALUE(query.size(2) == key_cache.size(3), "query head_dim ", query.size(2), " != cache head_dim ",
                    key_cache.size(3));
  TORCH_CHECK_VALUE(query.size(1) % key_cache.size(2) == 0 && query.size(1) / key_cache.size(2) <= kMaxGroup,
                    query.size(1), " heads cannot share ", key_cache.size(2), " kv heads (at most ", kMaxGroup,
                    " per kv head)");
  TORCH_CHECK_VALUE(token_req.size(0) == query.size(0) && positions.size(0) == query.size(0),
                    "token_req and positions need one entry per query token");
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
    float scores[kMaxGroup][kMaxBlockSize + 8];
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
        // This block's key and value rows, padded to a multiple of 8 with the last one.
        const float* key_rows[kMaxBlockSize + 8];
        const float* value_rows[kMaxBlockSize + 8];
        for (int j = 0; j < n + 8; ++j) {
          const int64_t row = base + int64_t(offset + std::min(j, n - 1)) * slot_row;
          key_rows[j] = kc + row;
          value_rows[j] = vc + row;
        }
        for (int g = 0; g < group; ++g) {
          float* s = scores[g];
          for (int j = 0; j < n; j += 8) {
            const __m256 v = _mm256_mul_ps(dot8(q + g * head_dim, key_rows + j, head_dim), _mm256_set1_ps(fscale));
            _mm256_storeu_ps(s + j, v);
          }
          float block_max = running_max[g];
          for (int j = 0; j < n; ++j) block_max = std::max(block_max, s[j]);
          // Rescale what was accumulated under the old maximum, then add this block's values.
          const float correction = std::exp(running_max[g] - block_max);
          running_max[g] = block_max;
          float sum = 0.f;
          for (int j = 0; j < n; j += 8) {
            _mm256_storeu_ps(s + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(block_max))));
          }
          for (int j = 0; j < n; ++j) sum += s[j];
          running_sum[g] = running_sum[g] * correction + sum;
          // Each 8-wide slice of the accumulator stays in a register across the block's keys.
          const __m256 vcorrection = _mm256_set1_ps(correction);
          for (int d = 0; d < head_dim; d += 8) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d), vcorrection);
            for (int j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), _mm256_loadu_ps(value_rows[j] + d), a);
            _mm256_storeu_ps(acc[g] + d, a);
          }
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
