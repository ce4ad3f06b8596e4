// Dense float32 matmul for x86-64 CPUs with AVX2 + FMA, and AVX-512 where present.
//
//   y[m, n] = sum_k x[m, k] * W[n, k] + bias[n]
//
// W is packed once into panels of 32 outputs, k-major: packed[p, k, j] = W[32 p + j, k] (zero past N). A tile
// multiplies up to kMaxRows activation rows by one panel: per k it loads the panel's 32 weights (128 contiguous
// bytes), broadcasts each row's x[m, k] and adds their products into 2 x rows accumulator registers, so each weight
// is read from memory once for all the rows. A decode step of one request (1 row) then streams the weights at the
// memory's speed, and a verification step of a few speculative tokens (2-12 rows) costs little more; oneDNN's
// packed linear, which this replaces, does not.
//
// Large inputs (prefill) are blocked twice: rows in blocks whose activations stay in L2/L3 while every panel passes
// over them, and k in chunks whose panel slice stays in L2 while every row tile of the block passes over it.
//
// The file builds with -mavx2 -mfma. The avx512 tiles are compiled with __attribute__((target)) and only ever run on
// CPUs that have AVX-512F; set_isa forces a variant (for tests and benchmarks). Both sum each output's products in
// the same order (below), so the two variants give bit-identical outputs.
//
// Products are summed in k order with fused multiply-adds within blocks of kSumBlock k, and the blocks' sums are
// added in k order: float32 rounding then grows with the block and the number of blocks rather than with K. One
// running sum over all of K left the default model's float logits further from float64 than MKL's sgemm
// (docs/benchmarks.md, "Dense float32 sums in blocks of k").

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_common/extension.h"
#include "cpu_common/isa.h"

namespace {

#define UNROLL _Pragma("GCC unroll 16")

// Outputs per panel: two 512-bit registers, four 256-bit ones.
constexpr int64_t kPanel = 32;
// Software prefetch distance along a panel. The hardware prefetcher alone leaves the one-row case waiting on memory
// latency below the machine's bandwidth (as in quant_matmul.cpp).
constexpr int64_t kPrefetchBytes = 16384;
// A panel slice of at most this many k (256 KB) is reused from L2 by every row tile of a block.
constexpr int64_t kMaxChunk = 2048;
// Activation bytes per row block: they stay in cache while every panel passes over them.
constexpr int64_t kRowBlockBytes = 1 << 20;
// Below this many weight bytes a task is not worth handing to another thread (fork/join costs a few us).
constexpr int64_t kMinBytesPerTask = 32 * 1024;
// k per block whose products a register sums before the block's sum joins the others (see the top).
constexpr int64_t kSumBlock = 64;

struct Problem {
  const float* x;     // [M, K]
  const float* w;     // [num_panels, K, kPanel]
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t M, N, K;
};

// The outputs of one tile: rows m0 .. m0 + MR of panel `panel`, from k0 .. k0 + kn, added to what y holds when
// `accumulate` (a later k chunk), plus the bias on the last chunk.
struct Slice {
  int64_t panel, m0, k0, kn;
  bool accumulate, last;
};

// AVX-512: MR rows x 32 outputs in 2 x MR zmm accumulators (24 of the 32 registers at MR = 12).
struct Avx512 {
  static constexpr int kMaxRows = 12;

