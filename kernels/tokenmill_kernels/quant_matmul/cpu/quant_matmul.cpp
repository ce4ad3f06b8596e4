// Weight-only quantized matmul for x86-64 CPUs with AVX2 + FMA + F16C, and AVX-VNNI or AVX-512 where present.
//
//   y[m, n] = sum_k x[m, k] * W[n, k] + bias[n]
//
// W is stored per 32-element group along k, either as int8 (Q8_0: w = d * q) or as packed 4-bit codes
// (Q4_1: w = d * q + m). Decoding one token is bound by how fast the weights stream from memory, so the kernels
// read 5 (int4) or 8.5 (int8) bits per weight, float16 scales and mins included, instead of 32. Each activation
// row is quantized to int16 per 32-block so that the block dot products are integer dot products (int16 x int16
// pairs, vpmaddwd), scaled once per block. int16 rather than int8 (llama.cpp's Q8_1): int8 activations flip
// near-tied greedy choices (see docs/performance.md, "Accuracy of the quantized path"). reference.py defines the
// formats and the numerics exactly; these kernels differ from it only in the order of the float32 sums.
//
// The file builds with -mavx2 -mfma -mf16c. The tiles come in one variant per instruction set (struct Avx2,
// AvxVnni, Avx512 below), picked at run time from the CPU's features; the others are compiled with
// __attribute__((target)) so they are only ever executed on CPUs that have them. avx2 and avx_vnni hold a group
// as two 256-bit halves (int8 under kPairMinRows activation rows) or take two groups in four registers (int4 under
// kPairMinRows rows: the nibble tiles; from kPairMinRows rows on: the pair tiles), and run the same float32
// operations in the same order, so they give bit-identical outputs; avx512 holds a group in one 512-bit register,
// or (int4 under kPairMinRows rows) takes four groups in four, and sums 16 float lanes instead of 8 (outputs within
// float32 rounding of the others); avx512_vnni16 runs those four-group tiles with vpdpwssd and, at several rows,
// tiles with 16 weight rows to a register (the column tiles, run_columns); amx runs AMX tile products at many rows
// (run_amx, below).
// set_isa forces one (for tests and benchmarks).

#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common/extension.h"
#include "cpu_common/isa.h"
#include "cpu_common/kernel_api.h"
#include "cpu_common/prefetch.h"
#include "cpu_common/simd_math.h"

namespace {

// The tiles index small arrays of registers with compile-time bounds; unrolled, they stay in registers.
#define UNROLL _Pragma("GCC unroll 8")

constexpr int64_t kGroup = 32;
// The largest value of an activation code: codes lie in [-kActMax, kActMax].
constexpr float kActMax = 32767.0f;
// Activation rows that share each weight load. The weight rows that share each activation load are the
// variant's kWeightTile: 2 x 4 accumulators plus operands fit the 16 ymm registers of AVX2, 4 x 4 the 32 of
// AVX-512.
constexpr int64_t kActTile = 4;
// Software prefetch distance along a task's weight rows. The hardware prefetcher alone leaves the single-row
// (decode) case waiting on memory latency at well under the machine's bandwidth.
constexpr int64_t kPrefetchBytes = 8192;
// Below this many weight bytes a task is not worth handing to another thread (fork/join costs a few us).
constexpr int64_t kMinBytesPerTask = 32 * 1024;
// Groups whose scale products a tile computes ahead of their dot products (4 KB of stack for a 4 x 4 tile).
constexpr int64_t kScaleChunk = 64;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Activations quantized per 32-block: q int16 [M, K], d = absmax / 32767 and s = d * sum(q), both [M, K / 32].
// For the 512-bit nibble tiles also the same codes four groups at a time, in the order those tiles multiply them
// (interleave_nibbles): qi int16 [M, ceil(K / 128), 128], 64-byte aligned so that no load splits a cache line.
// For the avx2 / avx_vnni tiles also the codes two groups at a time in the order those tiles multiply them:
// qp int16 [M, ceil(K / 64), 64], 32-byte aligned, as the pair tiles (several rows, interleave_pair) or the nibble
// tiles (int4 weights at fewer rows, interleave_nibbles) read them.
struct QuantizedActivations {
  std::unique_ptr<int16_t[]> q;
  std::unique_ptr<float[]> d;
  std::unique_ptr<float[]> s;
  std::unique_ptr<int16_t[], void (*)(int16_t*)> qi{nullptr, [](int16_t* ptr) { std::free(ptr); }};
  std::unique_ptr<int16_t[], void (*)(int16_t*)> qp{nullptr, [](int16_t* ptr) { std::free(ptr); }};
};

// Which extra copy of the codes a variant's tiles read besides q: none (the column tiles read q), four groups at a
// time for the 512-bit nibble tiles, or two for the pair tiles or the 256-bit nibble tiles.
enum class Layout { kPlain, kNibbleQuads, kPairs, kNibblePairs };

void quantize_block(const float* x, int16_t* q, float* d_out, float* s_out) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
  }
  // Same float32 operations as reference.quantize_activations, so the codes match it exactly; |x| / d rounds
  // to at most 32767, and the saturating pack below is the reference's clamp.
  const float d = hmax(amax) / kActMax;
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // |sum| <= 32 * 32767 < 2**24: exact in int32 and in float32.
  const int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
  // The saturating pack works within 128-bit lanes and leaves the 8-byte runs in the order 0 2 1 3.
  for (int i = 0; i < 2; ++i) {
    const __m256i packed = _mm256_packs_epi32(c[2 * i], c[2 * i + 1]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
}

// Two groups of codes as the pair tiles read them (see kPairCodes): `b` is the second group's codes, or nullptr
// for a row's last group when K / 32 is odd (its lanes are zero).
inline void interleave_pair(const int16_t* a, const int16_t* b, int16_t* out) {
  const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16));
  const __m256i b0 = b != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)) : _mm256_setzero_si256();
  const __m256i b1 =
      b != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
  const __m256i lo0 = _mm256_unpacklo_epi32(a0, b0);
  const __m256i lo1 = _mm256_unpacklo_epi32(a1, b1);
  const __m256i hi0 = _mm256_unpackhi_epi32(a0, b0);
  const __m256i hi1 = _mm256_unpackhi_epi32(a1, b1);
  __m256i* dst = reinterpret_cast<__m256i*>(out);
  _mm256_store_si256(dst + 0, _mm256_permute2x128_si256(lo0, lo1, 0x20));
  _mm256_store_si256(dst + 1, _mm256_permute2x128_si256(hi0, hi1, 0x20));
  _mm256_store_si256(dst + 2, _mm256_permute2x128_si256(lo0, lo1, 0x31));
  _mm256_store_si256(dst + 3, _mm256_permute2x128_si256(hi0, hi1, 0x31));
}

// Up to `lanes` groups of codes (2: a pair, for the 256-bit nibble tiles; 4: a block, for the 512-bit ones) in the
// order their packed int4 weights unpack in (see nibble_tile_body): register j, of lanes x 8 codes, holds in its
// 128-bit lane l elements 2k (j = 0), 2k + 16 (j = 1), 2k + 1 (j = 2) and 2k + 17 (j = 3), k = 0..7, of group l. The
// lanes of missing groups (past a row's last) are zero.
inline void interleave_nibbles(const int16_t* q, int64_t num_groups, int64_t lanes, int16_t* out) {
  // Within each 128-bit lane the even 16-bit words, then the odd ones; vpermq then joins the lanes' evens.
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,  //
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  const auto evens_odds = [&](const int16_t* codes) {  // 16 codes -> their 8 even-indexed | their 8 odd-indexed
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
    return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xD8);
  };
  const auto store = [](int16_t* dst, __m128i v) { _mm_store_si128(reinterpret_cast<__m128i*>(dst), v); };
  const int64_t stride = 8 * lanes;  // codes per register
  for (int64_t l = 0; l < lanes; ++l) {
    int16_t* lane = out + 8 * l;
    if (l >= num_groups) {
      for (int j = 0; j < 4; ++j) store(lane + j * stride, _mm_setzero_si128());
      continue;
    }
    const __m256i lo = evens_odds(q + l * kGroup), hi = evens_odds(q + l * kGroup + 16);
    store(lane, _mm256_castsi256_si128(lo));
    store(lane + stride, _mm256_castsi256_si128(hi));
    store(lane + 2 * stride, _mm256_extracti128_si256(lo, 1));
    store(lane + 3 * stride, _mm256_extracti128_si256(hi, 1));
  }
}

QuantizedActivations quantize_activations(const float* x, int64_t M, int64_t K, Layout layout = Layout::kPlain) {
  const int64_t groups = K / kGroup;
  const int64_t blocks = layout == Layout::kNibbleQuads ? (groups + 3) / 4 : 0;
  const int64_t pairs = layout == Layout::kPairs || layout == Layout::kNibblePairs ? (groups + 1) / 2 : 0;
  // Plain new[]: every element is written below, so the zero-fill of make_unique would be a wasted pass.
  QuantizedActivations a{std::unique_ptr<int16_t[]>(new int16_t[M * K]),
                         std::unique_ptr<float[]>(new float[M * groups]),
                         std::unique_ptr<float[]>(new float[M * groups])};
  if (blocks > 0) {
    a.qi.reset(static_cast<int16_t*>(std::aligned_alloc(64, M * blocks * 4 * kGroup * sizeof(int16_t))));
    TORCH_CHECK(a.qi != nullptr, "out of memory for ", M, " x ", K, " activation codes");
  }
  if (pairs > 0) {
    a.qp.reset(static_cast<int16_t*>(std::aligned_alloc(64, M * pairs * 2 * kGroup * sizeof(int16_t))));
    TORCH_CHECK(a.qp != nullptr, "out of memory for ", M, " x ", K, " activation codes");
  }
  const int64_t grain = std::max<int64_t>(1, 16384 / K);  // rows per task: cheap work, only split big batches
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * groups; i < end * groups; ++i) {
      quantize_block(x + i * kGroup, a.q.get() + i * kGroup, a.d.get() + i, a.s.get() + i);
    }
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int16_t* first = a.q.get() + m * K + b * 4 * kGroup;
        const int64_t num_groups = std::min<int64_t>(4, groups - 4 * b);
        int16_t* out = a.qi.get() + (m * blocks + b) * 4 * kGroup;
        interleave_nibbles(first, num_groups, 4, out);
      }
      for (int64_t t = 0; t < pairs; ++t) {
        const int16_t* first = a.q.get() + m * K + 2 * t * kGroup;
        int16_t* out = a.qp.get() + (m * pairs + t) * 2 * kGroup;
        if (layout == Layout::kPairs) {
          interleave_pair(first, 2 * t + 1 < groups ? first + kGroup : nullptr, out);
        } else {
          interleave_nibbles(first, std::min<int64_t>(2, groups - 2 * t), 2, out);
        }
      }
    }
  });
  return a;
}

// A Q4_1 group's 32 codes in element order as 32 bytes: byte j of the group holds element j (low nibble) and
// j + 16 (high nibble).
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  // The 16-bit shift drags the next byte's low bits into each high nibble; the mask drops them.
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

struct Problem {
  const uint8_t* w;        // row n starts at w + n * row_bytes
  int64_t row_bytes;       // K for int8, K / 2 for int4
  const uint16_t* scales;  // float16 bits [N, groups]
  const uint16_t* mins;    // float16 bits [N, groups], int4 only
  const float* bias;       // [N] or nullptr
  const QuantizedActivations* act;
  int64_t M, N, K, groups;
  float* out;  // [M, N]
  const tokenmill::SideWork* side;  // nullptr, or work the runner runs in or after its parallel region
};

// The lines of a side work's reads (SideWork::reads) for a share, to ask for into L2 a few at a time: step() once
// per row group of the share's `steps`, so that the last are asked for as its last group streams.
tokenmill::Trickle side_reads(const tokenmill::SideWork& side, int64_t share, int64_t begin, int64_t end,
                              int64_t steps) {
  tokenmill::Trickle trickle;
  tokenmill::SideWork::Range ranges[tokenmill::SideWork::kMaxReads];
  const int count = side.reads != nullptr ? side.reads(side.context, share, side.shares, begin, end, ranges) : 0;
  for (int i = 0; i < count; ++i) trickle.add(ranges[i].begin, ranges[i].bytes, ranges[i].stride, ranges[i].count);
  trickle.spread(steps);
  return trickle;
}

// The side work on its own, after a runner that does not split its columns into the side work's shares, over
// out [M, N].
void run_side(const tokenmill::SideWork* side, float* out, int64_t N) {
  if (side == nullptr) return;
  at::parallel_for(0, side->shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      side->run(side->context, s, side->shares, out, N * s / side->shares, N * (s + 1) / side->shares);
  });
}

