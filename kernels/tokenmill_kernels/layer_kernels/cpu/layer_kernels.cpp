// CPU layer kernels (AVX2, FMA) for float32: RMSNorm with the residual add before it, rope, and SiLU
// times up.
//
// In torch each is several operators (an add, the norm; rope's chunk, four products, two sums and a
// concatenation; SiLU's chunk, silu and a product), each a dispatch and a pass over its data, and at one
// token the dispatches are the cost. Here each is one pass.
//
// Rows run on one thread up to kRowsPerTask rows; longer batches (prompt chunks) split rows across
// torch's threads.
//
// DecoderStack runs a Llama-shaped model's whole decoder stack in one call: these kernels with the quantized
// matmuls and paged attention, whose C++ the other extensions lend through their c_api() tables
// (cpu_common/kernel_api.h), in the order the Python forward calls them. At one token a small model's kernels
// take a few microseconds each and the Python between them about as long again; here the result is the
// forward's, bit for bit, without the interpreter between the kernels.

#include <immintrin.h>

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ops/cat.h>

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

// One quantized linear: int4 when `mins` is given, else int8; `lora`: its adapters' slots (the LoRA
// extension's Weights), or nullptr.
struct QuantLinear {
  at::Tensor qweight, scales;
  c10::optional<at::Tensor> mins, bias;
  const void* lora = nullptr;
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;  // [hidden] float32
  c10::optional<at::Tensor> q_norm, k_norm;    // [head_dim] float32: Qwen3's per-head norms before rope
  QuantLinear qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim, sliding_window;  // sliding_window <= 0: none
  double scale, logits_soft_cap;                              // logits_soft_cap <= 0: none
};

QuantLinear quant_linear(const std::vector<c10::optional<at::Tensor>>& parts, const char* name) {
  TORCH_CHECK_VALUE(parts.size() == 4 && parts[0] && parts[1],
                    name, " must be [qweight, scales, mins or None, bias or None]");
  return QuantLinear{*parts[0], *parts[1], parts[2], parts[3], nullptr};
}

class DecoderStack {
 public:
  // linears: each layer's qkv, o, gate_up and down, in that order; norms: each layer's input and
  // post-attention norm weights, then the final norm's; attention: each layer's (num_heads, num_kv_heads,
  // head_dim, scale, sliding_window, logits_soft_cap); lora_weights: empty, or each linear's adapter slots (the
  // LoRA extension's Weights, None for a linear without), in the order of linears, with that extension's table;
  // qk_norms: empty, or each layer's q and k norm weights.
  DecoderStack(const std::vector<std::vector<c10::optional<at::Tensor>>>& linears, const std::vector<at::Tensor>& norms,
               const std::vector<std::tuple<int64_t, int64_t, int64_t, double, int64_t, double>>& attention,
               double eps, const pybind11::capsule& paged_attention, const pybind11::capsule& quant_matmul,
               std::vector<pybind11::object> lora_weights, const c10::optional<pybind11::capsule>& lora,
               const std::vector<at::Tensor>& qk_norms)
      : eps_(eps),
        pa_(tokenmill::import_api<tokenmill::PagedAttentionApi>(paged_attention)),
        qm_(tokenmill::import_api<tokenmill::QuantMatmulApi>(quant_matmul)),
        lora_(lora ? tokenmill::import_api<tokenmill::LoraApi>(*lora) : nullptr),
        lora_weights_(std::move(lora_weights)) {
    const size_t num_layers = attention.size();
    TORCH_CHECK_VALUE(num_layers > 0 && linears.size() == 4 * num_layers && norms.size() == 2 * num_layers + 1,
                      "a stack of ", num_layers, " layers takes ", 4 * num_layers, " linears and ",
                      2 * num_layers + 1, " norms, got ", linears.size(), " and ", norms.size());
    for (size_t i = 0; i < num_layers; ++i) {
      const auto& [heads, kv_heads, head_dim, scale, window, cap] = attention[i];
      layers_.push_back(Layer{norms[2 * i], norms[2 * i + 1], c10::nullopt, c10::nullopt,
                              quant_linear(linears[4 * i], "qkv"), quant_linear(linears[4 * i + 1], "o"),
                              quant_linear(linears[4 * i + 2], "gate_up"), quant_linear(linears[4 * i + 3], "down"),
                              heads, kv_heads, head_dim, window, scale, cap});
    }
    final_norm_ = norms.back();
    if (!qk_norms.empty()) {
      TORCH_CHECK_VALUE(qk_norms.size() == 2 * num_layers, "qk_norms takes each layer's q and k norm (",
                        2 * num_layers, "), got ", qk_norms.size());
      for (size_t i = 0; i < num_layers; ++i) {
        layers_[i].q_norm = qk_norms[2 * i];
        layers_[i].k_norm = qk_norms[2 * i + 1];
      }
    }
    if (lora_weights_.empty()) return;
    TORCH_CHECK_VALUE(lora_ != nullptr && lora_weights_.size() == linears.size(), "lora_weights takes one entry per "
                      "linear (", linears.size(), ") and the LoRA extension's c_api(), got ", lora_weights_.size());
    for (size_t j = 0; j < lora_weights_.size(); ++j) {
      if (lora_weights_[j].is_none()) continue;
      const void* weights = lora_->weights(lora_weights_[j]);
      TORCH_CHECK_VALUE(weights != nullptr, "lora_weights[", j, "] is not the LoRA extension's Weights");
      QuantLinear* linear[] = {&layers_[j / 4].qkv, &layers_[j / 4].o, &layers_[j / 4].gate_up, &layers_[j / 4].down};
      linear[j % 4]->lora = weights;
    }
  }

