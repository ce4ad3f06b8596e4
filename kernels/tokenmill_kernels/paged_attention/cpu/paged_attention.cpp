// Paged attention on CPU: float32 queries over a float32, float16, fp8 (e4m3) or int8 cache,
// AVX2/FMA/F16C (the loops over head_dim on AVX-512 where present: Avx512Ops), parallel over
// (token, kv head), and for a decode step of fewer of those than the threads share evenly over its long
// contexts, over runs of each one's keys too, merged after (key_parts).
//
// Each query token attends to the keys of its own request at positions <= its own position
// (within the sliding window, and on its own branch of a draft tree), read straight from the
// paged cache through the request's
// block table: no gather into a padded copy, no mask tensor. The query heads that share a kv
// head (GQA) are processed together, so each key and value row is loaded once per group.
// Scores may pass through a soft cap, cap * tanh(score / cap), before the softmax (Gemma 2's attention).
// Softmax is computed online (running max and sum) 64 keys (or one larger block) at a time. A float16 cache
// halves the bytes a decode step reads and doubles the tokens a cache holds; rows are widened
// to float32 as they are loaded (F16C), so all arithmetic stays float32.
//
// A quantized cache (fp8 e4m3 or int8: tokenmill.attention.kv_quant) stores each (token, kv head)
// row as head_dim one-byte codes followed by the row's float32 scale: a quarter of float32's bytes
// plus 4. Key rows are widened and scaled once for the group (as float16 ones are widened); value
// rows are widened as they load and their scales folded into the softmax weights, so the inner
// loops are those of the float16 cache.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common/extension.h"
#include "cpu_common/isa.h"
#include "cpu_common/kernel_api.h"
#include "cpu_common/simd_math.h"

namespace {

constexpr int kMaxGroup = 16;      // query heads per kv head
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 256;  // also the most keys taken at a time
// Keys taken at a time where blocks are smaller (see attend_items); a multiple of every smaller block size.
constexpr int kSpanKeys = 64;
// The most parts one item's keys are split into, and the fewest keys a part takes (key_parts): below about 512,
// a part's fixed costs (its setup, its partial sums written and merged) outweigh the threads it evens out.
constexpr int kMaxParts = 16;
constexpr int kMinPartKeys = 512;

// One float8 e4m3 (torch.float8_e4m3fn) code: sign, 4 exponent bits (bias 7), 3 mantissa bits.
struct Fp8 {
  uint8_t bits;
};

// Codes of a quantized cache: each (token, kv head) row is head_dim codes, then its float32 scale.
template <typename T>
constexpr bool kIsQuantized = std::is_same_v<T, Fp8> || std::is_same_v<T, int8_t>;
// What load8 returns for a code, over its value: see load8(const Fp8*).
template <typename T>
constexpr float kCodeScale = std::is_same_v<T, Fp8> ? 256.f : 1.f;
// The code a row's absolute maximum maps to.
template <typename T>
constexpr float kMaxCode = std::is_same_v<T, Fp8> ? 448.f : 127.f;
constexpr int kScaleBytes = 4;

// Eight cache elements as float32, and back: the only places the cache's dtype shows.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// Eight e4m3 codes, each times 2^-8: moved into float16's bit fields (sign to bit 15, exponent and
// mantissa shifted up by 7) they are float16 numbers 2^-8 times their value, subnormals included,
// since e4m3's exponent bias (7) is float16's (15) less 8. F16C widens those; kCodeScale undoes the
// 2^-8 in the row's scale. The NaN codes never occur: writes saturate at 448.
inline __m256 load8(const Fp8* p) {
  const __m128i bytes = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x7F)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(bytes, _mm_set1_epi16(0x80)), 8);
  return _mm256_cvtph_ps(_mm_or_si128(magnitude, sign));
}
// The float32 scale stored after a quantized row's head_dim codes.
template <typename T>
inline float row_scale(const T* row, int head_dim) {
  float scale;
  std::memcpy(&scale, reinterpret_cast<const char*>(row) + head_dim, sizeof(float));
  return scale * kCodeScale<T>;
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Round to nearest even, as torch's float -> float16 conversion does.
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The horizontal sums of 8 accumulators, as one vector: one reduction tree for the 8 rather than one each.
inline __m256 sum8(const __m256 acc[8]) {
  // hadd works within 128-bit lanes: after two rounds each lane holds four rows' partial sums.
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  const __m128 s0123 = _mm_add_ps(_mm256_castps256_ps128(h0123), _mm256_extractf128_ps(h0123, 1));
  const __m128 s4567 = _mm_add_ps(_mm256_castps256_ps128(h4567), _mm256_extractf128_ps(h4567, 1));
  return _mm256_set_m128(s4567, s0123);
}


inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// accumulate_values_n's work for the 8 dimensions from d (head_dim = 8 (mod 16): the last ones).
template <int G, typename T>
inline void accumulate_values_8(float (*acc)[kMaxHeadDim], const float (*weights)[kMaxBlockSize + 8],
                                const float* correction, const T* const* values, int n, int d) {
  __m256 a[G];
  for (int g = 0; g < G; ++g) a[g] = _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d), _mm256_set1_ps(correction[g]));
  for (int j = 0; j < n; ++j) {
    const __m256 v = load8(values[j] + d);
    for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(weights[g] + j), v, a[g]);
  }
  for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc[g] + d, a[g]);
}