// How a variant holds one group: `Weights` (the 32 weight codes widened to int16), `Codes` (32 activation
// codes), `Acc` (float32 partial sums of one output); `dot` gives the block's integer dot product as int32
// lanes, `add_scaled` adds those lanes times the block's scale into an accumulator, `add_mins` adds the min
// term of kMinLanes groups at once, `sum` reduces an accumulator. Integer products of int16 codes are exact
// (|w * x| <= 127 * 32767, and 32 of them stay below 2**31), so variants differ only in float32 summation order.

// 256-bit vectors: a group is two halves of 16 int16, and its dot product 8 int32 lanes (lane l sums elements
// 2l, 2l + 1, 16 + 2l and 17 + 2l).
struct Ymm {
  struct Weights {
    __m256i lo, hi;  // elements 0..15, 16..31
  };
  using Codes = Weights;
  using Acc = __m256;
  static constexpr int kMinLanes = 8;
  static constexpr int64_t kWeightTile = 2;

  static inline Weights widen_int4(const uint8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    // As in unpack_nibbles, on 128-bit halves: each is widened by itself.
    return {_mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask)),
            _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask))};
  }
  static inline Weights widen_int8(const uint8_t* p) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  static inline Codes load_codes(const int16_t* x) {
    Codes c{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))};
    // Keeps the codes in registers: the compiler would fold the loads into each of the tile's NR dot products,
    // and loads limit the tile's inner loop.
    __asm__("" : "+x"(c.lo), "+x"(c.hi));
    return c;
  }
  static inline Acc zero() { return _mm256_setzero_ps(); }
  static inline Acc add_scaled(Acc acc, __m256i dot, const float* scale) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_broadcast_ss(scale), acc);
  }
  static inline Acc add_mins(Acc acc, const uint16_t* mins, const float* sx) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins)));
    return _mm256_fmadd_ps(m, _mm256_loadu_ps(sx), acc);
  }
  static inline float sum(Acc acc) { return hsum(acc); }
};

// The variants. Each `tile` is the entry point compiled for its instruction set; `flatten` inlines tile_body and
// everything it calls into it, so the AVX-VNNI and AVX-512 intrinsics are only ever inlined into code built for
// them.
template <bool kInt4, int NR, int MR, class V>
inline void tile_body(const Problem& p, int64_t n0, int64_t m0, bool prefetch);
template <bool kInt4, int NR, int MR, class V>
inline void finish_tile(const Problem& p, int64_t n0, int64_t m0, typename V::Acc (&acc)[NR][MR]);
template <bool kInt4, int NR, int MR, class V>
inline void pair_tile_body(const Problem& p, const int16_t* wbuf, int64_t n0, int64_t m0);
template <int NR, int MR, class V>
inline void nibble_tile_body(const Problem& p, int64_t n0, int64_t m0, bool prefetch);
template <int NR, int MR, class V>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void nibble_quad_tile_body(const Problem& p, int64_t n0,
                                                                                        int64_t m0, bool prefetch);

struct Avx2 : Ymm {
  static inline __m256i dot(const Weights& w, const Codes& x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x.lo), _mm256_madd_epi16(w.hi, x.hi));
  }
  // The block dot products of two groups in the pair layout (see kPairCodes), lanes alternately the first's and
  // the second's: their four weight registers `w` times the four code registers at `x`.
  static inline __m256i dot_pair(const __m256i (&w)[4], const __m256i* x) {
    const __m256i d01 = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_load_si256(x)),
                                         _mm256_madd_epi16(w[1], _mm256_load_si256(x + 1)));
    const __m256i d23 = _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_load_si256(x + 2)),
                                         _mm256_madd_epi16(w[3], _mm256_load_si256(x + 3)));
    return _mm256_add_epi32(d01, d23);
  }
  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten)) static void tile(const Problem& p, int64_t n0, int64_t m0, bool prefetch) {
    tile_body<kInt4, NR, MR, Avx2>(p, n0, m0, prefetch);
  }
  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten)) static void pair_tile(const Problem& p, const int16_t* wbuf, int64_t n0,
                                                           int64_t m0) {
    pair_tile_body<kInt4, NR, MR, Avx2>(p, wbuf, n0, m0);
  }
  template <int NR, int MR>
  __attribute__((noinline, flatten)) static void nibble_tile(const Problem& p, int64_t n0, int64_t m0, bool prefetch) {
    nibble_tile_body<NR, MR, Avx2>(p, n0, m0, prefetch);
  }
};

// AVX-VNNI (Alder Lake, Zen 5): vpdpwssd adds the second half's products into the first's, one
// instruction instead of vpmaddwd + vpaddd; the lanes are avx2's.
struct AvxVnni : Ymm {
  __attribute__((target("avxvnni"))) static inline __m256i dot(const Weights& w, const Codes& x) {
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w.lo, x.lo), w.hi, x.hi);
  }
  __attribute__((target("avxvnni"))) static inline __m256i dot_pair(const __m256i (&w)[4], const __m256i* x) {
    __m256i dot = _mm256_madd_epi16(w[0], _mm256_load_si256(x));
    UNROLL
    for (int j = 1; j < 4; ++j) dot = _mm256_dpwssd_avx_epi32(dot, w[j], _mm256_load_si256(x + j));
    return dot;
  }
  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten, target("avxvnni"))) static void tile(const Problem& p, int64_t n0, int64_t m0,
                                                                        bool prefetch) {
    tile_body<kInt4, NR, MR, AvxVnni>(p, n0, m0, prefetch);
  }
  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten, target("avxvnni"))) static void pair_tile(const Problem& p, const int16_t* wbuf,
                                                                             int64_t n0, int64_t m0) {
    pair_tile_body<kInt4, NR, MR, AvxVnni>(p, wbuf, n0, m0);
  }
  template <int NR, int MR>
  __attribute__((noinline, flatten, target("avxvnni"))) static void nibble_tile(const Problem& p, int64_t n0,
                                                                               int64_t m0, bool prefetch) {
    nibble_tile_body<NR, MR, AvxVnni>(p, n0, m0, prefetch);
  }
};

// AVX-512 (Skylake-SP, Ice Lake, Zen 4 and later): a group's 32 int16 codes fill one 512-bit register, so a
// block's dot product is one vpmaddwd into 16 lanes, converted and scaled by one instruction each: half the
// instructions of the 256-bit variants.
#define AVX512_TARGET "avx512f,avx512bw,avx512vl"
struct Avx512 {
  using Weights = __m512i;
  using Codes = __m512i;
  using Acc = __m512;
  static constexpr int kMinLanes = 16;
  static constexpr int64_t kWeightTile = 4;  // 4 x 4 accumulators fit AVX-512's 32 registers

  __attribute__((target(AVX512_TARGET))) static inline Weights widen_int4(const uint8_t* p) {
    return _mm512_cvtepu8_epi16(unpack_nibbles(p));
  }
  __attribute__((target(AVX512_TARGET))) static inline Weights widen_int8(const uint8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  __attribute__((target(AVX512_TARGET))) static inline Codes load_codes(const int16_t* x) {
    __m512i c = _mm512_loadu_si512(x);
    __asm__("" : "+v"(c));  // in a register, as in Ymm::load_codes
    return c;
  }
  __attribute__((target(AVX512_TARGET))) static inline __m512i dot(const Weights& w, const Codes& x) {
    return _mm512_madd_epi16(w, x);
  }
  __attribute__((target(AVX512_TARGET))) static inline Acc zero() { return _mm512_setzero_ps(); }
  __attribute__((target(AVX512_TARGET))) static inline Acc add_scaled(Acc acc, __m512i dot, const float* scale) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(*scale), acc);
  }
  __attribute__((target(AVX512_TARGET))) static inline Acc add_mins(Acc acc, const uint16_t* mins, const float* sx) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins)));
    return _mm512_fmadd_ps(m, _mm512_loadu_ps(sx), acc);
  }
  __attribute__((target(AVX512_TARGET))) static inline float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }

  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten, target(AVX512_TARGET))) static void tile(const Problem& p, int64_t n0, int64_t m0,
                                                                            bool prefetch) {
    tile_body<kInt4, NR, MR, Avx512>(p, n0, m0, prefetch);
  }
  // The block dot products of four groups, one per 128-bit lane: four weight registers `w` times the four code
  // registers at `x`.
  __attribute__((target(AVX512_TARGET))) static inline __m512i dot_quad(const __m512i (&w)[4], const __m512i* x) {
    const __m512i d01 = _mm512_add_epi32(_mm512_madd_epi16(w[0], _mm512_load_si512(x)),
                                         _mm512_madd_epi16(w[1], _mm512_load_si512(x + 1)));
    const __m512i d23 = _mm512_add_epi32(_mm512_madd_epi16(w[2], _mm512_load_si512(x + 2)),
                                         _mm512_madd_epi16(w[3], _mm512_load_si512(x + 3)));
    return _mm512_add_epi32(d01, d23);
  }
  template <int NR, int MR>
  __attribute__((noinline, flatten, target(AVX512_TARGET))) static void nibble_tile(const Problem& p, int64_t n0,
                                                                                   int64_t m0, bool prefetch) {
    nibble_quad_tile_body<NR, MR, Avx512>(p, n0, m0, prefetch);
  }
};

// AVX-512 VNNI on int16 codes (vpdpwssd; Ice Lake, Zen 4 and later), variant avx512_vnni16. Under kPairMinRows
// rows, int4 weights run the nibble tiles (nibble_quad_tile_body), whose block of four groups' products dot_quad
// sums with one vpmaddwd and three vpdpwssd; from column_min_rows rows on, int4 and int8 weights run the column
// tiles (run_columns); int8 weights under that run Avx512's tiles.
#define AVX512_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
struct Avx512Vnni {
  __attribute__((target(AVX512_VNNI_TARGET))) static inline __m512i dot_quad(const __m512i (&w)[4],
                                                                             const __m512i* x) {
    __m512i dot = _mm512_madd_epi16(w[0], _mm512_load_si512(x));
    UNROLL
    for (int j = 1; j < 4; ++j) dot = _mm512_dpwssd_epi32(dot, w[j], _mm512_load_si512(x + j));
    return dot;
  }
  template <int NR, int MR>
  __attribute__((noinline, flatten, target(AVX512_VNNI_TARGET))) static void nibble_tile(const Problem& p, int64_t n0,
                                                                                        int64_t m0, bool prefetch) {
    nibble_quad_tile_body<NR, MR, Avx512Vnni>(p, n0, m0, prefetch);
  }
};

// scale[r][i][g - g0] = dw[r, g] * dx[i, g] for the groups g0 .. g_end of one chunk, `wd` and `xd` at the tile's
// first weight and activation row (rows `groups` apart): 8 groups per F16C conversion and multiply instead of one
// multiply per group in the tiles' loops; each product is the same float32 dw * dx either way. The last 8 may
// overlap the previous 8 (the same products again), so only chunks under 8 groups go one by one.
template <int NR, int MR>
inline void scale_products(const uint16_t* wd, const float* xd, int64_t groups, int64_t g0, int64_t g_end,
                           float (&scale)[NR][MR][kScaleChunk]) {
  int64_t g = g0;
  if (g_end - g0 >= 8) {
    for (int64_t v = g0; v < g_end; v += 8) {
      const int64_t gv = std::min(v, g_end - 8);
      UNROLL
      for (int r = 0; r < NR; ++r) {
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + r * groups + gv)));
        UNROLL
        for (int i = 0; i < MR; ++i) {
          _mm256_storeu_ps(&scale[r][i][gv - g0], _mm256_mul_ps(dw, _mm256_loadu_ps(xd + i * groups + gv)));
        }
      }
    }
    g = g_end;
  }
  for (; g < g_end; ++g) {
    UNROLL
    for (int r = 0; r < NR; ++r) {
      UNROLL
      for (int i = 0; i < MR; ++i) scale[r][i][g - g0] = _cvtsh_ss(wd[r * groups + g]) * xd[i * groups + g];
    }
  }
}

