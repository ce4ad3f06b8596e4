// A Llama-shaped decoder stack run in one call: every layer's norms, quantized linears, rope, KV write and
// paged attention, through the other CPU extensions' own kernels (cpu_common/kernel_api.h).
//
// At one token the kernels of a small model's layer take tens of microseconds, and the Python that called
// them one by one took about as long again: a dispatch, a tensor view or a wrapper per operation. Here the
// same kernels run in the same order on the same tensors, so the result is the Python forward's, bit for bit,
// without the interpreter between them.

#include <string>
#include <utility>
#include <vector>

#include "cpu_common/extension.h"
#include "cpu_common/kernel_api.h"

namespace {

namespace py = pybind11;

// One quantized linear: int4 when `mins` is given, else int8.
struct QuantLinear {
  at::Tensor qweight, scales;
  c10::optional<at::Tensor> mins, bias;
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;  // [hidden] float32
  QuantLinear qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_dim, sliding_window;  // sliding_window <= 0: none
  double scale, logits_soft_cap;                              // logits_soft_cap <= 0: none
};

QuantLinear quant_linear(const std::vector<c10::optional<at::Tensor>>& parts, const char* name) {
  TORCH_CHECK_VALUE(parts.size() == 4 && parts[0] && parts[1],
                    name, " must be [qweight, scales, mins or None, bias or None]");
  return QuantLinear{*parts[0], *parts[1], parts[2], parts[3]};
}

class DecoderStack {
 public:
  // linears: each layer's qkv, o, gate_up and down, in that order; norms: each layer's input and
  // post-attention norm weights, then the final norm's; attention: each layer's (num_heads, num_kv_heads,
  // head_dim, scale, sliding_window, logits_soft_cap).
  DecoderStack(const std::vector<std::vector<c10::optional<at::Tensor>>>& linears, const std::vector<at::Tensor>& norms,
               const std::vector<std::tuple<int64_t, int64_t, int64_t, double, int64_t, double>>& attention,
               double eps, const py::capsule& layer_kernels, const py::capsule& paged_attention,
               const py::capsule& quant_matmul)
      : eps_(eps),
        lk_(tokenmill::import_api<tokenmill::LayerKernelsApi>(layer_kernels)),
        pa_(tokenmill::import_api<tokenmill::PagedAttentionApi>(paged_attention)),
        qm_(tokenmill::import_api<tokenmill::QuantMatmulApi>(quant_matmul)) {
    const size_t num_layers = attention.size();
    TORCH_CHECK_VALUE(num_layers > 0 && linears.size() == 4 * num_layers && norms.size() == 2 * num_layers + 1,
                      "a stack of ", num_layers, " layers takes ", 4 * num_layers, " linears and ",
                      2 * num_layers + 1, " norms, got ", linears.size(), " and ", norms.size());
    for (size_t i = 0; i < num_layers; ++i) {
      const auto& [heads, kv_heads, head_dim, scale, window, cap] = attention[i];
      layers_.push_back(Layer{norms[2 * i], norms[2 * i + 1], quant_linear(linears[4 * i], "qkv"),
                              quant_linear(linears[4 * i + 1], "o"), quant_linear(linears[4 * i + 2], "gate_up"),
                              quant_linear(linears[4 * i + 3], "down"), heads, kv_heads, head_dim, window, scale,
                              cap});
    }
    final_norm_ = norms.back();
  }

  // hidden: the embeddings [tokens, hidden] float32; cos, sin: the step's rope [tokens, 1, head_dim / 2];
  // kv_caches: each layer's [2, num_blocks, block_size, kv_heads, row]; the rest as paged_attention takes
  // them. Returns the final norm of the last layer's output [tokens, hidden].
  at::Tensor forward(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& token_req, const at::Tensor& positions) const {
    TORCH_CHECK_VALUE(kv_caches.size() == layers_.size(), "expected a KV cache per layer (", layers_.size(),
                      "), got ", kv_caches.size());
    const int64_t tokens = hidden.size(0);
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor x;
      if (!residual.defined()) {  // the first layer: its input is the residual stream
        residual = hidden;
        x = lk_->rms_norm(hidden, layer.input_norm, eps_, c10::nullopt)[0];
      } else {
        auto normed = lk_->rms_norm(hidden, layer.input_norm, eps_, residual);
        x = std::move(normed[0]);
        residual = std::move(normed[1]);
      }
      // [tokens, heads + 2 * kv_heads, head_dim]: queries and keys adjacent, so rope rotates both at once.
      const at::Tensor qkv = linear(layer.qkv, x).view({tokens, -1, layer.head_dim});
      at::Tensor query_and_key = qkv.narrow(1, 0, layer.num_heads + layer.num_kv_heads);
      lk_->rotary(query_and_key, cos, sin);
      at::Tensor key_cache = kv_caches[i].select(0, 0), value_cache = kv_caches[i].select(0, 1);
      pa_->write_kv_cache(query_and_key.narrow(1, layer.num_heads, layer.num_kv_heads).contiguous(),
                          qkv.narrow(1, layer.num_heads + layer.num_kv_heads, layer.num_kv_heads).contiguous(),
                          key_cache, value_cache, slot_mapping);
      const at::Tensor attended = pa_->paged_attention(
          query_and_key.narrow(1, 0, layer.num_heads).contiguous(), key_cache, value_cache, block_tables, token_req,
          positions, layer.scale, layer.sliding_window, c10::nullopt, c10::nullopt, layer.logits_soft_cap);
      const at::Tensor out = linear(layer.o, attended.view({tokens, layer.num_heads * layer.head_dim}));
      auto normed = lk_->rms_norm(out, layer.post_attention_norm, eps_, residual);
      residual = std::move(normed[1]);
      hidden = linear(layer.down, lk_->silu_and_mul(linear(layer.gate_up, normed[0])));
    }
    return lk_->rms_norm(hidden, final_norm_, eps_, residual)[0];
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  at::Tensor linear(const QuantLinear& w, const at::Tensor& x) const {
    if (w.mins) return qm_->matmul_int4(x, w.qweight, w.scales, *w.mins, w.bias);
    return qm_->matmul_int8(x, w.qweight, w.scales, w.bias);
  }

  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  double eps_;
  const tokenmill::LayerKernelsApi* lk_;
  const tokenmill::PagedAttentionApi* pa_;
  const tokenmill::QuantMatmulApi* qm_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<DecoderStack>(m, "DecoderStack", "A Llama-shaped decoder stack of int4/int8 linears, run in one call")
      .def(py::init<const std::vector<std::vector<c10::optional<at::Tensor>>>&, const std::vector<at::Tensor>&,
                    const std::vector<std::tuple<int64_t, int64_t, int64_t, double, int64_t, double>>&, double,
                    const py::capsule&, const py::capsule&, const py::capsule&>(),
           py::arg("linears"), py::arg("norms"), py::arg("attention"), py::arg("eps"), py::arg("layer_kernels"),
           py::arg("paged_attention"), py::arg("quant_matmul"))
      .def("forward", &DecoderStack::forward, "the layers and the final norm over the embeddings",
           py::call_guard<py::gil_scoped_release>(), py::arg("hidden"), py::arg("cos"), py::arg("sin"), py::arg("kv_caches"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("token_req"), py::arg("positions"))
      .def_property_readonly("num_layers", &DecoderStack::num_layers);
}