// acc[g] = acc[g] * correction[g] + sum_j weights[g][j] * values[j] for G query heads at once:
// each value row slice is loaded once for all G heads, and 2G accumulators (two 8-wide slices
// per head) stay in registers across the block's keys.
template <int G, typename T>
void accumulate_values_n(float (*acc)[kMaxHeadDim], const float (*weights)[kMaxBlockSize + 8],
                         const float* correction, const T* const* values, int n, int head_dim) {
  int d = 0;
  for (; d + 16 <= head_dim; d += 16) {
    __m256 a[G][2];
    for (int g = 0; g < G; ++g) {
      a[g][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d), _mm256_set1_ps(correction[g]));
      a[g][1] = _mm256_mul_ps(_mm256_loadu_ps(acc[g] + d + 8), _mm256_set1_ps(correction[g]));
    }
    for (int j = 0; j < n; ++j) {
      const __m256 v0 = load8(values[j] + d), v1 = load8(values[j] + d + 8);
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_broadcast_ss(weights[g] + j);
        a[g][0] = _mm256_fmadd_ps(w, v0, a[g][0]);
        a[g][1] = _mm256_fmadd_ps(w, v1, a[g][1]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(acc[g] + d, a[g][0]);
      _mm256_storeu_ps(acc[g] + d + 8, a[g][1]);
    }
  }
  if (d < head_dim) accumulate_values_8<G>(acc, weights, correction, values, n, d);  // head_dim = 8 (mod 16)
}

// accumulate_values_n for `num` (1..4) heads, with V's loops (Avx2Ops or Avx512Ops).
template <class V, typename T>
inline void accumulate_values(float (*acc)[kMaxHeadDim], const float (*weights)[kMaxBlockSize + 8],
                              const float* correction, int num, const T* const* values, int n, int head_dim) {
  switch (num) {
    case 1: return V::template accumulate_values_n<1>(acc, weights, correction, values, n, head_dim);
    case 2: return V::template accumulate_values_n<2>(acc, weights, correction, values, n, head_dim);
    case 3: return V::template accumulate_values_n<3>(acc, weights, correction, values, n, head_dim);
    default: return V::template accumulate_values_n<4>(acc, weights, correction, values, n, head_dim);
  }
}

// Inputs are checked here, before the kernels index raw pointers: TORCH_CHECK_VALUE surfaces in
// Python as ValueError, and costs far less than the same checks in Python twice per layer per step.
void check_float(const at::Tensor& t, const char* name, int64_t dim, const char* expected) {
  TORCH_CHECK_VALUE(t.dim() == dim && t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                    name, " must be a contiguous float32 CPU tensor ", expected, ", got ", t.scalar_type(), " ",
                    t.sizes());
}

bool is_quantized(const at::Tensor& cache) {
  return cache.scalar_type() == at::kFloat8_e4m3fn || cache.scalar_type() == at::kChar;
}

// The cache's head_dim: its rows' length, less the scale of a quantized cache's rows.
int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(3) - (is_quantized(cache) ? kScaleBytes : 0);
}

void check_cache(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  for (const auto* t : {&key_cache, &value_cache}) {
    const auto dtype = t->scalar_type();
    TORCH_CHECK_VALUE(t->dim() == 4 &&
                          (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kFloat8_e4m3fn ||
                           dtype == at::kChar) &&
                          t->is_contiguous() && t->device().is_cpu(),
                      t == &key_cache ? "key_cache" : "value_cache",
                      " must be a contiguous float32, float16, float8_e4m3fn or int8 CPU tensor [num_blocks, "
                      "block_size, kv_heads, head_dim (+ 4 scale bytes when quantized)], got ",
                      t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK_VALUE(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type(),
                    "key and value caches differ: ", key_cache.scalar_type(), " ", key_cache.sizes(), " vs ",
                    value_cache.scalar_type(), " ", value_cache.sizes());
  const int64_t head_dim = cache_head_dim(key_cache);
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK_VALUE(block_size > 0 && block_size <= kMaxBlockSize && (block_size & (block_size - 1)) == 0 &&
                        head_dim > 0 && head_dim <= kMaxHeadDim && head_dim % 8 == 0,
                    "block_size must be a power of two up to ", kMaxBlockSize, " and head_dim a multiple of 8 up to ",
                    kMaxHeadDim, ", got ", block_size, " and ", head_dim);
}

void check_index(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim && t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(), name,
                    " must be a contiguous ", dim, "-D ", dtype, " CPU tensor, got ", t.scalar_type(), " ",
                    t.sizes());
}

// Copies (float32 cache) or rounds (float16 cache) each token's row into its slot.
template <typename T>
void write_rows(const float* k, const float* v, T* kc, T* vc, const int64_t* slots, int64_t num_tokens, int64_t row) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < row; i += 8) {
      store8(kc + slots[t] * row + i, _mm256_loadu_ps(k + t * row + i));
      store8(vc + slots[t] * row + i, _mm256_loadu_ps(v + t * row + i));
    }
  }
}

// Eight floats (already divided by the row's scale: |x| <= 448) as float8 e4m3 codes in the low
// byte of each 32-bit lane, rounded to nearest even as torch's conversion rounds: a normal rounds
// its 23-bit mantissa to 3 and rebiases its exponent (127 -> 7); below 2^-6 the subnormal step is
// 2^-9, so x * 512 rounded to an integer is the code.
inline __m256i to_fp8_codes(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(magnitude, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(magnitude, _mm256_set1_epi32(0x7FFFF)), odd);
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3));
  const __m256 a = _mm256_castsi256_ps(magnitude);
  const __m256i subnormal = _mm256_cvtps_epi32(
      _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256 is_subnormal = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
  const __m256i code = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(normal), _mm256_castsi256_ps(subnormal), is_subnormal));
  return _mm256_or_si256(code, sign);
}

// Eight floats (already divided by the row's scale) as int8 codes: rounded to nearest even, as
// torch.round, and clamped to [-127, 127].
inline __m256i to_int8_codes(__m256 x) {
  const __m256 rounded = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f)));
}

