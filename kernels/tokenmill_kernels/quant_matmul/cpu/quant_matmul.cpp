// Weight-only quantized matmul for x86-64 CPUs with AVX2 + FMA + F16C, and VNNI where the CPU has it.
//
//   y[m, n] = sum_k x[m, k] * W[n, k] + bias[n]
//
// W is stored per 32-element group along k, either as int8 (Q8_0: w = d * q) or as packed 4-bit codes
// (Q4_1: w = d * q + m). Decoding one token is bound by how fast the weights stream from memory, so the kernels
// read 5 (int4) or 8.5 (int8) bits per weight, float16 scales and mins included, instead of 32. Each activation
// row is quantized to int8 per 32-block so that the block dot products are integer dot products (unsigned x
// signed bytes), scaled once per block. reference.py defines the formats and the numerics exactly; these kernels
// differ from it only in the order of the float32 sums.
//
// The file builds with -mavx2 -mfma -mf16c. The block dot products come in one variant per instruction set
// (struct Avx2, AvxVnni, Avx512Vnni below), picked at run time from the CPU's features; the VNNI ones are
// compiled with __attribute__((target)) so they are only ever executed on CPUs that have them. Integer dot
// products are exact and every variant performs the same float32 operations in the same order, so all give
// bit-identical outputs; set_isa forces one (for tests and benchmarks).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace {

// The tiles index small arrays of registers with compile-time bounds; unrolled, they stay in registers.
#define UNROLL _Pragma("GCC unroll 8")

constexpr int64_t kGroup = 32;
// Weight rows that share each activation load, and activation rows that share each weight load: 2 x 4 = 8
// accumulators plus operands fit the 16 ymm registers for int4 (int8 spills a few, yet 1 x 4 measured slower).
constexpr int64_t kWeightTile = 2;
constexpr int64_t kActTile = 4;
// Software prefetch distance along a task's weight rows. The hardware prefetcher alone leaves the single-row
// (decode) case waiting on memory latency at well under the machine's bandwidth.
constexpr int64_t kPrefetchBytes = 8192;
// Below this many weight bytes a task is not worth handing to another thread (fork/join costs a few us).
constexpr int64_t kMinBytesPerTask = 32 * 1024;
// Groups whose scale products a tile computes ahead of their dot products (2 KB of stack for a 2 x 4 tile).
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

// Activations quantized per 32-block: q int8 [M, K], d = absmax / 127 and s = d * sum(q), both [M, K / 32].
struct QuantizedActivations {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d;
  std::unique_ptr<float[]> s;
};

void quantize_block(const float* x, int8_t* q, float* d_out, float* s_out) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
  }
  // Same float32 operations as reference.quantize_activations, so the codes match it exactly.
  const float d = hmax(amax) / 127.0f;
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3])));
  // The saturating packs work within 128-bit lanes and leave the 4-byte runs in the order 0 2 4 6 1 3 5 7.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
}

QuantizedActivations quantize_activations(const float* x, int64_t M, int64_t K) {
  const int64_t groups = K / kGroup;
  // Plain new[]: every element is written below, so the zero-fill of make_unique would be a wasted pass.
  QuantizedActivations a{std::unique_ptr<int8_t[]>(new int8_t[M * K]), std::unique_ptr<float[]>(new float[M * groups]),
                         std::unique_ptr<float[]>(new float[M * groups])};
  const int64_t grain = std::max<int64_t>(1, 16384 / K);  // rows per task: cheap work, only split big batches
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * groups; i < end * groups; ++i) {
      quantize_block(x + i * kGroup, a.q.get() + i * kGroup, a.d.get() + i, a.s.get() + i);
    }
  });
  return a;
}

// The 32 codes of one Q4_1 group in element order: byte j holds element j (low nibble) and j + 16 (high nibble).
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  // The 16-bit shift drags the next byte's low bits into each high nibble; the mask drops them.
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

struct Problem {
  const uint8_t* w;     // row n starts at w + n * row_bytes
  int64_t row_bytes;    // K for int8, K / 2 for int4
  const uint16_t* scales;  // float16 bits [N, groups]
  const uint16_t* mins;    // float16 bits [N, groups], int4 only
  const float* bias;    // [N] or nullptr
  const QuantizedActivations* act;
  int64_t M, N, K, groups;
  float* out;  // [M, N]
};

