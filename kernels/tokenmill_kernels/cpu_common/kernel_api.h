// The C++ entry points one CPU kernel extension lends another: a table of function pointers per extension,
// passed between the modules as a PyCapsule (as numpy lends its C API).
//
// The extensions build and load separately (each only when a model needs it), so one cannot link against
// another. An extension that calls another's kernels from C++ (the layer kernels' DecoderStack, which runs a
// whole decode step's layers in one call) asks that module's c_api() for its table; the capsule's name carries
// the table's version, checked on import. The functions are the ones the modules bind for Python, with the
// same checks.
#pragma once

#include <string>

#include "cpu_common/extension.h"

namespace tokenmill {

// paged_attention: sliding_window <= 0 and logits_soft_cap <= 0 mean none.
struct PagedAttentionApi {
  static constexpr const char* kName = "tokenmill.paged_attention.api.v1";
  void (*write_kv_cache)(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                         at::Tensor& value_cache, const at::Tensor& slot_mapping);
  at::Tensor (*paged_attention)(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& token_req,
                                const at::Tensor& positions, double scale, int64_t sliding_window,
                                const c10::optional<at::Tensor>& tree_start,
                                const c10::optional<at::Tensor>& tree_bits, double logits_soft_cap);
};

// Work another kernel runs inside a matmul's parallel region, so that the two share one fork and join: the
// matmul splits its output columns into exactly `shares` parts, and the thread that computes part s then calls
// run(context, s, shares, out, begin, end), where columns begin..end of every row of `out` [M, N] are that part's,
// written. The side work may change those columns and no others. An empty output runs none.
struct SideWork {
  // `count` runs of `bytes` bytes, `stride` bytes apart.
  struct Range {
    const char* begin;
    int64_t bytes, stride, count;
  };
  static constexpr int kMaxReads = 8;
  void (*run)(void* context, int64_t share, int64_t shares, float* out, int64_t begin, int64_t end);
  void* context;
  int64_t shares;
  // The memory run will read for a share (up to kMaxReads ranges; returns how many), which the matmul asks for a
  // few lines at a time as it streams its own weights, so that run finds it in cache. nullptr: none.
  int (*reads)(void* context, int64_t share, int64_t shares, int64_t begin, int64_t end, Range* ranges);
};

// quant_matmul: x [M, K] float32 @ W.T + bias; `side`: nullptr, or work to run in the same parallel region.
struct QuantMatmulApi {
  static constexpr const char* kName = "tokenmill.quant_matmul.api.v2";
  at::Tensor (*matmul_int8)(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const c10::optional<at::Tensor>& bias, const SideWork* side);
  at::Tensor (*matmul_int4)(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const at::Tensor& mins, const c10::optional<at::Tensor>& bias, const SideWork* side);
};

// lora: one adapted linear's adapter products for a step's tokens, added in place (Weights::add in lora.cpp).
// `weights` and `plan` unwrap that module's Python Weights and Plan objects (nullptr for any other object; call
// them with the GIL held); the others need no GIL.
//
// A step of one token with an adapter can instead run as the base matmul's side work (SideWork), which saves a
// parallel region per linear and keeps each output column on the thread that computed it: `side_bytes` gives the
// zeroed scratch the shares share (0: the plan is not one such token; call `add`), `add_share` adds the token's
// adapter product to columns begin..end of its output row y, and `share_reads` names what add_share will read.
struct LoraApi {
  static constexpr const char* kName = "tokenmill.lora.api.v2";
  const void* (*weights)(pybind11::handle object);
  const void* (*plan)(pybind11::handle object);
  void (*add)(const void* weights, const void* plan, const at::Tensor& x, at::Tensor& y);
  int64_t (*side_bytes)(const void* weights, const void* plan, int64_t shares);
  void (*add_share)(const void* weights, const void* plan, const float* x, void* scratch, int64_t share,
                    int64_t shares, float* y, int64_t begin, int64_t end);
  int (*share_reads)(const void* weights, const void* plan, const float* x, int64_t share, int64_t shares,
                     int64_t begin, int64_t end, SideWork::Range* ranges);
};

// Binds `c_api()` on module `m`: a capsule holding `api`, which must live as long as the module (a static).
template <typename Api>
void def_api(pybind11::module_& m, const Api* api) {
  m.def("c_api", [api] { return pybind11::capsule(static_cast<const void*>(api), Api::kName); },
        "this module's kernels for other extensions' C++ (tokenmill_kernels/cpu_common/kernel_api.h)");
}

// The table in a capsule from another module's c_api(); ValueError when it holds another table or version.
template <typename Api>
const Api* import_api(const pybind11::capsule& capsule) {
  const char* name = capsule.name();
  TORCH_CHECK_VALUE(name != nullptr && std::string(name) == Api::kName, "expected a capsule of ", Api::kName,
                    ", got ", name == nullptr ? "an unnamed one" : name);
  return capsule.get_pointer<const Api>();
}

}  // namespace tokenmill