// Stores the low byte of each of eight 32-bit lanes holding codes: 0..255 (fp8) or -127..127 (int8).
template <typename T>
inline void store8_codes(T* p, __m256i codes) {
  const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
  __m128i bytes;
  if constexpr (std::is_same_v<T, Fp8>) {
    bytes = _mm_packus_epi16(_mm_packus_epi32(lo, hi), _mm_setzero_si128());
  } else {
    bytes = _mm_packs_epi16(_mm_packs_epi32(lo, hi), _mm_setzero_si128());
  }
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
}

// Quantizes each token's row per kv head into its slot: codes, then the row's float32 scale
// (tokenmill.attention.kv_quant: absmax / kMaxCode, codes rounded to nearest even, int8 clamped).
// Divisions, not multiplications by an inverse, so every code is the one torch computes.
template <typename T>
void write_rows_quantized(const float* k, const float* v, T* kc, T* vc, const int64_t* slots, int64_t num_tokens,
                          int64_t num_kv_heads, int64_t head_dim) {
  const int64_t row = head_dim + kScaleBytes;  // codes per cache row, with the scale's bytes
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int kv = 0; kv < 2; ++kv) {
        const float* src = (kv == 0 ? k : v) + (t * num_kv_heads + h) * head_dim;
        T* dst = (kv == 0 ? kc : vc) + (slots[t] * num_kv_heads + h) * row;
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t i = 0; i < head_dim; i += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(src + i), abs_mask));
        const float scale = hmax(vmax) / kMaxCode<T>;
        const __m256 divisor = _mm256_set1_ps(scale > 0.f ? scale : 1.f);  // an all-zero row stays zero
        for (int64_t i = 0; i < head_dim; i += 8) {
          const __m256 x = _mm256_div_ps(_mm256_loadu_ps(src + i), divisor);
          if constexpr (std::is_same_v<T, Fp8>) {
            store8_codes(dst + i, to_fp8_codes(x));
          } else {
            store8_codes(dst + i, to_int8_codes(x));
          }
        }
        std::memcpy(reinterpret_cast<char*>(dst + head_dim), &scale, sizeof(float));
      }
    }
  }
}

// One step's attention problem, as raw pointers; the cache's element type is T.
template <typename T>
struct Problem {
  const float* query;     // [num_tokens, heads, head_dim]
  const T* key_cache;     // [num_blocks, block_size, kv_heads, head_dim]
  const T* value_cache;   // same
  const int32_t* tables;  // [num_reqs, max_blocks]
  const int32_t* reqs;    // [num_tokens]
  const int64_t* pos;     // [num_tokens]
  // Draft trees, or nullptr: a token with tree_start[t] >= 0 sees the keys at positions >= tree_start[t] only
  // where bit (position - tree_start[t]) of tree_bits[t] is set (its own branch of the tree).
  const int64_t* tree_start;  // [num_tokens]
  const int64_t* tree_bits;   // [num_tokens]
  float* out;                 // [num_tokens, heads, head_dim]
  int num_tokens, num_heads, head_dim, block_size, num_kv_heads;
  int row_len;  // cache elements per (slot, kv head): head_dim, plus the scale's bytes when quantized
  int64_t max_blocks, sliding_window;
  float scale;
  float soft_cap;  // scores pass through soft_cap * tanh(score / soft_cap) (Gemma 2); 0: none
  // Work units: each item (token, kv head) split into `parts` runs of its key spans (see key_parts). With more
  // than one, each unit leaves its heads' unnormalised sums, maximum and sum in `partial`
  // ([units, group, head_dim + 2]) for merge_parts.
  int parts;
  float* partial;
};

template <typename T, class V>
void attend_items(const Problem<T>& p, int64_t begin, int64_t end);

// The loops over head_dim, per instruction set: Avx2Ops on 256-bit vectors (every CPU the kernels run on),
// Avx512Ops on 512-bit ones where the CPU has AVX-512 (16 floats of a row per instruction, and the 32
// registers to score 8 keys for three heads at once). The rest of attend_items (softmax, masks, widening
// keys) is the same code for both. set_isa forces one.
struct Avx2Ops {
  // Scores of 4 keys for H heads at once: each key slice is loaded once for all H (4 x H accumulators; H = 3
  // with the 3 query slices and a key slice fills the 16 registers). One head at a time over 8 keys loaded every
  // key slice once per head: 9 loads per 8 FMAs, which bound the loop.
  template <int H>
  static inline void scores4_heads(const float* q, int head_dim, const float* const rows[4], float scale,
                                   float (*scores)[kMaxBlockSize + 8], int j) {
    __m256 acc[H][4];
    for (int h = 0; h < H; ++h) {
      for (int r = 0; r < 4; ++r) acc[h][r] = _mm256_setzero_ps();
    }
    for (int i = 0; i < head_dim; i += 8) {
      __m256 vq[H];
      for (int h = 0; h < H; ++h) vq[h] = _mm256_loadu_ps(q + h * head_dim + i);
      for (int r = 0; r < 4; ++r) {
        const __m256 k = _mm256_loadu_ps(rows[r] + i);
        for (int h = 0; h < H; ++h) acc[h][r] = _mm256_fmadd_ps(vq[h], k, acc[h][r]);
      }
    }
    for (int h = 0; h < H; ++h) {
      // hadd works within 128-bit lanes: after two rounds each lane holds the four keys' partial sums.
      const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
      const __m128 total = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
      _mm_storeu_ps(scores[h] + j, _mm_mul_ps(total, _mm_set1_ps(scale)));
    }
  }