// out[m0 .. m0+MR, n0 .. n0+NR] for one tile: NR weight rows against MR activation rows. `prefetch` asks for
// the weight stream kPrefetchBytes ahead to be requested; only the first activation tile of a row group streams
// from memory (the others find the rows in L1), and only while the target is still inside this task's rows.
template <bool kInt4, int NR, int MR, class V>
inline void tile_body(const Problem& p, int64_t n0, int64_t m0, bool prefetch) {
  const int64_t groups = p.groups;
  const int16_t* xq = p.act->q.get() + m0 * p.K;
  const float* xd = p.act->d.get() + m0 * groups;
  const uint8_t* w = p.w + n0 * p.row_bytes;
  const uint16_t* wd = p.scales + n0 * groups;
  constexpr int64_t kGroupBytes = kInt4 ? kGroup / 2 : kGroup;
  constexpr int64_t kGroupsPerLine = 64 / kGroupBytes;

  typename V::Acc acc[NR][MR];
  UNROLL
  for (int r = 0; r < NR; ++r) {
    UNROLL
    for (int i = 0; i < MR; ++i) acc[r][i] = V::zero();
  }
  float scale[NR][MR][kScaleChunk];  // dw[n0 + r, g] * dx[m0 + i, g] for the chunk's groups
  for (int64_t g0 = 0; g0 < groups; g0 += kScaleChunk) {
    const int64_t g_end = std::min(g0 + kScaleChunk, groups);
    scale_products<NR, MR>(wd, xd, groups, g0, g_end, scale);
    for (int64_t g = g0; g < g_end; ++g) {
      // Each weight row's group is widened to int16 once, then meets every activation row of the tile.
      typename V::Weights wg[NR];
      UNROLL
      for (int r = 0; r < NR; ++r) {
        const uint8_t* src = w + r * p.row_bytes + g * kGroupBytes;
        if (prefetch && g % kGroupsPerLine == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T0);
        }
        if constexpr (kInt4) {
          wg[r] = V::widen_int4(src);
        } else {
          wg[r] = V::widen_int8(src);
        }
      }
      UNROLL
      for (int i = 0; i < MR; ++i) {
        const typename V::Codes x = V::load_codes(xq + i * p.K + g * kGroup);
        UNROLL
        for (int r = 0; r < NR; ++r) acc[r][i] = V::add_scaled(acc[r][i], V::dot(wg[r], x), &scale[r][i][g - g0]);
      }
    }
  }

  finish_tile<kInt4, NR, MR, V>(p, n0, m0, acc);
}

// The pair tiles: avx2 and avx_vnni from kPairMinRows activation rows on (prefill, batched decode, drafts).
// Holding a group as two halves (Ymm) costs 5 instructions per group and pair of rows on avx2 (2 vpmaddwd, vpaddd,
// the int32 -> float32 conversion, the scaled add) plus the weights' widening, again for every activation tile.
// Here four registers of 16 int16 hold two groups a and b (2t and 2t + 1), arranged so that each 32-bit lane holds
// two elements of one group, a in the even lanes and b in the odd ones: register j, 128-bit half h holds elements
// e, e + 1 of a, the same of b, then e + 2, e + 3 of a and of b, for e = 16h + 4j. vpmaddwd then gives int32
// lanes that each belong to one group, so one conversion and one scaled add (the two groups' scale products
// broadcast as a pair, which alternates the same way) take both: per two groups and pair of rows 4 vpmaddwd + 3
// vpaddd + 2 (avx2) or vpmaddwd + 3 vpdpwssd + 2 (avx_vnni), against 2 x 5 or 2 x 4. The weights are widened into
// this order once per weight row, into a buffer every activation tile of the row group reads (widen_pairs), the
// activation codes once per call (interleave_pair). When K / 32 is odd, the last pair's second group is zero.
constexpr int64_t kPairCodes = 2 * kGroup;

// Weight row n in the pair layout: `pairs` * kPairCodes int16 at `buf` (32-byte aligned).
template <bool kInt4>
inline void widen_pairs(const Problem& p, int64_t n, int16_t* buf, bool prefetch) {
  const uint8_t* row = p.w + n * p.row_bytes;
  const int64_t pairs = (p.groups + 1) / 2;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t t = 0; t < pairs; ++t) {
    const bool full = 2 * t + 1 < p.groups;
    __m256i u0, u1;  // 16-bit words of a and b in turn: elements 0..7 and 16..23 (u0), 8..15 and 24..31 (u1)
    __m256i r[4];
    if constexpr (kInt4) {
      const uint8_t* src = row + t * kGroup;  // 16 bytes per group
      if (prefetch && t % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i bytes = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m256i nibble = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(bytes, nibble);                         // a 0..15 | b 0..15
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);  // a 16..31 | b 16..31
      const __m256i a = _mm256_permute2x128_si256(lo, hi, 0x20);
      const __m256i b = _mm256_permute2x128_si256(lo, hi, 0x31);
      u0 = _mm256_unpacklo_epi16(a, b);
      u1 = _mm256_unpackhi_epi16(a, b);
      r[0] = _mm256_unpacklo_epi8(u0, zero);
      r[1] = _mm256_unpackhi_epi8(u0, zero);
      r[2] = _mm256_unpacklo_epi8(u1, zero);
      r[3] = _mm256_unpackhi_epi8(u1, zero);
    } else {
      const uint8_t* src = row + 2 * t * kGroup;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      const __m256i b = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + kGroup)) : zero;
      u0 = _mm256_unpacklo_epi16(a, b);
      u1 = _mm256_unpackhi_epi16(a, b);
      // Each byte doubled into a 16-bit word, shifted down with its sign: the int8 code as int16.
      r[0] = _mm256_srai_epi16(_mm256_unpacklo_epi8(u0, u0), 8);
      r[1] = _mm256_srai_epi16(_mm256_unpackhi_epi8(u0, u0), 8);
      r[2] = _mm256_srai_epi16(_mm256_unpacklo_epi8(u1, u1), 8);
      r[3] = _mm256_srai_epi16(_mm256_unpackhi_epi8(u1, u1), 8);
    }
    __m256i* dst = reinterpret_cast<__m256i*>(buf + t * kPairCodes);
    UNROLL
    for (int j = 0; j < 4; ++j) _mm256_store_si256(dst + j, r[j]);
  }
}

// The lane sums of eight accumulators as one vector (lane k: the sum of v[k]'s lanes), in 9 instructions instead
// of 8 reductions of 6 each.
inline __m256 hsum8(const __m256 (&v)[8]) {
  const __m256 h0 = _mm256_hadd_ps(v[0], v[1]);
  const __m256 h1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h2 = _mm256_hadd_ps(v[4], v[5]);
  const __m256 h3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 q0 = _mm256_hadd_ps(h0, h1);  // v[0..3]: lanes 0..3 summed | lanes 4..7 summed
  const __m256 q1 = _mm256_hadd_ps(h2, h3);
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// The end of a pair tile: Q4_1's min term into the accumulators, 8 groups at a time (a last 8 overlapping the
// previous block, with the groups already counted masked out; under 8 groups from zero-padded copies), then the
// accumulators' lane sums eight at a time, and the bias.
template <bool kInt4, int NR, int MR>
inline void finish_pair_tile(const Problem& p, int64_t n0, int64_t m0, __m256 (&acc)[NR][MR]) {
  const int64_t groups = p.groups;
  if constexpr (kInt4) {
    const uint16_t* wm = p.mins + n0 * groups;
    const float* sx = p.act->s.get() + m0 * groups;
    if (groups >= 8) {
      for (int64_t v = 0; v < groups; v += 8) {
        const int64_t g = std::min(v, groups - 8);
        // Lanes below v - g hold groups the previous block added.
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 keep =
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(v - g) - 1)));
        UNROLL
        for (int r = 0; r < NR; ++r) {
          const __m256 m = _mm256_and_ps(
              keep, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + r * groups + g))));
          UNROLL
          for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sx + i * groups + g), acc[r][i]);
        }
      }
    } else {
      alignas(32) float m[NR][8] = {};
      alignas(32) float s[MR][8] = {};
      for (int64_t g = 0; g < groups; ++g) {
        UNROLL
        for (int r = 0; r < NR; ++r) m[r][g] = _cvtsh_ss(wm[r * groups + g]);
        UNROLL
        for (int i = 0; i < MR; ++i) s[i][g] = sx[i * groups + g];
      }
      UNROLL
      for (int r = 0; r < NR; ++r) {
        UNROLL
        for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_fmadd_ps(_mm256_load_ps(m[r]), _mm256_load_ps(s[i]), acc[r][i]);
      }
    }
  }
  constexpr int kOutputs = NR * MR;
  alignas(32) float sums[(kOutputs + 7) / 8 * 8];
  UNROLL
  for (int k0 = 0; k0 < kOutputs; k0 += 8) {
    __m256 v[8];
    UNROLL
    for (int k = 0; k < 8; ++k) v[k] = k0 + k < kOutputs ? acc[(k0 + k) % NR][(k0 + k) / NR] : _mm256_setzero_ps();
    _mm256_store_ps(sums + k0, hsum8(v));
  }
  UNROLL
  for (int i = 0; i < MR; ++i) {
    UNROLL
    for (int r = 0; r < NR; ++r) {
      p.out[(m0 + i) * p.N + n0 + r] = sums[i * NR + r] + (p.bias != nullptr ? p.bias[n0 + r] : 0.0f);
    }
  }
}

// The loop of the tiles that take kSpan groups at a time (the pair tiles and the 256-bit nibble tiles: 2; the
// 512-bit nibble tiles: 4): per chunk of groups their scale products, zero for the groups missing after a row's
// last, then `step(t, scale)` for each span t of the chunk, where scale(r, i) points at dw dx of the span's groups
// for weight row r and activation row i.
template <int kSpan, int NR, int MR, class Step>
inline void for_each_span(const Problem& p, int64_t n0, int64_t m0, Step&& step) {
  static_assert(kScaleChunk % kSpan == 0, "chunks hold whole spans");
  const int64_t groups = p.groups;
  const float* xd = p.act->d.get() + m0 * groups;
  const uint16_t* wd = p.scales + n0 * groups;
  alignas(64) float scale[NR][MR][kScaleChunk];
  for (int64_t g0 = 0; g0 < groups; g0 += kScaleChunk) {
    const int64_t g_end = std::min(g0 + kScaleChunk, groups);
    scale_products<NR, MR>(wd, xd, groups, g0, g_end, scale);
    for (int64_t g = g_end; g % kSpan != 0; ++g) {
      UNROLL
      for (int r = 0; r < NR; ++r) {
        UNROLL
        for (int i = 0; i < MR; ++i) scale[r][i][g - g0] = 0.0f;
      }
    }
    for (int64_t t = g0 / kSpan; t < (g_end + kSpan - 1) / kSpan; ++t) {
      step(t, [&](int r, int i) -> const float* { return &scale[r][i][kSpan * t - g0]; });
    }
  }
}

// Zeroed 256-bit accumulators for a tile.
template <int NR, int MR>
inline void zero_acc(__m256 (&acc)[NR][MR]) {
  UNROLL
  for (int r = 0; r < NR; ++r) {
    UNROLL
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_ps();
  }
}

// out[m0 .. m0+MR, n0 .. n0+NR] for one tile in the pair layout, the weight rows widened in `wbuf`.
template <bool kInt4, int NR, int MR, class V>
inline void pair_tile_body(const Problem& p, const int16_t* wbuf, int64_t n0, int64_t m0) {
  const int64_t pairs = (p.groups + 1) / 2;
  const int16_t* xq = p.act->qp.get() + m0 * pairs * kPairCodes;
  __m256 acc[NR][MR];
  zero_acc(acc);
  for_each_span<2, NR, MR>(p, n0, m0, [&](int64_t t, auto scale) {
    // A weight row's four registers meet every activation row's, whose loads fold into vpmaddwd: 4 + 1 loads
    // (the scale pair) per output and pair of groups, where holding both in registers would spill.
    UNROLL
    for (int r = 0; r < NR; ++r) {
      const __m256i* wv = reinterpret_cast<const __m256i*>(wbuf + (r * pairs + t) * kPairCodes);
      const __m256i w[4] = {_mm256_load_si256(wv), _mm256_load_si256(wv + 1), _mm256_load_si256(wv + 2),
                            _mm256_load_si256(wv + 3)};
      UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m256i dot = V::dot_pair(w, reinterpret_cast<const __m256i*>(xq + (i * pairs + t) * kPairCodes));
        // dw * dx of the two groups, alternating as the dot product's lanes do.
        const __m256 s = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(scale(r, i))));
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][i]);
      }
    }
  });
  finish_pair_tile<kInt4, NR, MR>(p, n0, m0, acc);
}