// out[m0 .. m0+MR, n0 .. n0+NR] for one tile: NR weight rows against MR activation rows. `prefetch` asks for
// the weight stream kPrefetchBytes ahead to be requested; only the first activation tile of a row group streams
// from memory (the others find the rows in L1), and only while the target is still inside this task's rows.
// Inlined into each Isa's tile entry point, which compiles it for that instruction set.
template <bool kInt4, int NR, int MR, class Isa>
inline void tile_body(const Problem& p, int64_t n0, int64_t m0, bool prefetch) {
  const int64_t groups = p.groups;
  const int8_t* xq = p.act->q.get() + m0 * p.K;
  const float* xd = p.act->d.get() + m0 * groups;
  const uint8_t* w = p.w + n0 * p.row_bytes;
  const uint16_t* wd = p.scales + n0 * groups;
  constexpr int64_t kGroupBytes = kInt4 ? kGroup / 2 : kGroup;
  constexpr int64_t kGroupsPerLine = 64 / kGroupBytes;

  __m256 acc[NR][MR];
  UNROLL
  for (int r = 0; r < NR; ++r) {
    UNROLL
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  float scale[NR][MR][kScaleChunk];  // dw[n0 + r, g] * dx[m0 + i, g] for the chunk's groups
  for (int64_t g0 = 0; g0 < groups; g0 += kScaleChunk) {
    const int64_t g_end = std::min(g0 + kScaleChunk, groups);
    // The scale products ahead of the dot products, 8 groups per F16C conversion and multiply instead of one
    // multiply per group in the loop below; each product is the same float32 dw * dx either way. The last 8
    // may overlap the previous 8 (the same products again), so only chunks under 8 groups go one by one.
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

    for (g = g0; g < g_end; ++g) {
      // The dot products multiply unsigned by signed bytes: int4 codes are already unsigned; for int8 the
      // weight's sign is moved onto the activation (|w| * sign(w) x), which cannot overflow as both lie in
      // [-127, 127].
      __m256i wu[NR];
      __m256i ws[NR];
      UNROLL
      for (int r = 0; r < NR; ++r) {
        const uint8_t* src = w + r * p.row_bytes + g * kGroupBytes;
        if (prefetch && g % kGroupsPerLine == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(src) + kPrefetchBytes, _MM_HINT_T0);
        }
        if constexpr (kInt4) {
          wu[r] = unpack_nibbles(src);
        } else {
          ws[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          wu[r] = _mm256_abs_epi8(ws[r]);
        }
      }
      UNROLL
      for (int i = 0; i < MR; ++i) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * p.K + g * kGroup));
        // Keeps x in a register: the compiler would fold the load into each of the NR dot products, and loads
        // limit this loop (measured 5% faster at M = 32).
        __asm__("" : "+x"(x));
        UNROLL
        for (int r = 0; r < NR; ++r) {
          __m256i xs;
          if constexpr (kInt4) {
            xs = x;
          } else {
            xs = _mm256_sign_epi8(x, ws[r]);
          }
          const __m256i dot = Isa::dot(wu[r], xs);
          const __m256 dw_dx = _mm256_broadcast_ss(&scale[r][i][g - g0]);
          acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dw_dx, acc[r][i]);
        }
      }
    }
  }

  float tail[NR][MR] = {};
  if constexpr (kInt4) {
    // Q4_1's min term: sum_g m[n, g] * sx[m, g], eight groups at a time into acc and the rest one by one. The
    // groups are the outer loop so that each block's mins are converted once and the tile stays unrolled.
    const uint16_t* wm = p.mins + n0 * groups;
    const float* sx = p.act->s.get() + m0 * groups;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      UNROLL
      for (int r = 0; r < NR; ++r) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + r * groups + g)));
        UNROLL
        for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sx + i * groups + g), acc[r][i]);
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
    for (int i = 0; i < MR; ++i) p.out[(m0 + i) * p.N + n] = hsum(acc[r][i]) + tail[r][i] + b;
  }
}

// The block dot product per instruction set: 8 int32 lanes, lane l = sum of the products of bytes 4l .. 4l+3
// (unsigned u times signed s). The lanes are the same in every variant, so the float32 math after them is too.
// Each `tile` is the entry point compiled for its instruction set; `flatten` inlines tile_body and everything
// it calls into it, so the VNNI intrinsics are only ever inlined into code built for VNNI.
struct Avx2 {
  static inline __m256i dot(__m256i u, __m256i s) {
    // Pairs of products fit int16 (<= 2 * 127 * 127); vpmaddwd with ones sums them to 8 int32 lanes.
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten)) static void tile(const Problem& p, int64_t n0, int64_t m0, bool prefetch) {
    tile_body<kInt4, NR, MR, Avx2>(p, n0, m0, prefetch);
  }
};

