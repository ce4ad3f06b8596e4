"""The layer kernels plugin (``layer_kernels``): found through its entry point, ``cpu`` picked by ``auto`` on a
CPU that builds it and ``triton`` only on a GPU, both serving the same greedy tokens as the torch reference.

Without a GPU the ``triton`` kernels run under the Triton interpreter: this module sets ``TRITON_INTERPRET=1``
when it is imported, before anything imports the kernel module.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill.engine import now
from tokenmill.layers.kernels import TorchLayerKernels, UsesLayerKernels
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import select_layer_kernels
from tokenmill.plugin_manager import PluginError, Slot, load_plugins
from tokenmill.sampling_params import SamplingParams

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, at their import
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_registered_through_its_entry_point() -> None:
    system = load_plugins(allowlist=["layer_kernels"])
    info = next(info for info in system.infos if info.name == "layer_kernels")
    assert (info.source, info.error) == ("entry point", None)
    assert system.registry.names(Slot.LAYER_KERNEL) == ["cpu", "torch", "triton"]
    assert system.registry.load(Slot.LAYER_KERNEL, "triton").__name__ == "TritonLayerKernels"


def test_auto_picks_cpu_on_a_cpu_and_triton_only_on_a_gpu() -> None:
    system = load_plugins(allowlist=["layer_kernels"])
    expected_on_cpu = "cpu" if _cpu_kernels_available() else "torch"
    assert select_layer_kernels("auto", torch.device("cpu"), system).name == expected_on_cpu
    if torch.cuda.is_available():
        assert select_layer_kernels("auto", torch.device("cuda"), system).name == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
def test_triton_on_cpu_without_the_interpreter_says_what_to_do() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = "from tokenmill_plugins.layer_kernels.triton_kernels import TritonLayerKernels; TritonLayerKernels()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr and "--layer-kernels torch" in result.stderr


def test_an_unknown_name_is_a_one_line_error(tmp_path: Path) -> None:
    save_hf_model("llama-tiny", tmp_path)
    with pytest.raises(PluginError, match="unknown layer_kernel 'fused'; installed: cpu, torch, triton"):
        make_engine(tmp_path, model={"layer_kernels": "fused"})


@pytest.mark.parametrize("kernels", ["triton", "cpu"])
@pytest.mark.parametrize("model", ["llama-tiny", "qwen3-tiny"])  # qwen3: q/k norms over strided heads
def test_layer_kernels_serve_the_same_greedy_tokens(kernels: str, model: str, tmp_path: Path) -> None:
    """End to end through the engine (chunked prefill mixed with decode): the same tokens as ``torch``, and every
    module that calls layer kernels got the selected ones."""
    if kernels == "cpu" and (DEVICE != "cpu" or not _cpu_kernels_available()):
        pytest.skip("the cpu layer kernels run CPU models, on an AVX2 CPU with a C++ toolchain")
    save_hf_model(model, tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 27, 12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for name in ("torch", kernels):
        engine = make_engine(
            tmp_path, model={"layer_kernels": name, "dtype": "float32"}, attention={"backend": "torch"},
            scheduler={"max_num_batched_tokens": 16}, device={"device": DEVICE},
        )  # fmt: skip
        users = [m for m in engine.executor.runner.loaded.model.modules() if isinstance(m, UsesLayerKernels)]
        assert len(users) > 4 and {m.layer_kernels.name for m in users} == {name}
        requests = [EngineCoreRequest(str(i), prompt, params, [], now()) for i, prompt in enumerate(prompts)]
        tokens[name] = run_to_completion(engine, requests)
    assert tokens[kernels] == tokens["torch"]
    assert all(len(generated) == 8 for generated in tokens[kernels].values())


def _cpu_kernels_available() -> bool:
    from tokenmill_kernels.layer_kernels import cpu

    return cpu.is_available()


def test_a_module_calls_the_reference_until_kernels_are_installed() -> None:
    assert isinstance(UsesLayerKernels.layer_kernels, TorchLayerKernels)
