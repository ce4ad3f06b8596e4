// CPU layer kernels (AVX2, FMA) for float32: RMSNorm with the residual add before it, rope, and SiLU
// times up.
//
// In torch each is several operators (an add, the norm; rope's chunk, four products, two sums and a
// concatenation; SiLU's chunk, silu and a product), each a dispatch and a pass over its data, and at one
// token the dispatches are the cost. Here each is one pass.
//
// Rows run on one thread up to kRowsPerTask rows; longer batches (prompt chunks) split rows across
// torch's threads.

#include <immintrin.h>

#include <cmath>

#include "cpu_common/extension.h"
#include "cpu_common/kernel_api.h"
#include "cpu_common/simd_math.h"

namespace {

constexpr int64_t kRowsPerTask = 16;

// TORCH_CHECK_VALUE surfaces in Python as ValueError.
void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1 && t.device().is_cpu(), name,
                    " must be a float32 CPU matrix with contiguous rows, got ", t.sizes(), " ", t.scalar_type(),
                    " strides ", t.strides());
}

float sum_of_squares(const float* x, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float sum = _mm_cvtss_f32(half);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

// out = x * rstd * weight, with rstd = 1 / sqrt(mean(x^2) + eps) (torch's order: x times rstd, then the weight).
void norm_row(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float rstd = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * rstd) * weight[i];
}

// Normalises x's rows into a new tensor; with a residual, first stores x + residual as the new residual
// stream (returned second) and normalises that.
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == at::kFloat &&
                        weight.is_contiguous() && weight.device().is_cpu(),
                    "weight must be a contiguous float32 CPU vector of ", n, ", got ", weight.sizes());
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor total;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes(), "residual ", residual->sizes(), " differs from x ", x.sizes());
    total = at::empty({rows, n}, x.options());
  }
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* tp = total.defined() ? total.data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0), rs = residual.has_value() ? residual->stride(0) : 0;
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = xp + row * xs;
      if (rp != nullptr) {
        const float* rr = rp + row * rs;
        float* t = tp + row * n;
        for (int64_t i = 0; i < n; ++i) t[i] = xr[i] + rr[i];
        xr = t;
      }
      norm_row(xr, wp, op + row * n, n, static_cast<float>(eps));
    }
  });
  if (total.defined()) return {out, total};
  return {out};
}

// Rope ("rotate half") in place on x [tokens, heads, head_dim] (last dimension contiguous), with cos and
// sin [tokens, 1, head_dim / 2] (last dimension contiguous).
void rotary(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK_VALUE(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.device().is_cpu(),
                    "x must be a float32 CPU [tokens, heads, head_dim] tensor with a contiguous last dimension, got ",
                    x.sizes(), " strides ", x.strides());
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == tokens && t->size(2) == half && t->stride(2) == 1 &&
                          t->scalar_type() == at::kFloat && t->device().is_cpu(),
                      "cos and sin must be float32 CPU [", tokens, ", 1, ", half, "] tensors, got ", t->sizes());
  }
  TORCH_CHECK_VALUE(x.size(2) % 2 == 0, "head_dim must be even, got ", x.size(2));
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      const float* c = cp + token * cs;
      const float* s = sp + token * ss;
      for (int64_t head = 0; head < heads; ++head) {
        float* x1 = xp + token * ts + head * hs;
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

// silu(gate) * up for gate_up [tokens, 2 * inner] holding gate then up in each row; a new [tokens, inner].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK_VALUE(gate_up.size(1) % 2 == 0, "gate_up's width must be even, got ", gate_up.size(1));
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inner}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      tokenmill::silu_and_mul_row(gp + row * stride, gp + row * stride + inner, op + row * inner, inner);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, after adding the residual when given",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("rotary", &rotary, "Rope (rotate half) in place on float32 [tokens, heads, head_dim]");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for float32 [tokens, 2 * inner] holding gate then up");
  static const tokenmill::LayerKernelsApi api{&rms_norm, &rotary, &silu_and_mul};
  tokenmill::def_api(m, &api);
}