// The nibble tiles: avx2 and avx_vnni for int4 weights at 1 to kNibbleMaxRows activation rows (decode), where
// Ymm's tiles are bound by instructions, not memory: widening each group's nibbles to int16 takes 5 instructions,
// 2 of them the cross-lane vpmovzxbw, and each group ends in its own conversion and scaled add. Here one 32-byte
// load takes two groups a and b (a in the low 128-bit half, b in the high), and shifts and masks on its 16-bit
// words give four registers of int16 weights without a shuffle: word k of a group's 16 bytes holds elements 2k,
// 2k + 16, 2k + 1 and 2k + 17 in its four nibbles, lowest first (interleave_nibbles lays the activation codes out
// to match). Their products (V::dot_pair) sum into int32 lanes 0..3 for a and 4..7 for b, so one conversion and
// one scaled add (the two groups' scale products spread to match) take both groups: per two groups and weight row
// 6 + 7 (avx2) or 6 + 4 (avx_vnni) + 3 instructions, against 2 x 10 or 2 x 9. Four weight rows per tile keep four
// independent accumulator chains in flight.
template <int NR, int MR, class V>
inline void nibble_tile_body(const Problem& p, int64_t n0, int64_t m0, bool prefetch) {
  const int64_t groups = p.groups;
  const int64_t pairs = (groups + 1) / 2;
  const int16_t* xq = p.act->qp.get() + m0 * pairs * kPairCodes;
  const uint8_t* w = p.w + n0 * p.row_bytes;
  const __m256i nibble = _mm256_set1_epi16(0x000F);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // (dw dx of a, of b) -> a's lanes, b's lanes
  __m256 acc[NR][MR];
  zero_acc(acc);
  for_each_span<2, NR, MR>(p, n0, m0, [&](int64_t t, auto scale) {
    const bool full = 2 * t + 1 < groups;  // only a row's last pair may lack its second group
    UNROLL
    for (int r = 0; r < NR; ++r) {
      const uint8_t* src = w + r * p.row_bytes + t * kGroup;  // 16 bytes per group
      if (prefetch && t % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T0);
      const __m256i v = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                             : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
      const __m256i q[4] = {_mm256_and_si256(v, nibble), _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble),
                            _mm256_and_si256(_mm256_srli_epi16(v, 8), nibble), _mm256_srli_epi16(v, 12)};
      UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m256i dot = V::dot_pair(q, reinterpret_cast<const __m256i*>(xq + (i * pairs + t) * kPairCodes));
        const __m256d pair = _mm256_broadcast_sd(reinterpret_cast<const double*>(scale(r, i)));
        const __m256 s = _mm256_permutevar8x32_ps(_mm256_castpd_ps(pair), spread);
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][i]);
      }
    }
  });
  finish_pair_tile<true, NR, MR>(p, n0, m0, acc);
}

// The nibble tiles on 512-bit vectors: avx512 and avx512_vnni16 for int4 weights at 1 to kNibbleMaxRows rows. As
// nibble_tile_body, with four groups per 64-byte load, one per 128-bit lane (the activation codes laid out to match
// by interleave_nibbles): per four groups and weight row 6 + 7 (avx512) or 6 + 4 (avx512_vnni16) + 3 instructions,
// against Avx512's 4 x 7 (its 512-bit vpmovzxbw crossing lanes). A row's last block may hold fewer than four
// groups: masked loads leave the rest zero, and their scale products are zeroed.
template <int NR, int MR, class V>
__attribute__((target(AVX512_TARGET))) inline void nibble_quad_tile_body(const Problem& p, int64_t n0, int64_t m0,
                                                                         bool prefetch) {
  const int64_t groups = p.groups;
  const int64_t blocks = (groups + 3) / 4;
  const int16_t* xq = p.act->qi.get() + m0 * blocks * 4 * kGroup;
  const uint8_t* w = p.w + n0 * p.row_bytes;
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[NR][MR];
  UNROLL
  for (int r = 0; r < NR; ++r) {
    UNROLL
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  for_each_span<4, NR, MR>(p, n0, m0, [&](int64_t b, auto scale) __attribute__((target(AVX512_TARGET))) {
    const int64_t num_groups = std::min<int64_t>(4, groups - 4 * b);
    const __mmask64 byte_mask = num_groups == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * num_groups)) - 1;
    UNROLL
    for (int r = 0; r < NR; ++r) {
      const uint8_t* src = w + r * p.row_bytes + b * 64;  // 16 bytes per group
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i v = _mm512_maskz_loadu_epi8(byte_mask, src);
      const __m512i q[4] = {_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                            _mm512_and_si512(_mm512_srli_epi16(v, 8), nibble), _mm512_srli_epi16(v, 12)};
      UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m512i dot = V::dot_quad(q, reinterpret_cast<const __m512i*>(xq + (i * blocks + b) * 4 * kGroup));
        const __m512 s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_load_ps(scale(r, i))));
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r][i]);
      }
    }
  });
  finish_tile<true, NR, MR, Avx512>(p, n0, m0, acc);
}

// The nibble tiles (V: Avx2, AvxVnni, Avx512 or Avx512Vnni) as a variant `run` takes: kNibbleWeightTile weight
// rows, up to kActTile activation rows.
constexpr int64_t kNibbleWeightTile = 4;
template <class V>
struct Nibbles {
  static constexpr int64_t kWeightTile = kNibbleWeightTile;
  template <bool kInt4, int NR, int MR>
  static void tile(const Problem& p, int64_t n0, int64_t m0, bool prefetch) {
    static_assert(kInt4, "the nibble tiles read int4 weights");
    V::template nibble_tile<NR, MR>(p, n0, m0, prefetch);
  }
};

// The end of a tile: Q4_1's min term, the bias, and each accumulator's lanes summed into out.
template <bool kInt4, int NR, int MR, class V>
inline void finish_tile(const Problem& p, int64_t n0, int64_t m0, typename V::Acc (&acc)[NR][MR]) {
  const int64_t groups = p.groups;
  float tail[NR][MR] = {};
  if constexpr (kInt4) {
    // Q4_1's min term: sum_g m[n, g] * sx[m, g], kMinLanes groups at a time into acc and the rest one by one.
    // The groups are the outer loop so that each block's mins are converted once and the tile stays unrolled.
    const uint16_t* wm = p.mins + n0 * groups;
    const float* sx = p.act->s.get() + m0 * groups;
    int64_t g = 0;
    for (; g + V::kMinLanes <= groups; g += V::kMinLanes) {
      UNROLL
      for (int r = 0; r < NR; ++r) {
        UNROLL
        for (int i = 0; i < MR; ++i) acc[r][i] = V::add_mins(acc[r][i], wm + r * groups + g, sx + i * groups + g);
      }
    }
    for (; g < groups; ++g) {
      UNROLL
      for (int r = 0; r < NR; ++r) {
        UNROLL
        for (int i = 0; i < MR; ++i) tail[r][i] += _cvtsh_ss(wm[r * groups + g]) * sx[i * groups + g];
      }
    }
  }
  UNROLL
  for (int r = 0; r < NR; ++r) {
    const int64_t n = n0 + r;
    const float b = p.bias != nullptr ? p.bias[n] : 0.0f;
    UNROLL
    for (int i = 0; i < MR; ++i) p.out[(m0 + i) * p.N + n] = V::sum(acc[r][i]) + tail[r][i] + b;
  }
}

enum class Isa { kAvx2, kAvxVnni, kAvx512, kAvx512Vnni, kAmx };

bool amx_usable();

// What matmul_* run; set_isa changes it. The variants this CPU (and OS, for the AVX-512 state) supports, best last;
// AVX2 + FMA is checked before the build, F16C (which every AVX2 CPU has) by matmul.
tokenmill::IsaChoice<Isa> g_isa({"avx2", "avx_vnni", "avx512", "avx512_vnni16", "amx"}, [] {
  std::vector<Isa> isas{Isa::kAvx2};
  if (tokenmill::kBuildAvxVnni && __builtin_cpu_supports("avxvnni")) isas.push_back(Isa::kAvxVnni);
  if (tokenmill::kBuildAvx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    isas.push_back(Isa::kAvx512);
    if (tokenmill::kBuildAvx512Vnni && __builtin_cpu_supports("avx512vnni")) {
      isas.push_back(Isa::kAvx512Vnni);
      if (tokenmill::kBuildAmx && amx_usable()) isas.push_back(Isa::kAmx);
    }
  }
  return isas;
});

// f(std::integral_constant<int, rows>{}) for `rows` in 1 .. kMaxRows: a tile's activation rows, known at run
// time, as the compile-time count its template takes.
template <int kMaxRows, class F>
void with_rows(int64_t rows, F&& f) {
  if constexpr (kMaxRows > 0) {
    if (rows == kMaxRows) {
      f(std::integral_constant<int, kMaxRows>{});
    } else {
      with_rows<kMaxRows - 1>(rows, f);
    }
  }
}

// One tile of `rows` (1 .. kActTile) activation rows against weight rows n0 .. n0+NR.
template <bool kInt4, int NR, class I>
void act_tile(const Problem& p, int64_t n0, int64_t m0, int64_t rows, bool prefetch) {
  with_rows<kActTile>(rows, [&](auto mr) {
    I::template tile<kInt4, NR, decltype(mr)::value>(p, n0, m0, prefetch);
  });
}

// Rows n0 .. n0+NR against every activation row: kActTile rows at a time, then the 1..kActTile-1 left over.
template <bool kInt4, int NR, class I>
void row_group(const Problem& p, int64_t n0, bool prefetch) {
  int64_t m0 = 0;
  for (; m0 + kActTile <= p.M; m0 += kActTile) {
    I::template tile<kInt4, NR, kActTile>(p, n0, m0, prefetch && m0 == 0);
  }
  if (m0 < p.M) act_tile<kInt4, NR, I>(p, n0, m0, p.M - m0, prefetch && m0 == 0);
}

template <bool kInt4, class I>
void run(const Problem& p) {
  static_assert(kActTile == 4, "row_group handles tails of up to 3 activation rows");
  // Tasks are ranges of row groups, so only the last group of the whole matrix can be short.
  constexpr int64_t kWeightTile = I::kWeightTile;
  const int64_t row_groups = (p.N + kWeightTile - 1) / kWeightTile;
  const int64_t scale_bytes = p.groups * static_cast<int64_t>(sizeof(uint16_t)) * (kInt4 ? 2 : 1);
  const int64_t group_bytes = kWeightTile * (p.row_bytes + scale_bytes);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / group_bytes);
  const auto row_groups_from = [&](int64_t begin, int64_t end, tokenmill::Trickle* trickle) {
    const int64_t n_end = std::min(end * kWeightTile, p.N);
    const int64_t prefetch_rows = (kPrefetchBytes + p.row_bytes - 1) / p.row_bytes;
    for (int64_t n0 = begin * kWeightTile; n0 < n_end; n0 += kWeightTile) {
      const bool prefetch = n0 + kWeightTile + prefetch_rows <= n_end;
      if (n0 + kWeightTile <= n_end) {
        row_group<kInt4, kWeightTile, I>(p, n0, prefetch);
      } else {
        for (int64_t n = n0; n < n_end; ++n) row_group<kInt4, 1, I>(p, n, false);
      }
      if (trickle != nullptr) trickle->step();
    }
  };
  if (p.side == nullptr) {
    at::parallel_for(0, row_groups, grain, [&](int64_t begin, int64_t end) { row_groups_from(begin, end, nullptr); });
    return;
  }
  const tokenmill::SideWork& side = *p.side;
  at::parallel_for(0, side.shares, 1, [&](int64_t from, int64_t to) {
    for (int64_t s = from; s < to; ++s) {
      const int64_t first = row_groups * s / side.shares, last = row_groups * (s + 1) / side.shares;
      const int64_t begin = std::min(first * kWeightTile, p.N), end = std::min(last * kWeightTile, p.N);
      tokenmill::Trickle trickle = side_reads(side, s, begin, end, last - first);
      if (first < last) row_groups_from(first, last, &trickle);
      side.run(side.context, s, side.shares, p.out, begin, end);
    }
  });
}

// The avx2 and avx_vnni variants for kPairMinRows activation rows or more: each task widens a row group's weights
// into the pair layout once (widen_pairs) and runs every activation tile over that buffer. Below, one activation
// tile covers every row and the buffer's round trip costs more than widening in registers (Ymm's tiles).
constexpr int64_t kPairMinRows = 5;
// int4 weights under kPairMinRows rows (decode, short drafts) take the nibble tiles, on every variant but amx's tiles.
constexpr int64_t kNibbleMaxRows = kPairMinRows - 1;
// 3 x 3 tiles: 9 accumulators, a weight row's 4 registers and the temporaries fit AVX2's 16 registers without
// spilling (2 x 4 and 3 x 4 measured within a few per cent of it, 3 x 4 spilling accumulators).
constexpr int64_t kPairWeightTile = 3;
constexpr int64_t kPairActTile = 3;