  // scores[g][j .. j+8] = scale * (q_g . rows[0..8]) for the group's heads g (q_g = q + g * head_dim).
  static inline void scores8(const float* q, int group, int head_dim, const float* const rows[8], float scale,
                             float (*scores)[kMaxBlockSize + 8], int j) {
    for (int half = 0; half < 8; half += 4) {
      int g = 0;
      const float* const* keys = rows + half;
      for (; g + 3 <= group; g += 3) scores4_heads<3>(q + g * head_dim, head_dim, keys, scale, scores + g, j + half);
      if (group - g == 2) scores4_heads<2>(q + g * head_dim, head_dim, keys, scale, scores + g, j + half);
      if (group - g == 1) scores4_heads<1>(q + g * head_dim, head_dim, keys, scale, scores + g, j + half);
    }
  }
  template <int G, typename T>
  static inline void accumulate_values_n(float (*acc)[kMaxHeadDim], const float (*weights)[kMaxBlockSize + 8],
                                         const float* correction, const T* const* values, int n, int head_dim) {
    ::accumulate_values_n<G>(acc, weights, correction, values, n, head_dim);
  }
  template <typename T>
  static void attend_range(const Problem<T>& p, int64_t begin, int64_t end) {
    attend_items<T, Avx2Ops>(p, begin, end);
  }
};

#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq"
struct Avx512Ops {
  // Sixteen cache elements as float32 (see load8).
  __attribute__((target(AVX512_TARGET))) static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
  __attribute__((target(AVX512_TARGET))) static inline __m512 load16(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  __attribute__((target(AVX512_TARGET))) static inline __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  __attribute__((target(AVX512_TARGET))) static inline __m512 load16(const Fp8* p) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(load8(p)), load8(p + 8), 1);
  }

  // Scores of 8 keys for H heads at once: each key slice is loaded once for all H (8 x H accumulators; H = 3
  // fills the 32 registers). One head at a time loaded every key row once per head: 9 loads per 8 FMAs.
  template <int H>
  __attribute__((target(AVX512_TARGET))) static inline void scores8_heads(const float* q, int head_dim,
                                                                          const float* const rows[8], float scale,
                                                                          float (*scores)[kMaxBlockSize + 8],
                                                                          int j) {
    __m512 acc[H][8];
    for (int h = 0; h < H; ++h) {
      for (int r = 0; r < 8; ++r) acc[h][r] = _mm512_setzero_ps();
    }
    for (int i = 0; i < head_dim; i += 16) {
      // head_dim = 8 (mod 16): the last 8, masked
      const __mmask16 mask = i + 16 <= head_dim ? __mmask16(0xFFFF) : __mmask16(0x00FF);
      __m512 vq[H];
      for (int h = 0; h < H; ++h) vq[h] = _mm512_maskz_loadu_ps(mask, q + h * head_dim + i);
      for (int r = 0; r < 8; ++r) {
        const __m512 k = _mm512_maskz_loadu_ps(mask, rows[r] + i);
        for (int h = 0; h < H; ++h) acc[h][r] = _mm512_fmadd_ps(vq[h], k, acc[h][r]);
      }
    }
    for (int h = 0; h < H; ++h) {
      __m256 halves[8];
      for (int r = 0; r < 8; ++r) {
        halves[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[h][r]), _mm512_extractf32x8_ps(acc[h][r], 1));
      }
      _mm256_storeu_ps(scores[h] + j, _mm256_mul_ps(sum8(halves), _mm256_set1_ps(scale)));
    }
  }

  __attribute__((target(AVX512_TARGET))) static inline void scores8(const float* q, int group, int head_dim,
                                                                    const float* const rows[8], float scale,
                                                                    float (*scores)[kMaxBlockSize + 8], int j) {
    int g = 0;
    for (; g + 3 <= group; g += 3) scores8_heads<3>(q + g * head_dim, head_dim, rows, scale, scores + g, j);
    if (group - g == 2) scores8_heads<2>(q + g * head_dim, head_dim, rows, scale, scores + g, j);
    if (group - g == 1) scores8_heads<1>(q + g * head_dim, head_dim, rows, scale, scores + g, j);
  }

  // As accumulate_values_n, 16 dimensions per register and S registers (up to 64 dimensions) per pass over the
  // keys: G x S accumulators. One register per pass left each accumulator a chain of n dependent FMAs, G chains
  // in all, and the FMA's latency, not its throughput, set the pace.
  template <int G, int S, typename T>
  __attribute__((target(AVX512_TARGET))) static inline void accumulate_pass(
      float (*acc)[kMaxHeadDim], const float (*weights)[kMaxBlockSize + 8], const float* correction,
      const T* const* values, int n, int d) {
    __m512 a[G][S];
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < S; ++i) {
        a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[g] + d + 16 * i), _mm512_set1_ps(correction[g]));
      }
    }
    for (int j = 0; j < n; ++j) {
      __m512 v[S];
      for (int i = 0; i < S; ++i) v[i] = load16(values[j] + d + 16 * i);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(weights[g][j]);
        for (int i = 0; i < S; ++i) a[g][i] = _mm512_fmadd_ps(w, v[i], a[g][i]);
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < S; ++i) _mm512_storeu_ps(acc[g] + d + 16 * i, a[g][i]);
    }
  }

  template <int G, typename T>
  __attribute__((target(AVX512_TARGET))) static inline void accumulate_values_n(
      float (*acc)[kMaxHeadDim], const float (*weights)[kMaxBlockSize + 8], const float* correction,
      const T* const* values, int n, int head_dim) {
    int d = 0;
    for (; d + 64 <= head_dim; d += 64) accumulate_pass<G, 4>(acc, weights, correction, values, n, d);
    if (d + 32 <= head_dim) {
      accumulate_pass<G, 2>(acc, weights, correction, values, n, d);
      d += 32;
    }
    if (d + 16 <= head_dim) {
      accumulate_pass<G, 1>(acc, weights, correction, values, n, d);
      d += 16;
    }
    if (d < head_dim) accumulate_values_8<G>(acc, weights, correction, values, n, d);  // head_dim = 8 (mod 16)
  }

  // `flatten` inlines attend_items and all it calls into this function, built for AVX-512.
  template <typename T>
  __attribute__((noinline, flatten, target(AVX512_TARGET))) static void attend_range(const Problem<T>& p,
                                                                                    int64_t begin, int64_t end) {
    attend_items<T, Avx512Ops>(p, begin, end);
  }
};