// AVX-VNNI (Alder Lake, Zen 4 and later): one vpdpbusd replaces vpmaddubsw + vpmaddwd.
struct AvxVnni {
  __attribute__((target("avxvnni"))) static inline __m256i dot(__m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
  }
  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten, target("avxvnni"))) static void tile(const Problem& p, int64_t n0, int64_t m0,
                                                                        bool prefetch) {
    tile_body<kInt4, NR, MR, AvxVnni>(p, n0, m0, prefetch);
  }
};

// AVX512-VNNI (Cascade Lake, Ice Lake, Zen 4) on 256-bit vectors: the same vpdpbusd, EVEX-encoded, and the
// compiler gets 32 vector registers instead of 16.
#define AVX512_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
struct Avx512Vnni {
  __attribute__((target(AVX512_VNNI_TARGET))) static inline __m256i dot(__m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
  }
  template <bool kInt4, int NR, int MR>
  __attribute__((noinline, flatten, target(AVX512_VNNI_TARGET))) static void tile(const Problem& p, int64_t n0,
                                                                                 int64_t m0, bool prefetch) {
    tile_body<kInt4, NR, MR, Avx512Vnni>(p, n0, m0, prefetch);
  }
};

enum class Isa { kAvx2, kAvxVnni, kAvx512Vnni };
constexpr const char* kIsaNames[] = {"avx2", "avx_vnni", "avx512_vnni"};  // indexed by Isa; as /proc/cpuinfo

// What this CPU (and OS, for the AVX-512 state) supports, best last; AVX2 + FMA is checked before the build,
// F16C (which every AVX2 CPU has) by matmul.
std::vector<Isa> supported_isas() {
  std::vector<Isa> isas{Isa::kAvx2};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avxvnni")) isas.push_back(Isa::kAvxVnni);
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw")) {
    isas.push_back(Isa::kAvx512Vnni);
  }
  return isas;
}

Isa best_isa() {
  const std::vector<Isa> isas = supported_isas();
  return isas.back();
}

std::atomic<Isa> g_isa{best_isa()};  // what matmul_* run; set_isa changes it

// Rows n0 .. n0+NR against every activation row, kActTile rows at a time and then the 1..kActTile-1 left over.
template <bool kInt4, int NR, class I>
void row_group(const Problem& p, int64_t n0, bool prefetch) {
  int64_t m0 = 0;
  for (; m0 + kActTile <= p.M; m0 += kActTile) {
    I::template tile<kInt4, NR, kActTile>(p, n0, m0, prefetch && m0 == 0);
  }
  prefetch = prefetch && m0 == 0;
  switch (p.M - m0) {
    case 3:
      I::template tile<kInt4, NR, 3>(p, n0, m0, prefetch);
      break;
    case 2:
      I::template tile<kInt4, NR, 2>(p, n0, m0, prefetch);
      break;
    case 1:
      I::template tile<kInt4, NR, 1>(p, n0, m0, prefetch);
      break;
    default:
      break;
  }
}

template <bool kInt4, class I>
void run(const Problem& p) {
  static_assert(kActTile == 4, "row_group handles tails of up to 3 activation rows");
  // Tasks are ranges of row groups, so only the last group of the whole matrix can be short.
  const int64_t row_groups = (p.N + kWeightTile - 1) / kWeightTile;
  const int64_t scale_bytes = p.groups * static_cast<int64_t>(sizeof(uint16_t)) * (kInt4 ? 2 : 1);
  const int64_t group_bytes = kWeightTile * (p.row_bytes + scale_bytes);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / group_bytes);
  at::parallel_for(0, row_groups, grain, [&](int64_t begin, int64_t end) {
    const int64_t n_end = std::min(end * kWeightTile, p.N);
    const int64_t prefetch_rows = (kPrefetchBytes + p.row_bytes - 1) / p.row_bytes;
    for (int64_t n0 = begin * kWeightTile; n0 < n_end; n0 += kWeightTile) {
      const bool prefetch = n0 + kWeightTile + prefetch_rows <= n_end;
      if (n0 + kWeightTile <= n_end) {
        row_group<kInt4, kWeightTile, I>(p, n0, prefetch);
      } else {
        for (int64_t n = n0; n < n_end; ++n) row_group<kInt4, 1, I>(p, n, false);
      }
    }
  });
}

