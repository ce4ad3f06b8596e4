"""A CPU install has no Triton or CuPy (they are the ``gpu`` extra): the GPU attention backends and layer
kernels are passed over quietly, and naming one says what to install."""

from __future__ import annotations

import subprocess
import sys

# Run in a fresh interpreter where importing triton or cupy fails, as on a CPU install.
_PRELUDE = """
import logging, sys
sys.modules["triton"] = None
sys.modules["cupy"] = None
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
import torch
from tokenmill.model_loader import select_attention_backend, select_layer_kernels
from tokenmill.plugin_manager import PluginError, Slot, load_plugins
plugins = load_plugins(allowlist=["attention", "layer_kernels"])
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-c", _PRELUDE + code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


def test_auto_selection_without_triton_warns_about_nothing() -> None:
    result = _run('print(select_attention_backend("auto", torch.device("cpu"), plugins, 64).name)')
    assert result.stdout.strip() == "cpu"
    assert not [line for line in result.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))], result.stderr
    assert "triton" not in result.stderr.lower().replace("tokenmill_plugins.attention.triton_backend", "")


def test_naming_a_gpu_backend_without_triton_says_what_to_install() -> None:
    code = """
for name in ("triton", "cuda"):
    backend_class = plugins.load(Slot.ATTENTION_BACKEND, name)  # the module imports without Triton
    assert not backend_class.is_available()
try:
    plugins.load(Slot.ATTENTION_BACKEND, "triton")()
except PluginError as exc:
    print(exc)
"""
    result = _run(code)
    assert "needs Triton, which is not installed: pip install 'tokenmill[gpu]'" in result.stdout


def test_layer_kernels_without_triton_fall_back_quietly_and_say_what_to_install_when_named() -> None:
    code = """
print(select_layer_kernels("auto", torch.device("cpu"), plugins).name)
assert not plugins.load(Slot.LAYER_KERNEL, "triton").is_available()  # the module imports without Triton
try:
    plugins.load(Slot.LAYER_KERNEL, "triton")()
except PluginError as exc:
    print(exc)
"""
    result = _run(code)
    lines = result.stdout.strip().splitlines()
    assert lines[0] in ("cpu", "torch")  # cpu where the C++ builds, never triton
    assert lines[1] == (
        "the layer_kernel 'triton' needs Triton, which is not installed: pip install 'tokenmill[gpu]', "
        "or select --layer-kernels torch"
    )
    assert not [line for line in result.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))], result.stderr