// Work units [begin, end) of one step's attention: unit = item * parts + part, item = token * num_kv_heads + kv
// head, each part a run of the item's key spans.
template <typename T, class V>
void attend_items(const Problem<T>& p, int64_t begin, int64_t end) {
  const int group = p.num_heads / p.num_kv_heads, head_dim = p.head_dim, block_size = p.block_size;
  const int row_len = p.row_len;
  const int64_t token_row = int64_t(block_size) * p.num_kv_heads * row_len;  // elements per cache block
  const int64_t slot_row = int64_t(p.num_kv_heads) * row_len;                // elements per cache slot
  float acc[kMaxGroup][kMaxHeadDim];
  float scores[kMaxGroup][kMaxBlockSize + 8];
  float running_max[kMaxGroup], running_sum[kMaxGroup];
  float value_scales[kMaxBlockSize + 8];  // a quantized cache's value row scales, for the span
  // Keys are taken a span of cache blocks at a time: the work per span (its rows' pointers, each head's
  // maximum, correction and sum, the prefetch) is then paid once per 64 keys instead of once per block of 16.
  const int64_t span = std::max<int64_t>(block_size, kSpanKeys);
  const int block_shift = __builtin_ctz(unsigned(block_size));
  std::vector<float> widened_keys(std::is_same_v<T, float> ? 0 : span * head_dim);  // [span, head_dim]
  // Where the key and value rows of position `pos` under `kv_head` start in the caches, for the request whose block
  // table is `table`. Block sizes are powers of two: shift and mask, not divide.
  const auto row_of = [&](const int32_t* table, int kv_head, int64_t pos) {
    return int64_t(table[pos >> block_shift]) * token_row + int64_t(kv_head) * row_len +
           (pos & (block_size - 1)) * slot_row;
  };
  // The first key a token at position `last` sees.
  const auto first_key = [&](int64_t last) {
    return p.sliding_window > 0 ? std::max<int64_t>(0, last - p.sliding_window + 1) : 0;
  };
  // The start of the first span of unit `u`'s keys and the end of its last (exclusive): spans start at the first
  // key's block and are `span` keys long; part k of n takes spans [S k / n, S (k + 1) / n) of the item's S.
  const auto span_range = [&](int64_t u) {
    const int64_t last = p.pos[u / p.parts / p.num_kv_heads];
    const int64_t start = first_key(last) - first_key(last) % block_size;
    const int64_t spans = (last - start) / span + 1, part = u % p.parts;
    return std::pair<int64_t, int64_t>{start + spans * part / p.parts * span,
                                       std::min(last + 1, start + spans * (part + 1) / p.parts * span)};
  };
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t item = unit / p.parts;
    const int t = item / p.num_kv_heads, kv_head = item % p.num_kv_heads;
    const int64_t last = p.pos[t];
    const int64_t first = first_key(last);
    const auto [spans_begin, spans_end] = span_range(unit);
    const int64_t tree_start = p.tree_start != nullptr ? p.tree_start[t] : -1;
    const uint64_t tree_bits = p.tree_bits != nullptr ? uint64_t(p.tree_bits[t]) : 0;
    const int32_t* table = p.tables + int64_t(p.reqs[t]) * p.max_blocks;
    const float* q = p.query + (int64_t(t) * p.num_heads + int64_t(kv_head) * group) * head_dim;
    for (int g = 0; g < group; ++g) {
      running_max[g] = -std::numeric_limits<float>::infinity();
      running_sum[g] = 0.f;
      std::fill(acc[g], acc[g] + head_dim, 0.f);
    }
    for (int64_t span_start = spans_begin; span_start < spans_end; span_start += span) {
      const int64_t lo = std::max(span_start, first), hi = std::min<int64_t>(span_start + span - 1, last);
      const int n = int(hi - lo + 1);
      // This span's key and value rows, padded to a multiple of 8 with the last one. Every
      // query head of the group reads each key row: a float16 or quantized key row is widened
      // (and scaled) into `widened_keys` once for all of them. Value rows are read once, widened
      // as they load; a quantized one's scale goes into `value_scales`.
      const float* key_rows[kMaxBlockSize + 8];
      const T* value_rows[kMaxBlockSize + 8];
      for (int j = 0; j < n + 8; ++j) {
        const int i = std::min(j, n - 1);
        const int64_t row = row_of(table, kv_head, lo + i);
        value_rows[j] = p.value_cache + row;
        if constexpr (kIsQuantized<T>) value_scales[j] = row_scale(p.value_cache + row, head_dim);
        if constexpr (std::is_same_v<T, float>) {
          key_rows[j] = p.key_cache + row;
        } else {
          float* k = widened_keys.data() + int64_t(i) * head_dim;
          if (j < n) {
            if constexpr (kIsQuantized<T>) {
              const __m256 key_scale = _mm256_set1_ps(row_scale(p.key_cache + row, head_dim));
              for (int d = 0; d < head_dim; d += 8) {
                _mm256_storeu_ps(k + d, _mm256_mul_ps(load8(p.key_cache + row + d), key_scale));
              }
            } else {
              for (int d = 0; d < head_dim; d += 8) _mm256_storeu_ps(k + d, load8(p.key_cache + row + d));
            }
          }
          key_rows[j] = k;
        }
      }
      // Ask for the next span's rows now: this unit's, or after its last span the next unit's first. They are
      // short strided runs in blocks the hardware prefetcher cannot guess (they come from the block table), and a
      // step's caches are far larger than L3. One span ahead is enough.
      const bool more = span_start + span < spans_end;
      if (more || unit + 1 < end) {
        const int64_t next_unit = more ? unit : unit + 1;
        const int64_t next_item = next_unit / p.parts;
        const int64_t next_t = next_item / p.num_kv_heads;
        const int next_kv_head = int(next_item % p.num_kv_heads);
        const int32_t* next_table = p.tables + int64_t(p.reqs[next_t]) * p.max_blocks;
        const auto [next_begin, next_end] = more ? std::pair<int64_t, int64_t>{span_start + span, spans_end}
                                                 : span_range(next_unit);
        const int64_t next_start = std::max(next_begin, first_key(p.pos[next_t]));
        const int next_n = int(std::min<int64_t>(next_begin + span, next_end) - next_start);
        for (int j = 0; j < next_n; ++j) {
          const int64_t next = row_of(next_table, next_kv_head, next_start + j);
          const char* k_row = reinterpret_cast<const char*>(p.key_cache + next);
          const char* v_row = reinterpret_cast<const char*>(p.value_cache + next);
          for (int64_t byte = 0; byte < int64_t(row_len * sizeof(T)); byte += 64) {
            _mm_prefetch(k_row + byte, _MM_HINT_T0);
            _mm_prefetch(v_row + byte, _MM_HINT_T0);
          }
          // A thread takes the kv heads of a token one after another: with a float16 cache, its
          // first head also pulls the later heads' rows (the rest of each slot, one contiguous
          // run) into L2. Not over a float32 cache: twice the bytes, and the prefetch costs more
          // than it saves (a quantized cache, half float16's bytes, does it too).
          if constexpr (sizeof(T) <= 2) {
            if (next_kv_head == 0 || next_unit == begin) {
              const char* k_slot = k_row - next_kv_head * row_len * sizeof(T);
              const char* v_slot = v_row - next_kv_head * row_len * sizeof(T);
              for (int64_t byte = (next_kv_head + 1) * row_len * sizeof(T); byte < slot_row * int64_t(sizeof(T));
                   byte += 64) {
                _mm_prefetch(k_slot + byte, _MM_HINT_T1);
                _mm_prefetch(v_slot + byte, _MM_HINT_T1);
              }
            }
          }
        }
      }
      float correction[kMaxGroup];
      for (int j = 0; j < n; j += 8) V::scores8(q, group, head_dim, key_rows + j, p.scale, scores, j);
      if (p.soft_cap > 0.f) {
        const __m256 cap = _mm256_set1_ps(p.soft_cap), inverse = _mm256_set1_ps(1.f / p.soft_cap);
        for (int g = 0; g < group; ++g) {
          for (int j = 0; j < n; j += 8) {
            const __m256 capped = tokenmill::tanh8(_mm256_mul_ps(_mm256_loadu_ps(scores[g] + j), inverse));
            _mm256_storeu_ps(scores[g] + j, _mm256_mul_ps(capped, cap));
          }
        }
      }
      for (int g = 0; g < group; ++g) {
        float* s = scores[g];
        if (tree_start >= 0 && hi >= tree_start) {
          // Another branch's keys weigh nothing. The token's own key (the last) is always seen, so the
          // running maximum stays finite; a masked key's padding copies past n only raise the maximum.
          for (int j = std::max<int>(0, int(tree_start - lo)); j < n; ++j) {
            if (!((tree_bits >> (lo + j - tree_start)) & 1)) s[j] = -std::numeric_limits<float>::infinity();
          }
        }
        // Scores past n repeat the last key's, so they cannot change the maximum.
        __m256 vmax = _mm256_set1_ps(running_max[g]);
        for (int j = 0; j < n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
        const float block_max = hmax(vmax);
        // What was accumulated under the old maximum is rescaled by this (in accumulate_values).
        correction[g] = std::exp(running_max[g] - block_max);
        running_max[g] = block_max;
        const __m256 vblock_max = _mm256_set1_ps(block_max);
        __m256 vsum = _mm256_setzero_ps();
        int j = 0;
        for (; j + 8 <= n; j += 8) {
          const __m256 e = tokenmill::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vblock_max));
          _mm256_storeu_ps(s + j, e);
          vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum(vsum);
        if (j < n) {  // a last partial run of 8, whose padding must stay out of the sum
          _mm256_storeu_ps(s + j, tokenmill::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vblock_max)));
          for (; j < n; ++j) sum += s[j];
        }
        running_sum[g] = running_sum[g] * correction[g] + sum;
        if constexpr (kIsQuantized<T>) {
          // Each value row's scale goes into its weight: sum_j w_j (s_j code_j) = sum_j (w_j s_j) code_j.
          for (int jj = 0; jj < n; jj += 8) {
            _mm256_storeu_ps(s + jj, _mm256_mul_ps(_mm256_loadu_ps(s + jj), _mm256_loadu_ps(value_scales + jj)));
          }
        }
      }
      for (int g = 0; g < group; g += 4) {
        accumulate_values<V>(acc + g, scores + g, correction + g, std::min(4, group - g), value_rows, n, head_dim);
      }
    }
    if (p.parts > 1) {
      float* partial = p.partial + unit * group * (head_dim + 2);
      for (int g = 0; g < group; ++g, partial += head_dim + 2) {
        std::copy(acc[g], acc[g] + head_dim, partial);
        partial[head_dim] = running_max[g];
        partial[head_dim + 1] = running_sum[g];
      }
      continue;
    }
    float* o = p.out + (int64_t(t) * p.num_heads + int64_t(kv_head) * group) * head_dim;
    for (int g = 0; g < group; ++g) {
      const float inv = 1.f / running_sum[g];
      for (int d = 0; d < head_dim; ++d) o[g * head_dim + d] = acc[g][d] * inv;
    }
  }
}

