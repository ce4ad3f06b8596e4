// CPU LoRA kernel (AVX2, FMA, F16C): one adapted linear's shrink and expand for a batch whose tokens use
// different adapters, in one call. Activations and outputs are float32; adapter weights float32, float16 or
// bfloat16 (--lora-dtype), widened to float32 as they are read.
//
// In torch a linear costs per adapter in the step an index, a matmul, and per part a matmul and an index_add;
// at one token, or a few tokens per adapter, those dispatches are the whole cost. Here the tokens are grouped by
// adapter into blocks of up to kBlock, and each block reads its adapter's A rows (stored [rank, in]) and B rows
// (stored [rank, out]) once for all its tokens. Blocks split across torch's threads.

#include <immintrin.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "cpu_common/extension.h"

namespace {

constexpr int kBlock = 4;

template <typename W>
struct Widen;

template <>
struct Widen<float> {
  static __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
  static float one(const float* p) { return *p; }
};

template <>
struct Widen<at::Half> {
  static __m256 eight(const at::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static float one(const at::Half* p) { return static_cast<float>(*p); }
};

template <>
struct Widen<at::BFloat16> {
  static __m256 eight(const at::BFloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static float one(const at::BFloat16* p) { return static_cast<float>(*p); }
};

float horizontal_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

// h[t * h_stride + j] = a[j] . x[t] for j < rows and the block's N tokens: each row of A is read once for all of them. One token
// keeps four partial sums, so its chain of multiply-adds does not wait on itself.
template <typename W, int N>
void shrink(const W* a, int64_t rows, int64_t in, const float* const* x, float* h, int64_t h_stride) {
  constexpr int kSums = N == 1 ? 4 : 1;
  for (int64_t j = 0; j < rows; ++j) {
    const W* row = a + j * in;
    __m256 acc[N][kSums];
    for (int t = 0; t < N; ++t)
      for (int u = 0; u < kSums; ++u) acc[t][u] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 * kSums <= in; i += 8 * kSums) {
      for (int u = 0; u < kSums; ++u) {
        const __m256 w = Widen<W>::eight(row + i + 8 * u);
        for (int t = 0; t < N; ++t) acc[t][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[t] + i + 8 * u), acc[t][u]);
      }
    }
    for (; i + 8 <= in; i += 8) {
      const __m256 w = Widen<W>::eight(row + i);
      for (int t = 0; t < N; ++t) acc[t][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[t] + i), acc[t][0]);
    }
    for (int t = 0; t < N; ++t) {
      __m256 total = acc[t][0];
      for (int u = 1; u < kSums; ++u) total = _mm256_add_ps(total, acc[t][u]);
      float sum = horizontal_sum(total);
      for (int64_t k = i; k < in; ++k) sum += Widen<W>::one(row + k) * x[t][k];
      h[t * h_stride + j] = sum;
    }
  }
}

// y[t][0:n] += sum over k < rank of h[t * h_stride + k] * b[k * ldb : k * ldb + n] for the block's N tokens: b
// holds rank rows of ldb, and each is read once for all of them. Each output is summed over the rank in
// registers first and added to y once, as torch adds the product h @ b.
template <typename W, int N>
void expand(const float* h, int64_t h_stride, int64_t rank, const W* b, int64_t ldb, float* const* y, int64_t n) {
  constexpr int kVectors = N <= 2 ? 4 : 2;  // at most 8 accumulators
  int64_t o = 0;
  for (; o + 8 * kVectors <= n; o += 8 * kVectors) {
    __m256 acc[N][kVectors];
    for (int t = 0; t < N; ++t)
      for (int v = 0; v < kVectors; ++v) acc[t][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < rank; ++k) {
      const W* row = b + k * ldb + o;
      for (int v = 0; v < kVectors; ++v) {
        const __m256 w = Widen<W>::eight(row + 8 * v);
        for (int t = 0; t < N; ++t) acc[t][v] = _mm256_fmadd_ps(_mm256_set1_ps(h[t * h_stride + k]), w, acc[t][v]);
      }
    }
    for (int t = 0; t < N; ++t)
      for (int v = 0; v < kVectors; ++v) {
        float* out = y[t] + o + 8 * v;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), acc[t][v]));
      }
  }
  for (; o + 8 <= n; o += 8) {
    __m256 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < rank; ++k) {
      const __m256 w = Widen<W>::eight(b + k * ldb + o);
      for (int t = 0; t < N; ++t) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(h[t * h_stride + k]), w, acc[t]);
    }
    for (int t = 0; t < N; ++t) _mm256_storeu_ps(y[t] + o, _mm256_add_ps(_mm256_loadu_ps(y[t] + o), acc[t]));
  }
  for (; o < n; ++o) {
    for (int t = 0; t < N; ++t) {
      float acc = 0.0f;
      for (int64_t k = 0; k < rank; ++k) acc += h[t * h_stride + k] * Widen<W>::one(b + k * ldb + o);
      y[t][o] += acc;
    }
  }
}