// One pair tile of `rows` (1 .. kPairActTile) activation rows against weight rows n0 .. n0+NR.
template <bool kInt4, int NR, class I>
void pair_act_tile(const Problem& p, const int16_t* wbuf, int64_t n0, int64_t m0, int64_t rows) {
  with_rows<kPairActTile>(rows, [&](auto mr) {
    I::template pair_tile<kInt4, NR, decltype(mr)::value>(p, wbuf, n0, m0);
  });
}

// The pair tiles over the whole problem: tasks are ranges of row groups, as in run, each with its own buffer.
template <bool kInt4, class I>
void run_pairs(const Problem& p) {
  constexpr int64_t kWeightTile = kPairWeightTile;
  const int64_t pairs = (p.groups + 1) / 2;
  const int64_t row_groups = (p.N + kWeightTile - 1) / kWeightTile;
  const int64_t scale_bytes = p.groups * static_cast<int64_t>(sizeof(uint16_t)) * (kInt4 ? 2 : 1);
  const int64_t group_bytes = kWeightTile * (p.row_bytes + scale_bytes);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / group_bytes);
  at::parallel_for(0, row_groups, grain, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<int16_t[], void (*)(int16_t*)> buf(
        static_cast<int16_t*>(std::aligned_alloc(64, kWeightTile * pairs * kPairCodes * sizeof(int16_t))),
        [](int16_t* ptr) { std::free(ptr); });
    TORCH_CHECK(buf != nullptr, "out of memory for ", kWeightTile, " widened weight rows of ", p.K);
    const int64_t n_end = std::min(end * kWeightTile, p.N);
    const int64_t prefetch_rows = (kPrefetchBytes + p.row_bytes - 1) / p.row_bytes;
    for (int64_t n0 = begin * kWeightTile; n0 < n_end; n0 += kWeightTile) {
      const int64_t rows = std::min(kWeightTile, n_end - n0);
      const bool prefetch = n0 + kWeightTile + prefetch_rows <= n_end;
      for (int64_t r = 0; r < rows; ++r) widen_pairs<kInt4>(p, n0 + r, buf.get() + r * pairs * kPairCodes, prefetch);
      for (int64_t m0 = 0; m0 < p.M; m0 += kPairActTile) {
        const int64_t act_rows = std::min(kPairActTile, p.M - m0);
        if (rows == kWeightTile) {
          pair_act_tile<kInt4, kWeightTile, I>(p, buf.get(), n0, m0, act_rows);
        } else {
          for (int64_t r = 0; r < rows; ++r) {
            pair_act_tile<kInt4, 1, I>(p, buf.get() + r * pairs * kPairCodes, n0 + r, m0, act_rows);
          }
        }
      }
    }
  });
  run_side(p.side, p.out, p.N);
}

// The column tiles: avx512_vnni16 from column_min_rows activation rows on (prompt chunks, batched decode, draft
// verification), for int4 and int8 weights. Tiles that spread a group's codes across a register's lanes end every
// group of every (weight row, activation row) pair in its own conversion and scaled add, and read the activation
// codes again for every few weight rows. Here a register's 16 lanes are 16 weight rows (16 output columns), each
// lane one pair of consecutive codes (k, k + 1) as int16, and the activation row's code pair at k, broadcast,
// meets all 16 in one vpdpwssd. A tile of kColumnVectors x 16 weight rows and up to kColumnActTile activation rows
// keeps its int32 group dot products and float32 sums in registers: per group, activation row and 16 outputs,
// 16 vpdpwssd, then one conversion and the scaled adds (scale, Q4_1's min) for all 16. Each task lays out a strip
// of weight rows once (column_weights: 4 x 4 transposes of 32-bit words) into a buffer that every activation tile
// of the strip reads, and asks for the next strip's weights while it computes.
constexpr int64_t kColumnLanes = 16;
// Activation rows from which avx512_vnni16 runs the column tiles: under it, laying out a strip costs more than the
// tiles save (int8 weights, which Avx512's tiles read as they are stored, to 8 rows).
constexpr int64_t column_min_rows(bool int4) { return int4 ? kPairMinRows : 8; }
constexpr int64_t kColumnVectors = 2;
constexpr int64_t kColumnStrip = kColumnVectors * kColumnLanes;  // weight rows per strip
// 12 int32 dot products, 12 float32 sums and the two weight registers: 26 of the 32 zmm registers.
constexpr int64_t kColumnActTile = 6;
// Words of a strip's buffer per group: 16 code pairs x kColumnVectors registers of 16 lanes.
constexpr int64_t kColumnGroupWords = kGroup / 2 * kColumnStrip;

// The float16 values in the low (shift 0) or high (16) halves of 16 words, as float32.
__attribute__((target(AVX512_VNNI_TARGET))) inline __m512 float16_halves(__m512i words, unsigned shift) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, shift)));
}

// out[g][v * 16 + l] = the float16 value of rows n0 + 16v + l (`rows` of them; past: zero) at group g, from
// `values` [N, groups]. There is no 16-bit gather: each 32-bit one takes groups g and g + 1 of 16 rows (the last,
// when `groups` is odd, g - 1 and g), never reading outside a row.
__attribute__((target(AVX512_VNNI_TARGET))) void column_scales(const uint16_t* values, int64_t n0, int64_t rows,
                                                               int64_t groups, float* out) {
  if (groups == 1) {
    std::fill_n(out, kColumnStrip, 0.0f);
    for (int64_t r = 0; r < rows; ++r) out[r] = _cvtsh_ss(values[n0 + r]);
    return;
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t v = 0; v < kColumnVectors; ++v) {
    const __mmask16 valid = static_cast<__mmask16>(
        rows >= 16 * (v + 1) ? 0xFFFF : rows <= 16 * v ? 0 : (1u << (rows - 16 * v)) - 1);
    const __m512i offsets = _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(16 * v))),
                                               _mm512_set1_epi32(static_cast<int>(groups * sizeof(uint16_t))));
    const uint16_t* base = values + n0 * groups;
    float* dst = out + v * kColumnLanes;
    for (int64_t g = 0; g + 1 < groups; g += 2) {
      const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, base + g, 1);
      _mm512_store_ps(dst + g * kColumnStrip, float16_halves(words, 0));
      _mm512_store_ps(dst + (g + 1) * kColumnStrip, float16_halves(words, 16));
    }
    if (groups % 2 == 1) {
      const __m512i words =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, base + groups - 2, 1);
      _mm512_store_ps(dst + (groups - 1) * kColumnStrip, float16_halves(words, 16));
    }
  }
}

// The 32-bit words of one group of 16 weight rows, word u of row l in lane l of d[u]: a 4 x 4 transpose of words
// within each 128-bit lane (int4: rows l, l + 4, l + 8, l + 12 of a register's lanes; int8 twice, then the
// halves of two registers interleaved).
template <bool kInt4>
__attribute__((target(AVX512_VNNI_TARGET))) inline void column_words(const uint8_t* const (&row)[kColumnLanes],
                                                                     int64_t offset, __m512i (&d)[kInt4 ? 4 : 8]) {
  const auto transpose4 = [](const __m512i* a, __m512i* out) __attribute__((target(AVX512_VNNI_TARGET))) {
    const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
  };
  const auto load128 = [&](int l) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[l] + offset)); };
  const auto load256 = [&](int l) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[l] + offset)); };
  if constexpr (kInt4) {
    __m512i a[4];
    UNROLL
    for (int k = 0; k < 4; ++k) {
      a[k] = _mm512_inserti32x4(_mm512_castsi128_si512(load128(k)), load128(k + 4), 1);
      a[k] = _mm512_inserti32x4(_mm512_inserti32x4(a[k], load128(k + 8), 2), load128(k + 12), 3);
    }
    transpose4(a, d);
  } else {
    // a[k]: row k (words 0..7) in the low half, row k + 8 in the high; after the transposes lo[u] holds word u (128-bit
    // lane 0) and u + 4 (lane 1) of rows 0..3, the same of rows 8..11 in lanes 2 and 3; hi[u] those of 4..7, 12..15.
    __m512i a[8], lo[4], hi[4];
    UNROLL
    for (int k = 0; k < 8; ++k) a[k] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(k)), load256(k + 8), 1);
    transpose4(a, lo);
    transpose4(a + 4, hi);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    UNROLL
    for (int u = 0; u < 4; ++u) {
      d[u] = _mm512_permutex2var_epi64(lo[u], first, hi[u]);
      d[u + 4] = _mm512_permutex2var_epi64(lo[u], second, hi[u]);
    }
  }
}

// Weight rows n0 .. n0 + kColumnStrip as the column tiles read them: buf[g][t][v] holds in lane l the codes 2t and
// 2t + 1 of group g of row n0 + 16v + l, as int16 (the low word first); dw and mw [g][v * 16 + l] their scales
// and (int4) mins as float32. Lanes past row N repeat its last row (their outputs are not stored) with zero scales.
template <bool kInt4>
__attribute__((target(AVX512_VNNI_TARGET))) void column_weights(const Problem& p, int64_t n0, int32_t* buf, float* dw,
                                                                float* mw) {
  const int64_t groups = p.groups, rows = std::min(kColumnStrip, p.N - n0);
  constexpr int64_t kGroupBytes = kInt4 ? kGroup / 2 : kGroup;
  // vpshufb controls, per 32-bit lane of 4 bytes b0 b1 b2 b3: (b0, b1) or (b2, b3) as 16-bit words, zero-extended
  // (int4: the nibbles are masked already) or in the words' high bytes (int8: shifted down with the sign after).
  const __m512i low_pair = _mm512_set4_epi32(0x800D800C, 0x80098008, 0x80058004, 0x80018000);
  const __m512i high_pair = _mm512_set4_epi32(0x800F800E, 0x800B800A, 0x80078006, 0x80038002);
  const __m512i low_pair_hi = _mm512_set4_epi32(0x0D800C80, 0x09800880, 0x05800480, 0x01800080);
  const __m512i high_pair_hi = _mm512_set4_epi32(0x0F800E80, 0x0B800A80, 0x07800680, 0x03800280);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t v = 0; v < kColumnVectors; ++v) {
    const uint8_t* row[kColumnLanes];
    for (int64_t l = 0; l < kColumnLanes; ++l) row[l] = p.w + (n0 + std::min(16 * v + l, rows - 1)) * p.row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t* dst = buf + g * kColumnGroupWords + v * kColumnLanes;
      __m512i words[kGroupBytes / 4];  // lane l of words[u]: bytes 4u .. 4u + 3 of the group in row n0 + 16v + l
      column_words<kInt4>(row, g * kGroupBytes, words);
      UNROLL
      for (int u = 0; u < kGroupBytes / 4; ++u) {
        if constexpr (kInt4) {
          // Byte j holds code j (low nibble) and j + 16 (high): pairs 2u, 2u + 1 and 8 + 2u, 9 + 2u.
          const __m512i lo = _mm512_and_si512(words[u], nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(words[u], 4), nibble);
          _mm512_store_si512(dst + (2 * u) * kColumnStrip, _mm512_shuffle_epi8(lo, low_pair));
          _mm512_store_si512(dst + (2 * u + 1) * kColumnStrip, _mm512_shuffle_epi8(lo, high_pair));
          _mm512_store_si512(dst + (8 + 2 * u) * kColumnStrip, _mm512_shuffle_epi8(hi, low_pair));
          _mm512_store_si512(dst + (9 + 2 * u) * kColumnStrip, _mm512_shuffle_epi8(hi, high_pair));
        } else {
          _mm512_store_si512(dst + (2 * u) * kColumnStrip,
                             _mm512_srai_epi16(_mm512_shuffle_epi8(words[u], low_pair_hi), 8));
          _mm512_store_si512(dst + (2 * u + 1) * kColumnStrip,
                             _mm512_srai_epi16(_mm512_shuffle_epi8(words[u], high_pair_hi), 8));
        }
      }
    }
  }
  column_scales(p.scales, n0, rows, groups, dw);
  if constexpr (kInt4) column_scales(p.mins, n0, rows, groups, mw);
}