// Into each item's output, its parts' sums rescaled to their common maximum (as flash decoding merges them).
template <typename T>
void merge_parts(const Problem<T>& p) {
  const int group = p.num_heads / p.num_kv_heads, head_dim = p.head_dim, stride = group * (head_dim + 2);
  const int64_t items = int64_t(p.num_tokens) * p.num_kv_heads;
  for (int64_t item = 0; item < items; ++item) {
    const float* parts = p.partial + item * p.parts * stride;
    float* o = p.out + item * group * head_dim;  // (token, kv head)'s heads: item * group is their first
    for (int g = 0; g < group; ++g, o += head_dim) {
      const int at = g * (head_dim + 2);
      float max = -std::numeric_limits<float>::infinity();
      for (int k = 0; k < p.parts; ++k) max = std::max(max, parts[k * stride + at + head_dim]);
      float sum = 0.f;
      std::fill(o, o + head_dim, 0.f);
      for (int k = 0; k < p.parts; ++k) {
        const float* part = parts + k * stride + at;
        const float weight = std::exp(part[head_dim] - max);
        sum += part[head_dim + 1] * weight;
        for (int d = 0; d < head_dim; ++d) o[d] += part[d] * weight;
      }
      const float inv = 1.f / sum;
      for (int d = 0; d < head_dim; ++d) o[d] *= inv;
    }
  }
}

