// The run-time choice of a CPU extension's instruction-set variant, shared by the kernels in
// tokenmill_kernels/*/cpu/*.cpp that come in more than one (paged_attention, quant_matmul, dense_matmul).
//
// Each extension builds with -mavx2 -mfma (and the flags of its own), compiles its wider variants with
// __attribute__((target)), and keeps one IsaChoice: the variants' names, which of them this CPU runs (its own
// cpuid checks, in a detect function), and the one its kernels run now. IsaChoice::def gives the extension's
// Python module supported_isas(), isa() and set_isa(name).
//
// cpp_build.CppExtension copies this header into each build directory (include/cpu_common/isa.h, passed with
// -I) and keys the build on its bytes, so an edit here rebuilds every extension that includes it.
#pragma once

#include "cpu_common/extension.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>
#include <vector>

// The wider variants this build compiles. cpp_build.CppExtension passes TOKENMILL_BUILD_<SET>=0 for each
// instruction set the building machine's CPU lacks, so a CPU without AVX-512 compiles (and its first start waits
// for) only the variants it can run; where the CPU's flags cannot be read, every variant is compiled. A variant
// that is not compiled is never listed as supported.
#ifndef TOKENMILL_BUILD_AVX_VNNI
#define TOKENMILL_BUILD_AVX_VNNI 1
#endif
#ifndef TOKENMILL_BUILD_AVX512
#define TOKENMILL_BUILD_AVX512 1
#endif
#ifndef TOKENMILL_BUILD_AVX512_VNNI
#define TOKENMILL_BUILD_AVX512_VNNI 1
#endif
#ifndef TOKENMILL_BUILD_AMX
#define TOKENMILL_BUILD_AMX 1
#endif

namespace tokenmill {

inline constexpr bool kBuildAvxVnni = TOKENMILL_BUILD_AVX_VNNI;
inline constexpr bool kBuildAvx512 = TOKENMILL_BUILD_AVX512;
inline constexpr bool kBuildAvx512Vnni = kBuildAvx512 && TOKENMILL_BUILD_AVX512_VNNI;
inline constexpr bool kBuildAmx = kBuildAvx512Vnni && TOKENMILL_BUILD_AMX;

// The variants of one extension's kernels. Isa is an enum class whose values index `names`; `detect` returns
// the ones this CPU (and OS, for the AVX-512 state) supports, best last, starting with the one that needs
// only what the build checks (AVX2 + FMA). It runs once, after __builtin_cpu_init, so its
// __builtin_cpu_supports calls are right even during the library's static initialisation.
template <typename Isa>
class IsaChoice {
 public:
  IsaChoice(std::vector<std::string> names, std::vector<Isa> (*detect)())
      : names_(std::move(names)), supported_(detect_after_init(detect)), current_(supported_.back()) {}

  // The variant the kernels run now: the best supported, unless set() said otherwise.
  Isa get() const { return current_.load(std::memory_order_relaxed); }

  std::vector<std::string> supported_names() const {
    std::vector<std::string> names;
    for (Isa isa : supported_) names.push_back(name_of(isa));
    return names;
  }

  std::string name() const { return name_of(current_.load()); }

  // Runs variant `name` from now on ("auto": the best supported); ValueError names the supported ones.
  void set(const std::string& name) {
    if (name == "auto") {
      current_ = supported_.back();
      return;
    }
    const auto found =
        std::find_if(supported_.begin(), supported_.end(), [&](Isa isa) { return name == name_of(isa); });
    TORCH_CHECK_VALUE(found != supported_.end(), "isa must be \"auto\" or one this CPU supports (",
                      c10::Join(", ", supported_names()), "), got \"", name, "\"");
    current_ = *found;
  }

  // The module's supported_isas(), isa() and set_isa(name); `isa_doc` says what isa() tells (which ops use it).
  void def(pybind11::module_& m, const char* isa_doc) {
    m.def("supported_isas", [this] { return supported_names(); }, "the kernel variants this CPU can run, best last");
    m.def("isa", [this] { return name(); }, isa_doc);
    m.def("set_isa", [this](const std::string& name) { set(name); },
          "use this variant from now on (\"auto\": the best supported)", pybind11::arg("name"));
  }

 private:
  static std::vector<Isa> detect_after_init(std::vector<Isa> (*detect)()) {
    __builtin_cpu_init();
    return detect();
  }

  const std::string& name_of(Isa isa) const { return names_[static_cast<size_t>(isa)]; }

  const std::vector<std::string> names_;  // indexed by Isa
  const std::vector<Isa> supported_;
  std::atomic<Isa> current_;
};

}  // namespace tokenmill