  template <int MR>
  __attribute__((noinline, target("avx512f"))) static void tile(const Problem& p, const Slice& s) {
    const float* w = p.w + (s.panel * p.K + s.k0) * kPanel;
    const float* x = p.x + s.m0 * p.K + s.k0;
    alignas(64) float sums[MR][kPanel] = {};  // the blocks' sums so far, in memory: the registers hold a block's
    for (int64_t kb = 0; kb < s.kn; kb += kSumBlock) {
      __m512 acc[MR][2];
      UNROLL for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
      for (int64_t k = kb, ke = std::min(s.kn, kb + kSumBlock); k < ke; ++k, w += kPanel) {
        _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        UNROLL for (int m = 0; m < MR; ++m) {
          const __m512 xb = _mm512_set1_ps(x[m * p.K + k]);
          acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
        }
      }
      UNROLL for (int m = 0; m < MR; ++m) {
        _mm512_store_ps(sums[m], _mm512_add_ps(_mm512_load_ps(sums[m]), acc[m][0]));
        _mm512_store_ps(sums[m] + 16, _mm512_add_ps(_mm512_load_ps(sums[m] + 16), acc[m][1]));
      }
    }
    const int64_t n0 = s.panel * kPanel, valid = std::min(kPanel, p.N - n0);
    const __mmask16 mask0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    const __mmask16 mask1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (s.last && p.bias != nullptr) {
      b0 = _mm512_maskz_loadu_ps(mask0, p.bias + n0);
      b1 = _mm512_maskz_loadu_ps(mask1, p.bias + n0 + 16);
    }
    UNROLL for (int m = 0; m < MR; ++m) {
      float* y = p.y + (s.m0 + m) * p.N + n0;
      __m512 y0 = _mm512_add_ps(_mm512_load_ps(sums[m]), b0), y1 = _mm512_add_ps(_mm512_load_ps(sums[m] + 16), b1);
      if (s.accumulate) {
        y0 = _mm512_add_ps(_mm512_maskz_loadu_ps(mask0, y), y0);
        y1 = _mm512_add_ps(_mm512_maskz_loadu_ps(mask1, y + 16), y1);
      }
      _mm512_mask_storeu_ps(y, mask0, y0);
      _mm512_mask_storeu_ps(y + 16, mask1, y1);
    }
  }
};

// AVX2: up to 3 rows x the whole panel in 4 x MR ymm accumulators (12 of the 16 registers), one pass over the
// weights as avx512's.
struct Avx2 {
  static constexpr int kMaxRows = 3;

  template <int MR>
  __attribute__((noinline)) static void tile(const Problem& p, const Slice& s) {
    const float* w = p.w + (s.panel * p.K + s.k0) * kPanel;
    const float* x = p.x + s.m0 * p.K + s.k0;
    alignas(32) float sums[MR][kPanel] = {};  // as avx512's
    for (int64_t kb = 0; kb < s.kn; kb += kSumBlock) {
      __m256 acc[MR][4];
      UNROLL for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = _mm256_setzero_ps();
      for (int64_t k = kb, ke = std::min(s.kn, kb + kSumBlock); k < ke; ++k, w += kPanel) {
        _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + 64, _MM_HINT_T0);
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), w2 = _mm256_loadu_ps(w + 16),
                     w3 = _mm256_loadu_ps(w + 24);
        UNROLL for (int m = 0; m < MR; ++m) {
          const __m256 xb = _mm256_broadcast_ss(x + m * p.K + k);
          acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
          acc[m][2] = _mm256_fmadd_ps(w2, xb, acc[m][2]);
          acc[m][3] = _mm256_fmadd_ps(w3, xb, acc[m][3]);
        }
      }
      UNROLL for (int m = 0; m < MR; ++m) {
        for (int j = 0; j < 4; ++j) {
          _mm256_store_ps(sums[m] + 8 * j, _mm256_add_ps(_mm256_load_ps(sums[m] + 8 * j), acc[m][j]));
        }
      }
    }
    const int64_t n0 = s.panel * kPanel, valid = std::min(kPanel, p.N - n0);
    alignas(32) float bias[kPanel] = {};
    if (s.last && p.bias != nullptr) std::copy_n(p.bias + n0, valid, bias);
    UNROLL for (int m = 0; m < MR; ++m) {
      alignas(32) float out[kPanel];
      for (int j = 0; j < 4; ++j) {
        _mm256_store_ps(out + 8 * j, _mm256_add_ps(_mm256_load_ps(sums[m] + 8 * j), _mm256_load_ps(bias + 8 * j)));
      }
      float* y = p.y + (s.m0 + m) * p.N + n0;
      // Same order as the avx512 tile: (products + bias) + what earlier chunks left.
      if (s.accumulate) {
        for (int64_t j = 0; j < valid; ++j) y[j] = y[j] + out[j];
      } else {
        std::copy_n(out, valid, y);
      }
    }
  }
};

template <class I, int MR = I::kMaxRows>
void run_tile(const Problem& p, const Slice& s, int64_t rows) {
  if constexpr (MR > 1) {
    if (rows < MR) return run_tile<I, MR - 1>(p, s, rows);
  }
  I::template tile<MR>(p, s);
}