// How many parts to split each item's keys into. A step of few items (decode at batch 1: one per kv head) leaves
// threads idle or unevenly loaded, since a thread takes whole items: 3 kv heads on 2 threads run as 2 and 1. The
// parts are runs of whole spans, at least one span each; the smallest number that loads the threads most evenly,
// counted as at::parallel_for hands out contiguous ranges. Draft trees stay whole: a part could hold only masked
// keys.
template <typename T>
int key_parts(const Problem<T>& p, int threads) {
  const int64_t items = int64_t(p.num_tokens) * p.num_kv_heads;
  if (threads < 2 || p.tree_start != nullptr || items >= 4 * threads) return 1;
  const int64_t span = std::max<int64_t>(p.block_size, kSpanKeys);
  int64_t spans = std::numeric_limits<int64_t>::max();  // the fewest any token has
  for (int t = 0; t < p.num_tokens; ++t) {
    const int64_t last = p.pos[t];
    const int64_t first = p.sliding_window > 0 ? std::max<int64_t>(0, last - p.sliding_window + 1) : 0;
    spans = std::min(spans, (last - (first - first % p.block_size)) / span + 1);
  }
  int best = 1;
  double best_load = 0.;
  const int64_t most = std::min<int64_t>(spans / std::max<int64_t>(1, kMinPartKeys / span), kMaxParts);
  for (int parts = 1; parts <= most; ++parts) {
    const int64_t units = items * parts, per_thread = (units + threads - 1) / threads;
    const double load = double(units) / double(per_thread * threads);
    if (load > best_load + 1e-9) best = parts, best_load = load;
  }
  return best;
}

enum class Isa { kAvx2, kAvx512 };

// What paged_attention runs; set_isa changes it. The variants this CPU supports, best last (AVX2 + FMA + F16C are
// checked before the build).
tokenmill::IsaChoice<Isa> g_isa({"avx2", "avx512"}, [] {
  std::vector<Isa> isas{Isa::kAvx2};
  if (tokenmill::kBuildAvx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    isas.push_back(Isa::kAvx512);
  }
  return isas;
});

template <typename T>
void attend(Problem<T> p) {
  const Isa isa = g_isa.get();
  p.parts = key_parts(p, at::get_num_threads());
  const int64_t units = int64_t(p.num_tokens) * p.num_kv_heads * p.parts;
  std::vector<float> partial(p.parts > 1 ? units * (p.num_heads / p.num_kv_heads) * (p.head_dim + 2) : 0);
  p.partial = partial.data();
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    if constexpr (tokenmill::kBuildAvx512) {
      if (isa == Isa::kAvx512) return Avx512Ops::attend_range(p, begin, end);
    }
    Avx2Ops::attend_range(p, begin, end);
  });
  if (p.parts > 1) merge_parts(p);
}

}  // namespace