// The tokens of one adapter slot, kBlock at most, and their rows of x and y.
struct Block {
  int64_t slot;
  int count;
  const float* x[kBlock];
  float* y[kBlock];
};

template <typename W, int N>
void run_block(const Block& block, const W* a, int64_t part_rows, int64_t in, const std::vector<const W*>& b,
               const std::vector<int64_t>& offsets, const std::vector<int64_t>& widths, int64_t rank, float* h) {
  shrink<W, N>(a + block.slot * part_rows * in, part_rows, in, block.x, h, part_rows);
  for (size_t p = 0; p < b.size(); ++p) {
    float* y[N];
    for (int t = 0; t < N; ++t) y[t] = block.y[t] + offsets[p];
    expand<W, N>(h + p * rank, part_rows, rank, b[p] + block.slot * rank * widths[p], widths[p], y, widths[p]);
  }
}

// One token (a decode step of one stream) has one block: its rows of A, then its columns of B, split across the
// threads instead, so that more than one core streams the adapter's weights.
template <typename W>
void split_one_token(const Block& block, const W* a, int64_t part_rows, int64_t in, const std::vector<const W*>& b,
                     const std::vector<int64_t>& offsets, const std::vector<int64_t>& widths, int64_t rank) {
  constexpr int64_t kRowsPerTask = 8, kColumnsPerTask = 128;
  std::vector<float> h(part_rows);
  const W* slot_a = a + block.slot * part_rows * in;
  at::parallel_for(0, part_rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    shrink<W, 1>(slot_a + begin * in, end - begin, in, block.x, h.data() + begin, part_rows);
  });
  std::vector<std::pair<size_t, int64_t>> chunks;  // (part, first column)
  for (size_t p = 0; p < b.size(); ++p)
    for (int64_t o = 0; o < widths[p]; o += kColumnsPerTask) chunks.emplace_back(p, o);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto [p, o] = chunks[i];
      float* y[1] = {block.y[0] + offsets[p] + o};
      expand<W, 1>(h.data() + p * rank, part_rows, rank, b[p] + block.slot * rank * widths[p] + o, widths[p], y,
                   std::min(kColumnsPerTask, widths[p] - o));
    }
  });
}

template <typename W>
void add_lora_blocks(const std::vector<Block>& blocks, const at::Tensor& lora_a, const std::vector<at::Tensor>& lora_b,
                     const std::vector<int64_t>& offsets, const std::vector<int64_t>& widths, int64_t rank) {
  const W* a = lora_a.data_ptr<W>();
  const int64_t part_rows = lora_a.size(1), in = lora_a.size(2);
  std::vector<const W*> b;
  for (const at::Tensor& t : lora_b) b.push_back(t.data_ptr<W>());
  if (blocks.size() == 1 && blocks[0].count == 1 && at::get_num_threads() > 1) {
    split_one_token(blocks[0], a, part_rows, in, b, offsets, widths, rank);
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(kBlock * part_rows);
    for (int64_t i = begin; i < end; ++i) {
      const Block& block = blocks[i];
      switch (block.count) {
        case 1: run_block<W, 1>(block, a, part_rows, in, b, offsets, widths, rank, h.data()); break;
        case 2: run_block<W, 2>(block, a, part_rows, in, b, offsets, widths, rank, h.data()); break;
        case 3: run_block<W, 3>(block, a, part_rows, in, b, offsets, widths, rank, h.data()); break;
        default: run_block<W, kBlock>(block, a, part_rows, in, b, offsets, widths, rank, h.data()); break;
      }
    }
  });
}