template <bool kInt4>
void run_on(const Problem& p, Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni:
      run<kInt4, Avx512Vnni>(p);
      break;
    case Isa::kAvxVnni:
      run<kInt4, AvxVnni>(p);
      break;
    default:
      run<kInt4, Avx2>(p);
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

// Every input is checked before each call (the kernels index raw pointers, so a wrong shape would read out of
// bounds); TORCH_CHECK_VALUE surfaces in Python as ValueError. Doing it here costs ~0.1 us instead of ~1 us in
// Python, which matters at ~200 calls per decoded token.
void check_inputs(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const at::Tensor* mins, const c10::optional<at::Tensor>& bias, at::ScalarType wtype,
                  int64_t codes_per_byte) {
  TORCH_CHECK_VALUE(x.dim() == 2 && qweight.dim() == 2, "x [M, K] and qweight must be 2-D, got ", x.sizes(),
                    " and ", qweight.sizes());
  const int64_t K = x.size(1);
  const int64_t N = qweight.size(0);
  TORCH_CHECK_VALUE(K > 0 && K % kGroup == 0, "K (in_features) must be a positive multiple of 32, got ", K);
  check_tensor(x, "x", at::kFloat, x.sizes(), "[M, K]");
  check_tensor(qweight, "qweight", wtype, {N, K / codes_per_byte}, codes_per_byte == 1 ? "[N, K]" : "[N, K / 2]");
  check_tensor(scales, "scales", at::kHalf, {N, K / kGroup}, "[N, K / 32]");
  if (mins != nullptr) check_tensor(*mins, "mins", at::kHalf, {N, K / kGroup}, "[N, K / 32]");
  if (bias.has_value()) check_tensor(*bias, "bias", at::kFloat, {N}, "[N]");
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const uint16_t* mins,
                  const c10::optional<at::Tensor>& bias, bool int4) {
  const int64_t M = x.size(0);
  const int64_t K = x.size(1);
  const int64_t N = qweight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // Every AVX2 CPU has F16C too, but a virtual machine may hide it: fail here rather than on an illegal instruction.
  static const bool has_f16c = __builtin_cpu_supports("f16c");
  TORCH_CHECK(has_f16c, "tokenmill's quantized matmul kernels need a CPU with F16C");
  const QuantizedActivations act = quantize_activations(x.data_ptr<float>(), M, K);
  const Problem p{static_cast<const uint8_t*>(qweight.data_ptr()),
                  qweight.size(1),
                  static_cast<const uint16_t*>(scales.data_ptr()),
                  mins,
                  bias.has_value() ? bias->data_ptr<float>() : nullptr,
                  &act,
                  M,
                  N,
                  K,
                  K / kGroup,
                  out.data_ptr<float>()};
  const Isa isa = g_isa.load(std::memory_order_relaxed);
  if (int4) {
    run_on<true>(p, isa);
  } else {
    run_on<false>(p, isa);
  }
  return out;
}

at::Tensor matmul_int8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  check_inputs(x, qweight, scales, nullptr, bias, at::kChar, 1);
  return matmul(x, qweight, scales, nullptr, bias, /*int4=*/false);
}

at::Tensor matmul_int4(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  check_inputs(x, qweight, scales, &mins, bias, at::kByte, 2);
  return matmul(x, qweight, scales, static_cast<const uint16_t*>(mins.data_ptr()), bias, /*int4=*/true);
}

std::vector<std::string> supported_isa_names() {
  std::vector<std::string> names;
  for (Isa isa : supported_isas()) names.emplace_back(kIsaNames[static_cast<int>(isa)]);
  return names;
}

std::string isa_name() { return kIsaNames[static_cast<int>(g_isa.load())]; }

void set_isa(const std::string& name) {
  const std::vector<Isa> isas = supported_isas();
  if (name == "auto") {
    g_isa = isas.back();
    return;
  }
  for (Isa isa : isas) {
    if (name == kIsaNames[static_cast<int>(isa)]) {
      g_isa = isa;
      return;
    }
  }
  std::string known;
  for (const std::string& n : supported_isa_names()) known += ", " + n;
  TORCH_CHECK_VALUE(false, "isa must be \"auto\" or one this CPU supports (", known.substr(2), "), got \"", name,
                    "\"");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Weight-only int8 / int4 quantized matmul (AVX2 + FMA + F16C, VNNI); see tokenmill.kernels.quant_matmul.";
  m.def("matmul_int8", &matmul_int8, "x [M,K] f32 @ int8 [N,K] (+ f16 scales [N,K/32]) -> [M,N] f32", py::arg("x"),
        py::arg("qweight"), py::arg("scales"), py::arg("bias") = py::none());
  m.def("matmul_int4", &matmul_int4, "x [M,K] f32 @ packed 4-bit [N,K/2] (+ f16 scales, mins [N,K/32]) -> [M,N] f32",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bias") = py::none());
  m.def("supported_isas", &supported_isa_names, "the dot-product variants this CPU can run, best last");
  m.def("isa", &isa_name, "the variant matmul_* use now");
  m.def("set_isa", &set_isa, "use this variant from now on (\"auto\": the best supported)", py::arg("name"));
}