// Writes each new token's key and value into its cache slot (rounded to float16 for a float16 cache,
// quantized with a scale per row for an fp8 or int8 one).
void write_kv_cache(const at::Tensor& key,          // [num_tokens, kv_heads, head_dim]
                    const at::Tensor& value,        // [num_tokens, kv_heads, head_dim]
                    at::Tensor& key_cache,          // [num_blocks, block_size, kv_heads, head_dim]
                    at::Tensor& value_cache,        // same
                    const at::Tensor& slot_mapping  // [num_tokens] int64
) {
  check_cache(key_cache, value_cache);
  check_index(slot_mapping, "slot_mapping", at::kLong, 1);
  for (const auto* t : {&key, &value}) {
    check_float(*t, t == &key ? "key" : "value", 3, "[num_tokens, kv_heads, head_dim]");
    TORCH_CHECK_VALUE(t->size(0) == slot_mapping.size(0) && t->size(1) == key_cache.size(2) &&
                          t->size(2) == cache_head_dim(key_cache),
                      "key and value must be [", slot_mapping.size(0), ", ", key_cache.size(2), ", ",
                      cache_head_dim(key_cache), "], got ", t->sizes());
  }
  const int64_t num_tokens = key.size(0);
  const int64_t row = key.size(1) * key.size(2);  // a multiple of 8: head_dim is
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  if (key_cache.scalar_type() == at::kFloat8_e4m3fn) {
    write_rows_quantized(key.data_ptr<float>(), value.data_ptr<float>(), static_cast<Fp8*>(key_cache.data_ptr()),
                         static_cast<Fp8*>(value_cache.data_ptr()), slots, num_tokens, key.size(1), key.size(2));
  } else if (key_cache.scalar_type() == at::kChar) {
    write_rows_quantized(key.data_ptr<float>(), value.data_ptr<float>(), key_cache.data_ptr<int8_t>(),
                         value_cache.data_ptr<int8_t>(), slots, num_tokens, key.size(1), key.size(2));
  } else if (key_cache.scalar_type() == at::kHalf) {
    write_rows(key.data_ptr<float>(), value.data_ptr<float>(), key_cache.data_ptr<at::Half>(),
               value_cache.data_ptr<at::Half>(), slots, num_tokens, row);
  } else {
    write_rows(key.data_ptr<float>(), value.data_ptr<float>(), key_cache.data_ptr<float>(),
               value_cache.data_ptr<float>(), slots, num_tokens, row);
  }
}

at::Tensor paged_attention(const at::Tensor& query,         // [num_tokens, heads, head_dim]
                              const at::Tensor& key_cache,     // [num_blocks, block_size, kv_heads, head_dim]
                              const at::Tensor& value_cache,   // same
                              const at::Tensor& block_tables,  // [num_reqs, max_blocks] int32
                              const at::Tensor& token_req,     // [num_tokens] int32: request of each token
                              const at::Tensor& positions,     // [num_tokens] int64: position of each token
                              double scale, int64_t sliding_window /* <= 0: none */,
                              const c10::optional<at::Tensor>& tree_start,  // [num_tokens] int64, -1: no tree
                              const c10::optional<at::Tensor>& tree_bits,   // [num_tokens] int64 bit masks
                              double logits_soft_cap /* <= 0: none */
) {
  check_cache(key_cache, value_cache);
  check_float(query, "query", 3, "[num_tokens, heads, head_dim]");
  check_index(block_tables, "block_tables", at::kInt, 2);
  check_index(token_req, "token_req", at::kInt, 1);
  check_index(positions, "positions", at::kLong, 1);
  TORCH_CHECK_VALUE(query.size(2) == cache_head_dim(key_cache), "query head_dim ", query.size(2),
                    " != cache head_dim ", cache_head_dim(key_cache));
  TORCH_CHECK_VALUE(query.size(1) % key_cache.size(2) == 0 && query.size(1) / key_cache.size(2) <= kMaxGroup,
                    query.size(1), " heads cannot share ", key_cache.size(2), " kv heads (at most ", kMaxGroup,
                    " per kv head)");
  TORCH_CHECK_VALUE(token_req.size(0) == query.size(0) && positions.size(0) == query.size(0),
                    "token_req and positions need one entry per query token");
  TORCH_CHECK_VALUE(tree_start.has_value() == tree_bits.has_value(), "give both tree_start and tree_bits, or neither");
  if (tree_start.has_value()) {
    check_index(*tree_start, "tree_start", at::kLong, 1);
    check_index(*tree_bits, "tree_bits", at::kLong, 1);
    TORCH_CHECK_VALUE(tree_start->size(0) == query.size(0) && tree_bits->size(0) == query.size(0),
                      "tree_start and tree_bits need one entry per query token");
  }
  auto out = at::empty_like(query);  // [num_tokens, heads, head_dim]
  auto problem = [&](auto* element) {
    using T = std::remove_pointer_t<decltype(element)>;
    return Problem<T>{query.data_ptr<float>(),
                      static_cast<const T*>(key_cache.data_ptr()),
                      static_cast<const T*>(value_cache.data_ptr()),
                      block_tables.data_ptr<int32_t>(),
                      token_req.data_ptr<int32_t>(),
                      positions.data_ptr<int64_t>(),
                      tree_start.has_value() ? tree_start->data_ptr<int64_t>() : nullptr,
                      tree_bits.has_value() ? tree_bits->data_ptr<int64_t>() : nullptr,
                      out.data_ptr<float>(),
                      int(query.size(0)),
                      int(query.size(1)),
                      int(query.size(2)),
                      int(key_cache.size(1)),
                      int(key_cache.size(2)),
                      int(key_cache.size(3)),
                      block_tables.size(1),
                      sliding_window,
                      float(scale),
                      float(std::max(logits_soft_cap, 0.0)),
                      1,
                      nullptr};
  };
  if (key_cache.scalar_type() == at::kFloat8_e4m3fn) {
    attend(problem(static_cast<Fp8*>(nullptr)));
  } else if (key_cache.scalar_type() == at::kChar) {
    attend(problem(static_cast<int8_t*>(nullptr)));
  } else if (key_cache.scalar_type() == at::kHalf) {
    attend(problem(static_cast<at::Half*>(nullptr)));
  } else {
    attend(problem(static_cast<float*>(nullptr)));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv_cache", &write_kv_cache, "Write new keys and values into their cache slots");
  m.def("paged_attention", &paged_attention, "Causal attention of each token over its request's paged cache",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"), py::arg("token_req"),
        py::arg("positions"), py::arg("scale"), py::arg("sliding_window"), py::arg("tree_start") = py::none(),
        py::arg("tree_bits") = py::none(), py::arg("logits_soft_cap") = 0.0);
  g_isa.def(m, "the variant paged_attention uses now");
  static const tokenmill::PagedAttentionApi api{&write_kv_cache, &paged_attention};
  tokenmill::def_api(m, &api);
}