bool is_float_cpu(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

bool is_weight_cpu(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.device().is_cpu() && t.is_contiguous() &&
         (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16);
}

// For each token t whose slot s = token_slots[t] is not -1: h = lora_a[s] @ x[t] ([parts * rank]), and for each
// part p, y[t, offsets[p] : offsets[p] + out_p] += h[p * rank : (p + 1) * rank] @ lora_b[p][s].
void add_lora(const at::Tensor& x, const at::Tensor& lora_a, const std::vector<at::Tensor>& lora_b,
              const std::vector<int64_t>& offsets, const at::Tensor& token_slots, at::Tensor& y) {
  TORCH_CHECK_VALUE(x.dim() == 2 && is_float_cpu(x) && x.stride(1) == 1,
                    "x must be a float32 CPU [tokens, in] matrix with contiguous rows, got ", x.sizes(), " ",
                    x.scalar_type(), " strides ", x.strides());
  const int64_t tokens = x.size(0), in = x.size(1);
  const at::ScalarType dtype = lora_a.scalar_type();
  TORCH_CHECK_VALUE(lora_a.dim() == 3 && is_weight_cpu(lora_a, dtype) && lora_a.size(2) == in,
                    "lora_a must be a contiguous float32, float16 or bfloat16 CPU [slots, parts * rank, ", in,
                    "] tensor, got ", lora_a.sizes(), " ", dtype);
  const int64_t slots = lora_a.size(0), part_rows = lora_a.size(1), parts = static_cast<int64_t>(lora_b.size());
  TORCH_CHECK_VALUE(parts > 0 && part_rows % parts == 0 && static_cast<int64_t>(offsets.size()) == parts,
                    "lora_a's ", part_rows, " rows, ", parts, " lora_b and ", offsets.size(), " offsets do not match");
  const int64_t rank = part_rows / parts;
  TORCH_CHECK_VALUE(y.dim() == 2 && is_float_cpu(y) && y.stride(1) == 1 && y.size(0) == tokens,
                    "y must be a float32 CPU [", tokens, ", out] matrix with contiguous rows, got ", y.sizes());
  std::vector<int64_t> widths(parts);
  for (int64_t p = 0; p < parts; ++p) {
    const at::Tensor& b = lora_b[p];
    TORCH_CHECK_VALUE(b.dim() == 3 && is_weight_cpu(b, dtype) && b.size(0) == slots && b.size(1) == rank,
                      "lora_b[", p, "] must be a contiguous ", dtype, " CPU [", slots, ", ", rank,
                      ", out] tensor like lora_a, got ", b.sizes(), " ", b.scalar_type());
    TORCH_CHECK_VALUE(offsets[p] >= 0 && offsets[p] + b.size(2) <= y.size(1), "part ", p, " (columns ", offsets[p],
                      " to ", offsets[p] + b.size(2), ") falls outside y's ", y.size(1), " columns");
    widths[p] = b.size(2);
  }
  TORCH_CHECK_VALUE(token_slots.dim() == 1 && token_slots.size(0) == tokens && token_slots.is_contiguous() &&
                        token_slots.scalar_type() == at::kLong && token_slots.device().is_cpu(),
                    "token_slots must be a contiguous int64 CPU vector of ", tokens, ", got ", token_slots.sizes());
  const int64_t* slot_of = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(slot_of[t] >= -1 && slot_of[t] < slots, "token ", t, " uses slot ", slot_of[t], " of ", slots);
  }
  // Blocks of up to kBlock tokens of one slot, slot by slot, in token order within each.
  std::vector<std::vector<int64_t>> tokens_of(slots);
  for (int64_t t = 0; t < tokens; ++t)
    if (slot_of[t] >= 0) tokens_of[slot_of[t]].push_back(t);
  float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<Block> blocks;
  for (int64_t s = 0; s < slots; ++s) {
    for (size_t start = 0; start < tokens_of[s].size(); start += kBlock) {
      Block block{s, static_cast<int>(std::min<size_t>(kBlock, tokens_of[s].size() - start)), {}, {}};
      for (int i = 0; i < block.count; ++i) {
        block.x[i] = xp + tokens_of[s][start + i] * x.stride(0);
        block.y[i] = yp + tokens_of[s][start + i] * y.stride(0);
      }
      blocks.push_back(block);
    }
  }
  switch (lora_a.scalar_type()) {
    case at::kFloat: add_lora_blocks<float>(blocks, lora_a, lora_b, offsets, widths, rank); break;
    case at::kHalf: add_lora_blocks<at::Half>(blocks, lora_a, lora_b, offsets, widths, rank); break;
    default: add_lora_blocks<at::BFloat16>(blocks, lora_a, lora_b, offsets, widths, rank); break;
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "Each token's adapter product added in place to a float32 linear's output",
        pybind11::arg("x"), pybind11::arg("lora_a"), pybind11::arg("lora_b"), pybind11::arg("offsets"),
        pybind11::arg("token_slots"), pybind11::arg("y"));
}