// out[m0 .. m0+MR, n0 .. n0+columns] from a strip laid out by column_weights.
template <bool kInt4, int MR>
__attribute__((noinline, flatten, target(AVX512_VNNI_TARGET))) void column_tile(const Problem& p, const int32_t* buf,
                                                                               const float* dw, const float* mw,
                                                                               int64_t n0, int64_t columns,
                                                                               int64_t m0) {
  const int64_t groups = p.groups;
  const int16_t* x = p.act->q.get() + m0 * p.K;
  const float* xd = p.act->d.get() + m0 * groups;
  const float* sx = p.act->s.get() + m0 * groups;
  __m512 acc[MR][kColumnVectors];
  UNROLL
  for (int i = 0; i < MR; ++i) {
    UNROLL
    for (int v = 0; v < kColumnVectors; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i* wg = reinterpret_cast<const __m512i*>(buf + g * kColumnGroupWords);
    __m512i dot[MR][kColumnVectors];
    UNROLL
    for (int i = 0; i < MR; ++i) {
      UNROLL
      for (int v = 0; v < kColumnVectors; ++v) dot[i][v] = _mm512_setzero_si512();
    }
#pragma GCC unroll 16
    for (int t = 0; t < kGroup / 2; ++t) {
      __m512i w[kColumnVectors];
      UNROLL
      for (int v = 0; v < kColumnVectors; ++v) w[v] = _mm512_load_si512(wg + t * kColumnVectors + v);
      UNROLL
      for (int i = 0; i < MR; ++i) {
        // Codes 2t and 2t + 1 of row i's group g as one 32-bit word (memcpy: the codes are int16).
        int32_t pair;
        std::memcpy(&pair, x + i * p.K + g * kGroup + 2 * t, sizeof(pair));
        const __m512i xb = _mm512_set1_epi32(pair);
        UNROLL
        for (int v = 0; v < kColumnVectors; ++v) dot[i][v] = _mm512_dpwssd_epi32(dot[i][v], w[v], xb);
      }
    }
    UNROLL
    for (int v = 0; v < kColumnVectors; ++v) {
      const __m512 scale = _mm512_load_ps(dw + g * kColumnStrip + v * kColumnLanes);
      UNROLL
      for (int i = 0; i < MR; ++i) {
        // The same float32 products dw * dx as the other variants' scales.
        const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(xd[i * groups + g]));
        acc[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][v]), s, acc[i][v]);
      }
      if constexpr (kInt4) {
        const __m512 min = _mm512_load_ps(mw + g * kColumnStrip + v * kColumnLanes);
        UNROLL
        for (int i = 0; i < MR; ++i) acc[i][v] = _mm512_fmadd_ps(min, _mm512_set1_ps(sx[i * groups + g]), acc[i][v]);
      }
    }
  }
  UNROLL
  for (int v = 0; v < kColumnVectors; ++v) {
    const int64_t lanes = std::clamp<int64_t>(columns - v * kColumnLanes, 0, kColumnLanes);
    if (lanes == 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
    const __m512 bias =
        p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + n0 + v * kColumnLanes) : _mm512_setzero_ps();
    UNROLL
    for (int i = 0; i < MR; ++i) {
      _mm512_mask_storeu_ps(p.out + (m0 + i) * p.N + n0 + v * kColumnLanes, mask, _mm512_add_ps(acc[i][v], bias));
    }
  }
}

// The column tiles over the whole problem: tasks are ranges of strips, each with its own buffer. Each tile reads
// the strip's buffer again, so a strip's activation rows go in the fewest tiles, as even as can be (M = 9: 5 and 4
// rows, not 6 and 3).
template <bool kInt4>
void run_columns(const Problem& p) {
  const int64_t groups = p.groups;
  const int64_t strips = (p.N + kColumnStrip - 1) / kColumnStrip;
  const int64_t scale_bytes = groups * static_cast<int64_t>(sizeof(uint16_t)) * (kInt4 ? 2 : 1);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / (kColumnStrip * (p.row_bytes + scale_bytes)));
  at::parallel_for(0, strips, grain, [&](int64_t begin, int64_t end) {
    const auto aligned = [](int64_t count, auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      T* ptr = static_cast<T*>(std::aligned_alloc(64, count * sizeof(T)));
      TORCH_CHECK(ptr != nullptr, "out of memory for a strip of ", kColumnStrip, " weight rows");
      return std::unique_ptr<T[], void (*)(T*)>(ptr, [](T* q) { std::free(q); });
    };
    const auto buf = aligned(groups * kColumnGroupWords, static_cast<int32_t*>(nullptr));
    const auto dw = aligned(groups * kColumnStrip, static_cast<float*>(nullptr));
    const auto mw = aligned(groups * kColumnStrip, static_cast<float*>(nullptr));
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n0 = s * kColumnStrip, columns = std::min(kColumnStrip, p.N - n0);
      int64_t tiles = (p.M + kColumnActTile - 1) / kColumnActTile;
      // The next strip's weights, scales and mins asked for into L2 while this one computes (a decode step's come
      // from memory), a share after each activation tile.
      tokenmill::Trickle next;
      if (s + 1 < end) {
        const int64_t n1 = n0 + kColumnStrip, rows = std::min(kColumnStrip, p.N - n1);
        next.add(p.w + n1 * p.row_bytes, rows * p.row_bytes);
        next.add(p.scales + n1 * groups, rows * groups * static_cast<int64_t>(sizeof(uint16_t)));
        if (kInt4) next.add(p.mins + n1 * groups, rows * groups * static_cast<int64_t>(sizeof(uint16_t)));
        next.spread(tiles);
      }
      column_weights<kInt4>(p, n0, buf.get(), dw.get(), mw.get());
      for (int64_t m0 = 0; m0 < p.M; --tiles) {
        const int64_t rows = (p.M - m0 + tiles - 1) / tiles;
        with_rows<kColumnActTile>(rows, [&](auto mr) {
          column_tile<kInt4, decltype(mr)::value>(p, buf.get(), dw.get(), mw.get(), n0, columns, m0);
        });
        m0 += rows;
        next.step();
      }
    }
  });
  run_side(p.side, p.out, p.N);
}

// amx: avx512_vnni16, and at kAmxMinRows activation rows or more (prompt chunks, batched decode) the group dot
// products as AMX tile products. Each int16 activation code q splits exactly into a signed high and an unsigned low
// byte, q = 256 hi + lo; the tiles multiply each by the weight codes (int4: unsigned 0..15, int8: signed) over one
// group (16 activation rows x 32 bytes against 16 weight rows), and 256 C_hi + C_lo is the group's dot product,
// the same exact int32 as the other variants'. The scaled sums then run as AVX-512's, 16 weight rows per vector,
// so the outputs are within float32 rounding of the others'.
constexpr int64_t kAmxMinRows = 16;
constexpr int64_t kAmxTile = 16;           // activation rows, and weight rows, per tile
constexpr int64_t kAmxGroupBytes = 512;    // one group of 16 weight rows as the B tile: 8 rows of 4 codes x 16

// Whether this CPU and kernel run AMX int8 tile products: the CPU flags, then Linux's permission for the tile
// data state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process). Other kernels: no permission asked, no AMX.
bool amx_usable() {
#if defined(__linux__)
  static const bool usable = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

struct __attribute__((packed)) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One task's weight rows n0 .. n0+16 in the B tiles' layout (row kk of group g holds codes 4kk .. 4kk+3 of each
// weight row, 4 bytes per row: a 16 x 8 transpose of 32-bit words), their scales and (int4) mins per group as 16
// floats (rows past N: zero).
template <bool kInt4>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) void amx_weights(const Problem& p, int64_t n0, uint8_t* b,
                                                                            float* dw, float* mw) {
  const int64_t groups = p.groups, rows = std::min(kAmxTile, p.N - n0);
  alignas(64) uint8_t codes[kAmxTile * kGroup] = {};  // one group of each row, in element order
  const __m512i words = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(kGroup / 4));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* group = p.w + (n0 + r) * p.row_bytes + g * (kInt4 ? kGroup / 2 : kGroup);
      const __m256i row = kInt4 ? unpack_nibbles(group) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group));
      _mm256_store_si256(reinterpret_cast<__m256i*>(codes + r * kGroup), row);
    }
    for (int64_t kk = 0; kk < kGroup / 4; ++kk) {
      const __m512i column = _mm512_i32gather_epi32(_mm512_add_epi32(words, _mm512_set1_epi32(kk)), codes, 4);
      _mm512_store_si512(b + g * kAmxGroupBytes + kk * 64, column);
    }
  }
  std::fill_n(dw, groups * kAmxTile, 0.0f);
  std::fill_n(mw, groups * kAmxTile, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      dw[g * kAmxTile + r] = _cvtsh_ss(p.scales[(n0 + r) * groups + g]);
      if constexpr (kInt4) mw[g * kAmxTile + r] = _cvtsh_ss(p.mins[(n0 + r) * groups + g]);
    }
  }
}

// One group's tile products into C tiles 3 and 4 (..._0) or 5 and 6 (..._1), stored to c_hi and c_lo [16, 16]: hi
// and lo at the group's first code of the tile's first activation row (rows `stride` apart), b at its B tile; int4
// codes are unsigned (dpbsud: signed x unsigned, dpbuud), int8 codes signed (dpbssd, dpbusd). A macro: GCC's tile
// intrinsics paste the tile numbers into their assembly, so they must be literals.
#define TOKENMILL_AMX_GROUP(NAME, C_HI, C_LO, DP_HI, DP_LO)                                                    \
  __attribute__((target("amx-tile,amx-int8"), always_inline)) inline void NAME(                               \
      const int8_t* hi, const uint8_t* lo, int64_t stride, const uint8_t* b, int32_t* c_hi, int32_t* c_lo) { \
    _tile_loadd(0, hi, stride);                                                                                \
    _tile_loadd(1, lo, stride);                                                                                \
    _tile_loadd(2, b, 64);                                                                                     \
    _tile_zero(C_HI);                                                                                          \
    _tile_zero(C_LO);                                                                                          \
    DP_HI(C_HI, 0, 2);                                                                                         \
    DP_LO(C_LO, 1, 2);                                                                                         \
    _tile_stored(C_HI, c_hi, 64);                                                                              \
    _tile_stored(C_LO, c_lo, 64);                                                                              \
  }
TOKENMILL_AMX_GROUP(amx_int4_group_0, 3, 4, _tile_dpbsud, _tile_dpbuud)
TOKENMILL_AMX_GROUP(amx_int4_group_1, 5, 6, _tile_dpbsud, _tile_dpbuud)
TOKENMILL_AMX_GROUP(amx_int8_group_0, 3, 4, _tile_dpbssd, _tile_dpbusd)
TOKENMILL_AMX_GROUP(amx_int8_group_1, 5, 6, _tile_dpbssd, _tile_dpbusd)
#undef TOKENMILL_AMX_GROUP

template <bool kInt4, int kPair>
__attribute__((target("amx-tile,amx-int8"), always_inline)) inline void amx_group(const int8_t* hi, const uint8_t* lo,
                                                                                int64_t stride, const uint8_t* b,
                                                                                int32_t* c_hi, int32_t* c_lo) {
  if constexpr (kInt4 && kPair == 0) amx_int4_group_0(hi, lo, stride, b, c_hi, c_lo);
  if constexpr (kInt4 && kPair == 1) amx_int4_group_1(hi, lo, stride, b, c_hi, c_lo);
  if constexpr (!kInt4 && kPair == 0) amx_int8_group_0(hi, lo, stride, b, c_hi, c_lo);
  if constexpr (!kInt4 && kPair == 1) amx_int8_group_1(hi, lo, stride, b, c_hi, c_lo);
}