  // The C++ Plan inside `lora_plan` (the LoRA extension's step layout, None: no token uses an adapter); with the
  // GIL held.
  const void* plan_of(const pybind11::object& lora_plan) const {
    if (lora_plan.is_none()) return nullptr;
    TORCH_CHECK_VALUE(lora_ != nullptr, "a LoRA plan given to a stack built without LoRA weights");
    const void* plan = lora_->plan(lora_plan);
    TORCH_CHECK_VALUE(plan != nullptr, "lora_plan is not the LoRA extension's Plan");
    return plan;
  }

  // hidden: the embeddings [tokens, hidden] float32; cos, sin: the step's rope [tokens, 1, head_dim / 2];
  // kv_caches: each layer's [2, num_blocks, block_size, kv_heads, row]; the rest as paged_attention takes
  // them; lora_plan: plan_of()'s, or nullptr. Returns the final norm of the last layer's output [tokens, hidden].
  at::Tensor forward(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& token_req, const at::Tensor& positions,
                     const void* lora_plan) const {
    TORCH_CHECK_VALUE(kv_caches.size() == layers_.size(), "expected a KV cache per layer (", layers_.size(),
                      "), got ", kv_caches.size());
    const int64_t tokens = hidden.size(0);
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor x;
      if (!residual.defined()) {  // the first layer: its input is the residual stream
        residual = hidden;
        x = rms_norm(hidden, layer.input_norm, eps_, c10::nullopt)[0];
      } else {
        auto normed = rms_norm(hidden, layer.input_norm, eps_, residual);
        x = std::move(normed[0]);
        residual = std::move(normed[1]);
      }
      // [tokens, heads + 2 * kv_heads, head_dim]: queries and keys adjacent, so rope rotates both at once.
      const at::Tensor qkv = linear(layer.qkv, x, lora_plan).view({tokens, -1, layer.head_dim});
      at::Tensor query_and_key = qkv.narrow(1, 0, layer.num_heads + layer.num_kv_heads);
      if (layer.q_norm) {  // each head's norm, as LlamaAttention: normed copies, side by side again
        const at::Tensor query = head_norm(qkv.narrow(1, 0, layer.num_heads), *layer.q_norm);
        const at::Tensor key = head_norm(qkv.narrow(1, layer.num_heads, layer.num_kv_heads), *layer.k_norm);
        query_and_key = at::cat({query, key}, 1);
      }
      rotary(query_and_key, cos, sin);
      at::Tensor key_cache = kv_caches[i].select(0, 0), value_cache = kv_caches[i].select(0, 1);
      pa_->write_kv_cache(query_and_key.narrow(1, layer.num_heads, layer.num_kv_heads).contiguous(),
                          qkv.narrow(1, layer.num_heads + layer.num_kv_heads, layer.num_kv_heads).contiguous(),
                          key_cache, value_cache, slot_mapping);
      const at::Tensor attended = pa_->paged_attention(
          query_and_key.narrow(1, 0, layer.num_heads).contiguous(), key_cache, value_cache, block_tables, token_req,
          positions, layer.scale, layer.sliding_window, c10::nullopt, c10::nullopt, layer.logits_soft_cap);
      const at::Tensor out = linear(layer.o, attended.view({tokens, layer.num_heads * layer.head_dim}), lora_plan);
      auto normed = rms_norm(out, layer.post_attention_norm, eps_, residual);
      residual = std::move(normed[1]);
      hidden = linear(layer.down, silu_and_mul(linear(layer.gate_up, normed[0], lora_plan)), lora_plan);
    }
    return rms_norm(hidden, final_norm_, eps_, residual)[0];
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  // RMSNorm of each head of x [tokens, heads, head_dim], as the layer kernels' Python launcher runs it.
  at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight) const {
    return rms_norm(x.reshape({-1, x.size(2)}), weight, eps_, c10::nullopt)[0].view(x.sizes());
  }

  // As Linear.forward: the quantized matmul, then the step's adapter products added to its output. One token's
  // product runs inside the matmul's parallel region (SideWork), each thread adding to the columns it computed.
  at::Tensor linear(const QuantLinear& w, const at::Tensor& x, const void* lora_plan) const {
    const bool adapted = lora_plan != nullptr && w.lora != nullptr;
    const int64_t shares = at::get_num_threads();
    const int64_t bytes = adapted && x.size(0) == 1 ? lora_->side_bytes(w.lora, lora_plan, shares) : 0;
    if (bytes == 0) {
      at::Tensor y = matmul(w, x, nullptr);
      if (adapted) lora_->add(w.lora, lora_plan, x, y);
      return y;
    }
    struct Adapter {
      const tokenmill::LoraApi* api;
      const void *weights, *plan;
      const float* x;
      void* scratch;
    };
    std::vector<char> scratch(bytes, 0);
    Adapter adapter{lora_, w.lora, lora_plan, x.data_ptr<float>(), scratch.data()};
    const tokenmill::SideWork side{
        [](void* context, int64_t s, int64_t n, float* out, int64_t begin, int64_t end) {
          const Adapter& a = *static_cast<const Adapter*>(context);
          a.api->add_share(a.weights, a.plan, a.x, a.scratch, s, n, out, begin, end);
        },
        &adapter, shares,
        [](void* context, int64_t s, int64_t n, int64_t begin, int64_t end, tokenmill::SideWork::Range* ranges) {
          const Adapter& a = *static_cast<const Adapter*>(context);
          return a.api->share_reads(a.weights, a.plan, a.x, s, n, begin, end, ranges);
        }};
    return matmul(w, x, &side);
  }

  at::Tensor matmul(const QuantLinear& w, const at::Tensor& x, const tokenmill::SideWork* side) const {
    return w.mins ? qm_->matmul_int4(x, w.qweight, w.scales, *w.mins, w.bias, side)
                  : qm_->matmul_int8(x, w.qweight, w.scales, w.bias, side);
  }

  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  double eps_;
  const tokenmill::PagedAttentionApi* pa_;
  const tokenmill::QuantMatmulApi* qm_;
  const tokenmill::LoraApi* lora_;
  std::vector<pybind11::object> lora_weights_;  // held: the Weights the linears point into
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows, after adding the residual when given",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("rotary", &rotary, "Rope (rotate half) in place on float32 [tokens, heads, head_dim]");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for float32 [tokens, 2 * inner] holding gate then up");
  using pybind11::arg;
  pybind11::class_<DecoderStack>(m, "DecoderStack", "A Llama-shaped stack of int4/int8 linears, run in one call")
      .def(pybind11::init<const std::vector<std::vector<c10::optional<at::Tensor>>>&, const std::vector<at::Tensor>&,
                          const std::vector<std::tuple<int64_t, int64_t, int64_t, double, int64_t, double>>&, double,
                          const pybind11::capsule&, const pybind11::capsule&, std::vector<pybind11::object>,
                          const c10::optional<pybind11::capsule>&, const std::vector<at::Tensor>&>(),
           arg("linears"), arg("norms"), arg("attention"), arg("eps"), arg("paged_attention"), arg("quant_matmul"),
           arg("lora_weights") = std::vector<pybind11::object>(), arg("lora") = pybind11::none(),
           arg("qk_norms") = std::vector<at::Tensor>())
      .def(
          "forward",
          [](const DecoderStack& self, at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
             const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
             const at::Tensor& token_req, const at::Tensor& positions, const pybind11::object& lora_plan) {
            const void* plan = self.plan_of(lora_plan);
            pybind11::gil_scoped_release release;
            return self.forward(std::move(hidden), cos, sin, kv_caches, slot_mapping, block_tables, token_req,
                                positions, plan);
          },
          "the layers and the final norm over the embeddings", arg("hidden"), arg("cos"), arg("sin"),
          arg("kv_caches"), arg("slot_mapping"), arg("block_tables"), arg("token_req"), arg("positions"),
          arg("lora_plan") = pybind11::none())
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
}