template <class I>
void matmul(const Problem& p) {
  const int64_t num_panels = (p.N + kPanel - 1) / kPanel;
  const int64_t num_chunks = (p.K + kMaxChunk - 1) / kMaxChunk;
  const int64_t block_rows = std::max<int64_t>(I::kMaxRows, kRowBlockBytes / (p.K * 4));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / (p.K * kPanel * 4));
  for (int64_t b0 = 0; b0 < p.M; b0 += block_rows) {
    const int64_t rows = std::min(block_rows, p.M - b0);
    // As few tiles as fit, as even as can be: 9 rows run as one tile of 9 (avx512), 13 as 7 + 6, not 12 + 1.
    const int64_t num_tiles = (rows + I::kMaxRows - 1) / I::kMaxRows;
    at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t panel = begin; panel < end; ++panel) {
        for (int64_t c = 0; c < num_chunks; ++c) {
          const int64_t k0 = p.K * c / num_chunks, k1 = p.K * (c + 1) / num_chunks;
          for (int64_t t = 0; t < num_tiles; ++t) {
            const int64_t m0 = b0 + rows * t / num_tiles, m1 = b0 + rows * (t + 1) / num_tiles;
            run_tile<I>(p, Slice{panel, m0, k0, k1 - k0, c > 0, c == num_chunks - 1}, m1 - m0);
          }
        }
      }
    });
  }
}

enum class Isa { kAvx2, kAvx512 };

// What linear runs; set_isa changes it. The variants this CPU (and OS, for the AVX-512 state) supports, best last;
// AVX2 + FMA is checked before the build.
tokenmill::IsaChoice<Isa> g_isa({"avx2", "avx512"}, [] {
  std::vector<Isa> isas{Isa::kAvx2};
  if (tokenmill::kBuildAvx512 && __builtin_cpu_supports("avx512f")) isas.push_back(Isa::kAvx512);
  return isas;
});

at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
                    "weight must be a 2-D float32 CPU tensor [N, K], got ", weight.scalar_type(), " ",
                    weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), num_panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK_VALUE(N > 0 && K > 0, "weight must not be empty, got ", weight.sizes());
  auto packed = at::zeros({num_panels, K, kPanel}, weight.options());
  const int64_t full = N / kPanel;
  if (full > 0) packed.narrow(0, 0, full).copy_(weight.narrow(0, 0, full * kPanel).reshape({full, kPanel, K}).transpose(1, 2));
  if (N % kPanel != 0) packed[full].narrow(1, 0, N % kPanel).copy_(weight.narrow(0, full * kPanel, N % kPanel).t());
  return packed;
}

// Inputs are checked here rather than in Python: it costs ~0.1 us instead of ~1 us per call, and
// TORCH_CHECK_VALUE surfaces in Python as ValueError.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
                    "x must be a contiguous 2-D float32 CPU tensor [M, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK_VALUE(N > 0 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                        packed.device().is_cpu() && packed.sizes() == at::IntArrayRef({num_panels, K, kPanel}),
                    "packed must be pack(weight) of a float32 weight [", N, ", ", K, "], i.e. [", num_panels, ", ", K,
                    ", ", kPanel, "], got ", packed.scalar_type(), " ", packed.sizes());
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    const at::Tensor& b = *bias;
    TORCH_CHECK_VALUE(b.scalar_type() == at::kFloat && b.is_contiguous() && b.device().is_cpu() &&
                          b.sizes() == at::IntArrayRef({N}),
                      "bias must be a contiguous float32 CPU tensor [", N, "], got ", b.scalar_type(), " ", b.sizes());
    bias_ptr = b.data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Problem p{x.data_ptr<float>(), packed.data_ptr<float>(), bias_ptr, y.data_ptr<float>(), M, N, K};
  if constexpr (tokenmill::kBuildAvx512) {
    if (g_isa.get() == Isa::kAvx512) {
      matmul<Avx512>(p);
      return y;
    }
  }
  matmul<Avx2>(p);
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("pack", &pack, "float32 weight [N, K] -> panels [ceil(N/32), K, 32]", py::arg("weight"));
  m.def("linear", &linear, "x [M, K] f32 @ W.T (+ bias) -> [M, N] f32, W given as pack(W)", py::arg("x"),
        py::arg("packed"), py::arg("N"), py::arg("bias") = py::none());
  g_isa.def(m, "the variant linear uses now");
}
