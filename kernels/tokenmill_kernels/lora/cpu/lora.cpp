// CPU LoRA kernel (AVX2, FMA), float32: one adapted linear's shrink and expand for a batch whose tokens use
// different adapters, in one call.
//
// In torch a linear costs per adapter in the step an index, a matmul, and per part a matmul and an index_add;
// at one token, or a few tokens per adapter, those dispatches are the whole cost. Here each token's rows of its
// adapter's A are dotted with its input, and its adapter's B rows (stored [rank, out]) are added to its output.
//
// Tokens split across torch's threads kTokensPerTask at a time: one token's work (a few tens of thousands of
// multiply-adds) is less than waking a thread.

#include <immintrin.h>

#include <vector>

#include "cpu_common/extension.h"

namespace {

constexpr int64_t kTokensPerTask = 4;

float horizontal_sum(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
         acc3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y[0:n] += sum over k < rank of h[k] * b[k * n : k * n + n]: b is [rank, n], row by row. Each output is summed
// over the rank in registers first and added to y once, as torch adds the product h @ b.
void expand(const float* h, int64_t rank, const float* b, float* y, int64_t n) {
  int64_t o = 0;
  for (; o + 32 <= n; o += 32) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < rank; ++k) {
      const __m256 hk = _mm256_set1_ps(h[k]);
      const float* row = b + k * n + o;
      acc0 = _mm256_fmadd_ps(hk, _mm256_loadu_ps(row), acc0);
      acc1 = _mm256_fmadd_ps(hk, _mm256_loadu_ps(row + 8), acc1);
      acc2 = _mm256_fmadd_ps(hk, _mm256_loadu_ps(row + 16), acc2);
      acc3 = _mm256_fmadd_ps(hk, _mm256_loadu_ps(row + 24), acc3);
    }
    _mm256_storeu_ps(y + o, _mm256_add_ps(_mm256_loadu_ps(y + o), acc0));
    _mm256_storeu_ps(y + o + 8, _mm256_add_ps(_mm256_loadu_ps(y + o + 8), acc1));
    _mm256_storeu_ps(y + o + 16, _mm256_add_ps(_mm256_loadu_ps(y + o + 16), acc2));
    _mm256_storeu_ps(y + o + 24, _mm256_add_ps(_mm256_loadu_ps(y + o + 24), acc3));
  }
  for (; o + 8 <= n; o += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < rank; ++k) acc = _mm256_fmadd_ps(_mm256_set1_ps(h[k]), _mm256_loadu_ps(b + k * n + o), acc);
    _mm256_storeu_ps(y + o, _mm256_add_ps(_mm256_loadu_ps(y + o), acc));
  }
  for (; o < n; ++o) {
    float acc = 0.0f;
    for (int64_t k = 0; k < rank; ++k) acc += h[k] * b[k * n + o];
    y[o] += acc;
  }
}

bool is_float_cpu(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

// For each token t whose slot s = token_slots[t] is not -1: h = lora_a[s] @ x[t] ([parts * rank]), and for each
// part p, y[t, offsets[p] : offsets[p] + out_p] += h[p * rank : (p + 1) * rank] @ lora_b[p][s].
void add_lora(const at::Tensor& x, const at::Tensor& lora_a, const std::vector<at::Tensor>& lora_b,
              const std::vector<int64_t>& offsets, const at::Tensor& token_slots, at::Tensor& y) {
  TORCH_CHECK_VALUE(x.dim() == 2 && is_float_cpu(x) && x.stride(1) == 1,
                    "x must be a float32 CPU [tokens, in] matrix with contiguous rows, got ", x.sizes(), " ",
                    x.scalar_type(), " strides ", x.strides());
  const int64_t tokens = x.size(0), in = x.size(1);
  TORCH_CHECK_VALUE(lora_a.dim() == 3 && is_float_cpu(lora_a) && lora_a.is_contiguous() && lora_a.size(2) == in,
                    "lora_a must be a contiguous float32 CPU [slots, parts * rank, ", in, "] tensor, got ",
                    lora_a.sizes());
  const int64_t slots = lora_a.size(0), part_rows = lora_a.size(1), parts = static_cast<int64_t>(lora_b.size());
  TORCH_CHECK_VALUE(parts > 0 && part_rows % parts == 0 && static_cast<int64_t>(offsets.size()) == parts,
                    "lora_a's ", part_rows, " rows, ", parts, " lora_b and ", offsets.size(), " offsets do not match");
  const int64_t rank = part_rows / parts;
  TORCH_CHECK_VALUE(y.dim() == 2 && is_float_cpu(y) && y.stride(1) == 1 && y.size(0) == tokens,
                    "y must be a float32 CPU [", tokens, ", out] matrix with contiguous rows, got ", y.sizes());
  std::vector<const float*> b_data(parts);
  std::vector<int64_t> widths(parts);
  for (int64_t p = 0; p < parts; ++p) {
    const at::Tensor& b = lora_b[p];
    TORCH_CHECK_VALUE(b.dim() == 3 && is_float_cpu(b) && b.is_contiguous() && b.size(0) == slots && b.size(1) == rank,
                      "lora_b[", p, "] must be a contiguous float32 CPU [", slots, ", ", rank, ", out] tensor, got ",
                      b.sizes());
    TORCH_CHECK_VALUE(offsets[p] >= 0 && offsets[p] + b.size(2) <= y.size(1), "part ", p, " (columns ", offsets[p],
                      " to ", offsets[p] + b.size(2), ") falls outside y's ", y.size(1), " columns");
    b_data[p] = b.data_ptr<float>();
    widths[p] = b.size(2);
  }
  TORCH_CHECK_VALUE(token_slots.dim() == 1 && token_slots.size(0) == tokens && token_slots.is_contiguous() &&
                        token_slots.scalar_type() == at::kLong && token_slots.device().is_cpu(),
                    "token_slots must be a contiguous int64 CPU vector of ", tokens, ", got ", token_slots.sizes());
  const int64_t* slot_of = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(slot_of[t] >= -1 && slot_of[t] < slots, "token ", t, " uses slot ", slot_of[t], " of ", slots);
  }
  const float* xp = x.data_ptr<float>();
  const float* ap = lora_a.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> h(part_rows);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slot_of[t];
      if (s < 0) continue;
      const float* a = ap + s * part_rows * in;
      for (int64_t j = 0; j < part_rows; ++j) h[j] = dot(a + j * in, xp + t * xs, in);
      for (int64_t p = 0; p < parts; ++p) {
        expand(h.data() + p * rank, rank, b_data[p] + s * rank * widths[p], yp + t * ys + offsets[p], widths[p]);
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "Each token's adapter product added in place to a float32 linear's output",
        pybind11::arg("x"), pybind11::arg("lora_a"), pybind11::arg("lora_b"), pybind11::arg("offsets"),
        pybind11::arg("token_slots"), pybind11::arg("y"));
}