// Weight tiles begin .. end (16 weight rows each) against every activation row; `hi` and `lo` [M rounded up to
// 16, K] hold the codes' bytes.
template <bool kInt4>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c"))) void amx_task(
    const Problem& p, const int8_t* hi, const uint8_t* lo, int64_t begin, int64_t end) {
  const int64_t K = p.K, groups = p.groups;
  const float* xd = p.act->d.get();
  const float* sx = p.act->s.get();
  TileConfig config;
  for (int t : {0, 1}) config.rows[t] = kAmxTile, config.colsb[t] = kGroup;  // A: hi, lo
  config.rows[2] = kGroup / 4, config.colsb[2] = 64;                          // B: the weights' group
  for (int t : {3, 4, 5, 6}) config.rows[t] = kAmxTile, config.colsb[t] = 64;  // C: int32 [16, 16], twice
  _tile_loadconfig(&config);
  std::unique_ptr<uint8_t[], void (*)(uint8_t*)> b(
      static_cast<uint8_t*>(std::aligned_alloc(64, groups * kAmxGroupBytes)), [](uint8_t* ptr) { std::free(ptr); });
  TORCH_CHECK(b != nullptr, "out of memory for ", K, " weight codes");
  std::vector<float> dw(groups * kAmxTile), mw(groups * kAmxTile);
  alignas(64) int32_t c_hi[2][kAmxTile * kAmxTile], c_lo[2][kAmxTile * kAmxTile];
  for (int64_t t = begin; t < end; ++t) {
    const int64_t n0 = t * kAmxTile, columns = std::min(kAmxTile, p.N - n0);
    amx_weights<kInt4>(p, n0, b.get(), dw.data(), mw.data());
    const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1);
    const __m512 bias = p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + n0) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < p.M; m0 += kAmxTile) {
      const int64_t valid = std::min(kAmxTile, p.M - m0);
      __m512 acc[kAmxTile], mins[kAmxTile];
      for (int i = 0; i < kAmxTile; ++i) acc[i] = mins[i] = _mm512_setzero_ps();
      amx_group<kInt4, 0>(hi + m0 * K, lo + m0 * K, K, b.get(), c_hi[0], c_lo[0]);
      for (int64_t g = 0; g < groups; ++g) {
        // The next group's products run in the other pair of C tiles while this one's are scaled.
        if (g + 1 < groups) {
          const int64_t next = m0 * K + (g + 1) * kGroup;
          const uint8_t* next_b = b.get() + (g + 1) * kAmxGroupBytes;
          if (g % 2 == 0) {
            amx_group<kInt4, 1>(hi + next, lo + next, K, next_b, c_hi[1], c_lo[1]);
          } else {
            amx_group<kInt4, 0>(hi + next, lo + next, K, next_b, c_hi[0], c_lo[0]);
          }
        }
        const int32_t* group_hi = c_hi[g % 2];
        const int32_t* group_lo = c_lo[g % 2];
        const __m512 scale_w = _mm512_loadu_ps(dw.data() + g * kAmxTile);
        const __m512 min_w = _mm512_loadu_ps(mw.data() + g * kAmxTile);
        for (int64_t i = 0; i < valid; ++i) {
          const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(group_hi + i * kAmxTile), 8),
                                               _mm512_load_si512(group_lo + i * kAmxTile));
          const __m512 scale = _mm512_mul_ps(scale_w, _mm512_set1_ps(xd[(m0 + i) * groups + g]));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[i]);
          if constexpr (kInt4) mins[i] = _mm512_fmadd_ps(min_w, _mm512_set1_ps(sx[(m0 + i) * groups + g]), mins[i]);
        }
      }
      for (int64_t i = 0; i < valid; ++i) {
        const __m512 out = _mm512_add_ps(_mm512_add_ps(acc[i], mins[i]), bias);
        _mm512_mask_storeu_ps(p.out + (m0 + i) * p.N + n0, mask, out);
      }
    }
  }
  _tile_release();
}

// hi, lo [count] = the high (signed) and low (unsigned) bytes of the codes q [count], count a multiple of 32.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void split_codes(const int16_t* q, int64_t count, int8_t* hi,
                                                                      uint8_t* lo) {
  for (int64_t i = 0; i < count; i += 32) {
    const __m512i codes = _mm512_loadu_si512(q + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(codes, 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm512_cvtepi16_epi8(codes));  // truncates: q & 0xFF
  }
}

template <bool kInt4>
void run_amx(const Problem& p) {
  const int64_t K = p.K;
  const int64_t rows = (p.M + kAmxTile - 1) / kAmxTile * kAmxTile;
  // The codes' high (signed) and low (unsigned) bytes, [rows, K], rows past M zero.
  std::vector<int8_t> hi(rows * K, 0);
  std::vector<uint8_t> lo(rows * K, 0);
  split_codes(p.act->q.get(), p.M * K, hi.data(), lo.data());
  at::parallel_for(0, (p.N + kAmxTile - 1) / kAmxTile, 1,
                   [&](int64_t begin, int64_t end) { amx_task<kInt4>(p, hi.data(), lo.data(), begin, end); });
  run_side(p.side, p.out, p.N);
}

// Runs p's matmul on `isa`'s tiles (amx: AMX's tiles, for passes of at least kAmxMinRows rows). Only the variants
// this build compiles (cpu_common/isa.h) are instantiated; g_isa never picks another.
template <bool kInt4>
void run_on(const Problem& p, Isa isa, bool amx) {
  if constexpr (tokenmill::kBuildAmx) {
    if (amx) return run_amx<kInt4>(p);
  }
  switch (isa) {
    case Isa::kAvx512Vnni:
      if constexpr (!tokenmill::kBuildAvx512Vnni) {
        break;
      } else if (p.M >= column_min_rows(kInt4)) {
        run_columns<kInt4>(p);
      } else if constexpr (kInt4) {
        run<true, Nibbles<Avx512Vnni>>(p);
      } else {
        run<false, Avx512>(p);  // int8 weights under column_min_rows: Avx512's tiles
      }
      break;
    case Isa::kAvx512:
      if constexpr (tokenmill::kBuildAvx512) {
        if (kInt4 && p.M <= kNibbleMaxRows) {
          run<true, Nibbles<Avx512>>(p);
        } else {
          run<kInt4, Avx512>(p);
        }
      }
      break;
    case Isa::kAvxVnni:
      if constexpr (tokenmill::kBuildAvxVnni) {
        if (kInt4 && p.M <= kNibbleMaxRows) {
          run<true, Nibbles<AvxVnni>>(p);
        } else if (p.M >= kPairMinRows) {
          run_pairs<kInt4, AvxVnni>(p);
        } else {
          run<kInt4, AvxVnni>(p);
        }
      }
      break;
    default:
      if (kInt4 && p.M <= kNibbleMaxRows) {
        run<true, Nibbles<Avx2>>(p);
      } else if (p.M >= kPairMinRows) {
        run_pairs<kInt4, Avx2>(p);
      } else {
        run<kInt4, Avx2>(p);
      }
      break;
  }
}

// "torch.float32", as Python spells it (c10 would say "Float").
std::string dtype_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape,
                  const char* expected) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous() && t.device().is_cpu(),
                    name, " must be a contiguous ", dtype_name(dtype), " CPU tensor ", expected, " = ", shape,
                    ", got ", dtype_name(t.scalar_type()), " ", t.sizes(),
                    t.is_contiguous() ? "" : " (not contiguous)", " on ", t.device());
}

void check_activations(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x [M, K] must be 2-D, got ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK_VALUE(K > 0 && K % kGroup == 0, "K (in_features) must be a positive multiple of 32, got ", K);
  check_tensor(x, "x", at::kFloat, x.sizes(), "[M, K]");
}

// Every input is checked before each call (the kernels index raw pointers, so a wrong shape would read out of
// bounds); TORCH_CHECK_VALUE surfaces in Python as ValueError. Doing it here costs ~0.1 us instead of ~1 us in
// Python, which matters at ~200 calls per decoded token.
void check_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const at::Tensor* mins, const c10::optional<at::Tensor>& bias, at::ScalarType wtype,
                  int64_t codes_per_byte) {
  TORCH_CHECK_VALUE(x.dim() == 2 && qweight.dim() == 2, "x [M, K] and qweight must be 2-D, got ", x.sizes(),
                    " and ", qweight.sizes());
  check_activations(x);
  const int64_t K = x.size(1);
  const int64_t N = qweight.size(0);
  check_tensor(qweight, "qweight", wtype, {N, K / codes_per_byte}, codes_per_byte == 1 ? "[N, K]" : "[N, K / 2]");
  check_tensor(scales, "scales", at::kHalf, {N, K / kGroup}, "[N, K / 32]");
  if (mins != nullptr) check_tensor(*mins, "mins", at::kHalf, {N, K / kGroup}, "[N, K / 32]");
  if (bias.has_value()) check_tensor(*bias, "bias", at::kFloat, {N}, "[N]");
}

// Every AVX2 CPU has F16C too, but a virtual machine may hide it: fail here rather than on an illegal instruction.
void check_f16c() {
  static const bool has_f16c = __builtin_cpu_supports("f16c");
  TORCH_CHECK(has_f16c, "tokenmill's quantized matmul kernels need a CPU with F16C");
}

// Most activation rows one pass of the tiles takes. Each weight tile sweeps every row of its pass, so a pass's
// activation codes (int16, and their interleaved copy) must stay in L2: 2,048 rows at once ran 2.2-2.4x slower
// than in passes of 128 (int4; int8 1.2-1.4x). Larger inputs (prompt chunks) go in equal passes of at most this.
constexpr int64_t kRowsPerPass = 128;

// A quantized weight [N, K] as the tiles read it: int8 codes (mins null) or packed 4-bit codes, each row's
// float16 scales (and mins) per group of 32, and an optional bias [N].
struct QuantWeight {
  const uint8_t* w;
  int64_t row_bytes;
  const uint16_t* scales;
  const uint16_t* mins;
  const float* bias;
  int64_t N, K;
  bool int4() const { return mins != nullptr; }
};

QuantWeight quant_weight(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                         const float* bias) {
  return QuantWeight{static_cast<const uint8_t*>(qweight.data_ptr()),
                     qweight.size(1),
                     static_cast<const uint16_t*>(scales.data_ptr()),
                     mins != nullptr ? static_cast<const uint16_t*>(mins->data_ptr()) : nullptr,
                     bias,
                     qweight.size(0),
                     scales.size(1) * kGroup};
}

// out [M, N] = x [M, K] @ W.T (+ bias), for M, N > 0; `side` (or nullptr) runs once: in the one pass, or after.
void matmul_into(const float* x, int64_t M, const QuantWeight& w, float* out,
                 const tokenmill::SideWork* side = nullptr) {
  const int64_t K = w.K, N = w.N;
  const int64_t passes = (M + kRowsPerPass - 1) / kRowsPerPass;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t first = M * pass / passes, rows = M * (pass + 1) / passes - first;
    Isa isa = g_isa.get();
    const bool amx = isa == Isa::kAmx && rows >= kAmxMinRows;
    if (isa == Isa::kAmx) isa = Isa::kAvx512Vnni;  // amx is avx512_vnni16 but for amx's tiles
    Layout layout = Layout::kPlain;
    if ((isa == Isa::kAvx512 || isa == Isa::kAvx512Vnni) && w.int4() && rows <= kNibbleMaxRows) {
      layout = Layout::kNibbleQuads;
    }
    if ((isa == Isa::kAvx2 || isa == Isa::kAvxVnni) && rows >= kPairMinRows) layout = Layout::kPairs;
    if ((isa == Isa::kAvx2 || isa == Isa::kAvxVnni) && w.int4() && rows <= kNibbleMaxRows) {
      layout = Layout::kNibblePairs;
    }
    const QuantizedActivations act = quantize_activations(x + first * K, rows, K, layout);
    const Problem p{w.w, w.row_bytes, w.scales, w.mins, w.bias, &act, rows, N,
                    K, K / kGroup, out + first * N, passes == 1 ? side : nullptr};
    if (w.int4()) {
      run_on<true>(p, isa, amx);
    } else {
      run_on<false>(p, isa, amx);
    }
  }
  if (passes > 1) run_side(side, out, N);
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* mins,
                  const c10::optional<at::Tensor>& bias, const tokenmill::SideWork* side) {
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, qweight.size(0)}, x.options());
  if (M == 0 || qweight.size(0) == 0) return out;  // no columns for side work to add to
  check_f16c();
  matmul_into(x.data_ptr<float>(), M, quant_weight(qweight, scales, mins, bias ? bias->data_ptr<float>() : nullptr),
              out.data_ptr<float>(), side);
  return out;
}

at::Tensor matmul_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, const tokenmill::SideWork* side) {
  check_inputs(x, qweight, scales, nullptr, bias, at::kChar, 1);
  return matmul(x, qweight, scales, nullptr, bias, side);
}

at::Tensor matmul_int4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias, const tokenmill::SideWork* side) {
  check_inputs(x, qweight, scales, &mins, bias, at::kByte, 2);
  return matmul(x, qweight, scales, &mins, bias, side);
}

// A mixture-of-experts layer's routed experts in int8 or int4 (every expert's gate_up [2 * inner, hidden] and down
// [hidden, inner], no bias), checked once; apply runs a step's tokens through the experts they chose in one call.
// Pairs (token, expert) are grouped by expert, and each expert with pairs runs once over its tokens: gate_up,
// the activation times up, down, then each result scaled by its router weight and added to its token's row, in
// the order of TorchFusedExperts (experts in ascending order, tokens in order within each). So a step reads each
// chosen expert's weights once, and costs the host one call per layer instead of several per expert.
class Experts {
  // Rows of the activation per task: one thread up to this (a decode step's), both for a prompt's.
  static constexpr int64_t kActRowsPerTask = 16;

