"""The run-time choice of a kernel variant, the same in every CPU extension that has variants: each keeps a
``tokenmill::IsaChoice`` (``tokenmill_kernels/cpu_common/isa.h``) and its launcher passes the calls on through
``CppExtension``. Builds the three extensions (a minute or two on a first run)."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import pytest
from tokenmill_kernels import cpp_build
from tokenmill_kernels.dense_matmul import cpu as dense_matmul
from tokenmill_kernels.paged_attention import cpu as paged_attention
from tokenmill_kernels.quant_matmul import cpu as quant_matmul

from tests.cpu_machine import cpu_kernels_missing

# Each launcher with every variant its C++ knows, in its order (best last).
VARIANTS = {
    dense_matmul: ("avx2", "avx512"),
    paged_attention: ("avx2", "avx512"),
    quant_matmul: ("avx2", "avx_vnni", "avx512", "avx512_vnni16", "amx"),
}


@pytest.mark.parametrize("kernel", ["paged_attention", "quant_matmul", "dense_matmul", "layer_kernels", "lora"])
def test_the_kernels_build_with_the_shared_headers(kernel: str) -> None:
    """Their sources include them, so they are copied into their builds and are part of their keys; every one
    includes torch through the lean ``extension.h``, the ones with variants ``isa.h`` too, those with an
    exponential ``simd_math.h``, those that lend their C++ to the layer kernels' decoder stack, or run it,
    ``kernel_api.h``, and those that trickle prefetches into a loop ``prefetch.h``."""
    source = (cpp_build.INCLUDE_ROOT / kernel / "cpu" / f"{kernel}.cpp").read_bytes()
    names = ["cpu_common/extension.h"] + (["cpu_common/isa.h"] if kernel not in ("layer_kernels", "lora") else [])
    names += ["cpu_common/simd_math.h"] if kernel in ("paged_attention", "layer_kernels", "quant_matmul") else []
    names += ["cpu_common/kernel_api.h"] if kernel != "dense_matmul" else []
    names += ["cpu_common/prefetch.h"] if kernel in ("quant_matmul", "lora") else []
    headers = {name: (cpp_build.INCLUDE_ROOT / name).read_bytes() for name in names}
    assert cpp_build.local_headers(source) == headers
    assert b"#include <torch/extension.h>" not in source + b"".join(headers.values())


@pytest.fixture(params=list(VARIANTS), ids=lambda launcher: launcher.__name__.split(".")[1])
def launcher(request: pytest.FixtureRequest) -> object:
    module: ModuleType = request.param
    if cpu_kernels_missing() is not None:
        pytest.skip(f"the CPU kernels need what is missing: {cpu_kernels_missing()}")
    before = module.isa()
    yield module
    module.set_isa(before)


def test_auto_picks_the_best_supported_variant(launcher: ModuleType) -> None:
    supported = launcher.supported_isas()
    assert supported[0] == "avx2"
    assert [name for name in VARIANTS[launcher] if name in supported] == supported  # the C++'s order, best last
    for name in supported:
        launcher.set_isa(name)
        assert launcher.isa() == name
    launcher.set_isa("auto")
    assert launcher.isa() == supported[-1]


def test_an_unknown_variant_is_one_line_naming_the_supported_ones(launcher: ModuleType) -> None:
    launcher.set_isa("avx2")
    with pytest.raises(ValueError) as raised:
        launcher.set_isa("sse2")
    supported = ", ".join(launcher.supported_isas())
    assert str(raised.value) == f'isa must be "auto" or one this CPU supports ({supported}), got "sse2"'
    assert launcher.isa() == "avx2"  # unchanged


def test_a_variant_the_cpu_lacks_is_refused_like_an_unknown_one(launcher: ModuleType) -> None:
    lacking = [name for name in VARIANTS[launcher] if name not in launcher.supported_isas()]
    if not lacking:
        pytest.skip("this CPU supports every variant")
    with pytest.raises(ValueError, match=f'got "{lacking[0]}"'):
        launcher.set_isa(lacking[0])


_AVX2_ONLY_BUILD = """
import torch
from tokenmill_kernels import cpp_build
from tokenmill_kernels.dense_matmul import cpu as dense_matmul
from tokenmill_kernels.paged_attention import cpu as paged_attention
from tokenmill_kernels.quant_matmul import cpu as quant_matmul
from tokenmill_kernels.quant_matmul import reference

cpp_build.cpu_flags = lambda: frozenset({"avx", "avx2", "fma", "f16c"})  # a Zen 3: AVX2 alone
print([launcher.supported_isas() for launcher in (dense_matmul, paged_attention, quant_matmul)])
torch.manual_seed(0)
x, weight = torch.randn(3, 256), torch.randn(96, 256)
packed = reference.quantize_int4(weight)
expected = reference.matmul_int4(x, *packed)
print(bool(torch.allclose(quant_matmul.matmul_int4(x, *packed), expected, rtol=1e-5, atol=1e-4)))
"""


@pytest.mark.slow
def test_a_build_for_a_cpu_without_the_wider_sets_compiles_and_runs_avx2_alone() -> None:
    """What an AVX2-only CPU builds (``cpp_build.variant_flags``: every ``TOKENMILL_BUILD_<SET>=0``) compiles on any
    machine, lists ``avx2`` alone and computes the int4 matmul as the reference does. A machine with the wider sets
    builds them all, so without this test their leaving out would be compiled only on the CPUs that need it."""
    if cpu_kernels_missing() is not None:
        pytest.skip(f"the CPU kernels need what is missing: {cpu_kernels_missing()}")
    result = subprocess.run([sys.executable, "-c", _AVX2_ONLY_BUILD], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["[['avx2'], ['avx2'], ['avx2']]", "True"]