 public:
  Experts(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, bool gelu)
      : gate_up_(std::move(gate_up)), down_(std::move(down)), gelu_(gelu) {
    // Each list: per expert qweight, scales and (int4: uint8 codes) mins.
    const bool int4 = !gate_up_.empty() && gate_up_[0].scalar_type() == at::kByte;
    const size_t per = int4 ? 3 : 2;
    TORCH_CHECK_VALUE(!gate_up_.empty() && gate_up_.size() % per == 0 && down_.size() == gate_up_.size() &&
                          gate_up_[0].dim() == 2 && gate_up_[1].dim() == 2,
                      "gate_up and down must hold (qweight, scales", int4 ? ", mins" : "",
                      ") for each expert alike, got ", gate_up_.size(), " and ", down_.size(), " tensors");
    const int64_t codes_per_byte = int4 ? 2 : 1;
    const at::ScalarType wtype = int4 ? at::kByte : at::kChar;
    num_experts_ = static_cast<int64_t>(gate_up_.size() / per);
    two_inner_ = gate_up_[0].size(0);
    hidden_ = gate_up_[1].size(1) * kGroup;
    inner_ = two_inner_ / 2;
    TORCH_CHECK_VALUE(two_inner_ % 2 == 0 && inner_ % kGroup == 0 && hidden_ > 0,
                      "an expert's gate_up must have an even number of rows, each half a multiple of 32, got ",
                      two_inner_);
    for (int64_t e = 0; e < num_experts_; ++e) {
      const at::Tensor* gu = &gate_up_[e * per];
      const at::Tensor* dn = &down_[e * per];
      check_tensor(gu[0], "gate_up qweight", wtype, {two_inner_, hidden_ / codes_per_byte}, "[2 * inner, hidden]");
      check_tensor(gu[1], "gate_up scales", at::kHalf, {two_inner_, hidden_ / kGroup}, "[2 * inner, hidden / 32]");
      check_tensor(dn[0], "down qweight", wtype, {hidden_, inner_ / codes_per_byte}, "[hidden, inner]");
      check_tensor(dn[1], "down scales", at::kHalf, {hidden_, inner_ / kGroup}, "[hidden, inner / 32]");
      if (int4) {
        check_tensor(gu[2], "gate_up mins", at::kHalf, {two_inner_, hidden_ / kGroup}, "[2 * inner, hidden / 32]");
        check_tensor(dn[2], "down mins", at::kHalf, {hidden_, inner_ / kGroup}, "[hidden, inner / 32]");
      }
      gate_up_w_.push_back(quant_weight(gu[0], gu[1], int4 ? &gu[2] : nullptr, nullptr));
      down_w_.push_back(quant_weight(dn[0], dn[1], int4 ? &dn[2] : nullptr, nullptr));
    }
  }

  // sum over k of topk_weights[t, k] * expert[topk_ids[t, k]](x[t]) for each token t: [tokens, hidden]. An id of
  // -1 (an expert another shard holds) adds nothing.
  at::Tensor apply(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights) const {
    check_input(x);
    const int64_t M = x.size(0);
    TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == M, "topk_ids must be [", M, ", top_k], got ",
                      topk_ids.sizes());
    const int64_t top_k = topk_ids.size(1);
    check_tensor(topk_ids, "topk_ids", at::kLong, {M, top_k}, "[tokens, top_k]");
    check_tensor(topk_weights, "topk_weights", at::kFloat, {M, top_k}, "[tokens, top_k]");
    at::Tensor out = at::empty({M, hidden_}, x.options());
    if (M > 0) run(x.data_ptr<float>(), M, topk_ids.data_ptr<int64_t>(), topk_weights.data_ptr<float>(), top_k,
                   out.data_ptr<float>());
    return out;
  }

  // The same with the routing too, as tokenmill.layers.moe.select_experts computes it: router logits x @
  // router_weight.T (router_weight float32 [num_experts, hidden]), a softmax over the experts and the top_k largest,
  // renormalised to sum to one when asked (then the softmax of the top_k largest logits). Ties go to the lower id.
  at::Tensor apply_routed(const at::Tensor& x, const at::Tensor& router_weight, int64_t top_k, bool renormalize) const {
    check_input(x);
    check_tensor(router_weight, "router_weight", at::kFloat, {num_experts_, hidden_}, "[num_experts, hidden]");
    TORCH_CHECK_VALUE(top_k > 0 && top_k <= num_experts_, "top_k must be in 1..", num_experts_, ", got ", top_k);
    const int64_t M = x.size(0);
    at::Tensor out = at::empty({M, hidden_}, x.options());
    if (M == 0) return out;
    const float* xp = x.data_ptr<float>();
    const float* wp = router_weight.data_ptr<float>();
    std::vector<int64_t> ids(M * top_k);
    std::vector<float> weights(M * top_k), logits(num_experts_);
    std::vector<int64_t> rank(num_experts_);
    for (int64_t t = 0; t < M; ++t) {
      for (int64_t e = 0; e < num_experts_; ++e) logits[e] = dot(xp + t * hidden_, wp + e * hidden_, hidden_);
      for (int64_t e = 0; e < num_experts_; ++e) rank[e] = e;
      std::partial_sort(rank.begin(), rank.begin() + top_k, rank.end(),
                        [&](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
      // Over the top_k (renormalised) or every expert, shifted by the largest logit: rank[0]'s.
      const float largest = logits[rank[0]];
      float total = 0.0f;
      for (int64_t e = 0; e < (renormalize ? top_k : num_experts_); ++e)
        total += std::exp(logits[renormalize ? rank[e] : e] - largest);
      for (int64_t k = 0; k < top_k; ++k) {
        ids[t * top_k + k] = rank[k];
        weights[t * top_k + k] = std::exp(logits[rank[k]] - largest) / total;
      }
    }
    run(xp, M, ids.data(), weights.data(), top_k, out.data_ptr<float>());
    return out;
  }

 private:
  void check_input(const at::Tensor& x) const {
    check_activations(x);
    TORCH_CHECK_VALUE(x.size(1) == hidden_, "x has ", x.size(1), " columns, the experts take ", hidden_);
    check_f16c();
  }

  static float dot(const float* a, const float* b, int64_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
      for (int u = 0; u < 4; ++u)
        acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * u), _mm256_loadu_ps(b + i + 8 * u), acc[u]);
    for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
    float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < n; ++i) sum += a[i] * b[i];
    return sum;
  }

  // out [M, hidden] (uninitialised) = the weighted sum of each token's experts, for ids and weights [M, top_k].
  void run(const float* xp, int64_t M, const int64_t* ids, const float* weights, int64_t top_k, float* op) const {
    // The pairs grouped by expert (a counting sort: token order within each expert).
    std::vector<int64_t> start(num_experts_ + 1, 0);
    for (int64_t i = 0; i < M * top_k; ++i) {
      TORCH_CHECK_VALUE(ids[i] >= -1 && ids[i] < num_experts_, "token ", i / top_k, " chose expert ", ids[i], " of ",
                        num_experts_);
      if (ids[i] >= 0) ++start[ids[i] + 1];
    }
    int64_t most = 0;
    for (int64_t e = 0; e < num_experts_; ++e) {
      most = std::max(most, start[e + 1]);
      start[e + 1] += start[e];
    }
    std::vector<int64_t> pairs(start[num_experts_]);
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < M * top_k; ++i)
      if (ids[i] >= 0) pairs[next[ids[i]]++] = i;
    std::vector<char> written(M, 0);  // a token's first product is stored, the others added (as 0 + p, then + q)
    std::vector<float> rows(most > 1 ? most * hidden_ : 0), gate_up(most * two_inner_), act(most * inner_),
        down(most * hidden_);
    for (int64_t e = 0; e < num_experts_; ++e) {
      const int64_t count = start[e + 1] - start[e];
      if (count == 0) continue;
      const int64_t* mine = pairs.data() + start[e];
      const float* input = xp + (mine[0] / top_k) * hidden_;
      if (count > 1) {
        for (int64_t r = 0; r < count; ++r)
          std::copy_n(xp + (mine[r] / top_k) * hidden_, hidden_, rows.data() + r * hidden_);
        input = rows.data();
      }
      matmul_into(input, count, gate_up_w_[e], gate_up.data());
      at::parallel_for(0, count, kActRowsPerTask, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const float* g = gate_up.data() + r * two_inner_;
          if (gelu_) {
            tokenmill::gelu_tanh_and_mul_row(g, g + inner_, act.data() + r * inner_, inner_);
          } else {
            tokenmill::silu_and_mul_row(g, g + inner_, act.data() + r * inner_, inner_);
          }
        }
      });
      matmul_into(act.data(), count, down_w_[e], down.data());
      for (int64_t r = 0; r < count; ++r) {
        const int64_t token = mine[r] / top_k;
        const float weight = weights[mine[r]];
        const __m256 w = _mm256_set1_ps(weight);
        const float* from = down.data() + r * hidden_;
        float* to = op + token * hidden_;
        int64_t i = 0;
        if (written[token]) {  // as torch: the product rounded, then added
          for (; i + 8 <= hidden_; i += 8)
            _mm256_storeu_ps(to + i, _mm256_add_ps(_mm256_loadu_ps(to + i), _mm256_mul_ps(_mm256_loadu_ps(from + i), w)));
          for (; i < hidden_; ++i) to[i] += from[i] * weight;
        } else {
          for (; i + 8 <= hidden_; i += 8) _mm256_storeu_ps(to + i, _mm256_mul_ps(_mm256_loadu_ps(from + i), w));
          for (; i < hidden_; ++i) to[i] = from[i] * weight;
          written[token] = 1;
        }
      }
    }
    for (int64_t t = 0; t < M; ++t)
      if (!written[t]) std::fill_n(op + t * hidden_, hidden_, 0.0f);
  }

  std::vector<at::Tensor> gate_up_, down_;  // held: the weights' storage outlives every apply
  std::vector<QuantWeight> gate_up_w_, down_w_;
  bool gelu_;
  int64_t num_experts_ = 0, two_inner_ = 0, hidden_ = 0, inner_ = 0;
};

// The kernels' own activation codes, for testing them against reference.quantize_activations exactly.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations_op(const at::Tensor& x) {
  check_activations(x);
  const int64_t M = x.size(0);
  const int64_t K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kShort));
  at::Tensor d = at::empty({M, K / kGroup}, x.options());
  at::Tensor s = at::empty({M, K / kGroup}, x.options());
  if (M == 0) return {q, d, s};
  check_f16c();
  const QuantizedActivations act = quantize_activations(x.data_ptr<float>(), M, K);
  std::copy_n(act.q.get(), M * K, q.data_ptr<int16_t>());
  std::copy_n(act.d.get(), M * (K / kGroup), d.data_ptr<float>());
  std::copy_n(act.s.get(), M * (K / kGroup), s.data_ptr<float>());
  return {q, d, s};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Weight-only int8 / int4 quantized matmul (AVX2 + FMA + F16C, AVX-VNNI, AVX-512); see "
            "tokenmill_kernels.quant_matmul.";
  m.def(
      "matmul_int8",
      [](const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
         const c10::optional<at::Tensor>& bias) { return matmul_int8(x, qweight, scales, bias, nullptr); },
      "x [M,K] f32 @ int8 [N,K] (+ f16 scales [N,K/32]) -> [M,N] f32", py::arg("x"), py::arg("qweight"),
      py::arg("scales"), py::arg("bias") = py::none());
  m.def(
      "matmul_int4",
      [](const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
         const c10::optional<at::Tensor>& bias) { return matmul_int4(x, qweight, scales, mins, bias, nullptr); },
      "x [M,K] f32 @ packed 4-bit [N,K/2] (+ f16 scales, mins [N,K/32]) -> [M,N] f32", py::arg("x"),
      py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bias") = py::none());
  m.def("quantize_activations", &quantize_activations_op,
        "x [M,K] f32 -> the kernels' int16 codes [M,K], scales d and block sums s [M,K/32]", py::arg("x"));
  py::class_<Experts>(m, "Experts", "A MoE layer's int8 or int4 routed experts, checked once")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, bool>(), py::arg("gate_up"), py::arg("down"),
           py::arg("gelu"))
      .def("apply", &Experts::apply, "each token's chosen experts, weighted and summed: [tokens, hidden] f32",
           py::arg("x"), py::arg("topk_ids"), py::arg("topk_weights"))
      .def("apply_routed", &Experts::apply_routed, "the same, routed here: router logits, softmax and top-k",
           py::arg("x"), py::arg("router_weight"), py::arg("top_k"), py::arg("renormalize"));
  g_isa.def(m, "the variant matmul_* use now");
  static const tokenmill::QuantMatmulApi api{&matmul_int8, &matmul_int4};
  tokenmill::def_api(m, &api);
}
