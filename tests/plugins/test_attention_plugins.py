"""The GPU attention plugin (``attention``): found through its entry point, and serving like ``torch``.

Without a GPU the ``triton`` backend runs under the Triton interpreter: this
module sets ``TRITON_INTERPRET=1`` when it is imported, before anything
imports the kernel module (the backend is imported only when a test selects
it). The ``cuda`` backend needs CUDA and CuPy; here only its refusal is tested.
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
from tokenmill import AttentionLayerSpec
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_runner import SequenceChunk, build_batch
from tokenmill.plugin_manager import PluginError, Slot, load_plugins
from tokenmill.sampling_params import SamplingParams

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, at their import
#: The GPU when there is one; else the CPU, where the Triton kernels run under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_registered_through_its_entry_point() -> None:
    system = load_plugins(allowlist=["attention"])
    info = next(info for info in system.infos if info.name == "attention")
    assert (info.source, info.error) == ("entry point", None)
    assert {"triton", "cuda"} <= set(info.provides["attention_backend"])
    assert {"torch", "triton", "cuda"} <= set(system.registry.names(Slot.ATTENTION_BACKEND))
    backend_class = system.registry.load(Slot.ATTENTION_BACKEND, "triton")
    assert (backend_class.__name__, backend_class.name) == ("TritonAttentionBackend", "triton")


def test_listing_imports_neither_torch_nor_triton() -> None:
    """The registration module stays light: the front end lists plugins without torch."""
    code = (
        "import sys; from tokenmill.plugin_manager import load_plugins; "
        "system = load_plugins(allowlist=['attention']); "
        "assert [i.error for i in system.infos if i.name == 'attention'] == [None]; "
        "print(sorted(m for m in ('torch', 'triton', 'cupy') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_triton_backend_matches_the_torch_backend() -> None:
    """Same cache, same mixed batch (prefill chunk after a prefix, decode tokens, blocks out of order)."""
    from tokenmill_plugins.attention.triton_backend import TritonAttentionBackend

    from tokenmill.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(0)
    spec = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_dim=32, scale=32**-0.5, sliding_window=5)
    chunks = [SequenceChunk([1] * 6, 3, [2, 0, 5]), SequenceChunk([1], 9, [1, 3, 4]), SequenceChunk([1], 0, [6])]
    _, metadata = build_batch(chunks, block_size=4, device=torch.device(DEVICE))
    q, k, v = (torch.randn(8, heads, 32).to(DEVICE) for heads in (4, 2, 2))
    outputs, caches = [], []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        cache = torch.randn(2, 7, 4, 2, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        backend.prepare(metadata, 4)
        outputs.append(backend.forward(spec, q, k, v, cache, metadata))
        caches.append(cache)
    torch.testing.assert_close(caches[0], caches[1], atol=0, rtol=0)
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "model, overrides, kv_cache_dtype",
    [
        ("qwen3-tiny", {}, "auto"),  # head_dim 32, q/k norms
        ("mistral-tiny", {"head_dim": 32}, "auto"),  # sliding window of 8 tokens, shorter than the prompts
        ("mistral-tiny", {"head_dim": 32}, "fp8"),  # quantized caches: the same bytes, read alike
        ("qwen3-tiny", {}, "int8"),
    ],
)
def test_triton_backend_serves_the_same_greedy_tokens(
    model: str, overrides: dict, kv_cache_dtype: str, tmp_path: Path
) -> None:
    """End to end through the engine (chunked prefill mixed with decode): the same tokens as ``torch``."""
    save_hf_model(model, tmp_path, **overrides)
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 27, 12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = make_engine(
            tmp_path, attention={"backend": backend}, scheduler={"max_num_batched_tokens": 16},
            cache={"kv_cache_dtype": kv_cache_dtype}, device={"device": DEVICE}, model={"dtype": "float32"},
        )  # fmt: skip
        assert engine.config.attention.backend == backend
        requests = [EngineCoreRequest(str(i), prompt, params, [], now()) for i, prompt in enumerate(prompts)]
        tokens[backend] = run_to_completion(engine, requests)
    assert tokens["triton"] == tokens["torch"]
    assert all(len(generated) == 8 for generated in tokens["triton"].values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
def test_cuda_backend_refuses_without_cuda() -> None:
    from tokenmill_plugins.attention.cuda_backend import CudaAttentionBackend

    with pytest.raises(PluginError, match="'cuda' attention backend cannot run here: no CUDA device"):
        CudaAttentionBackend()


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal on a machine without CUDA")
def test_triton_backend_on_cpu_without_the_interpreter_says_what_to_do() -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = "from tokenmill_plugins.attention.triton_backend import TritonAttentionBackend; TritonAttentionBackend()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "set TRITON_INTERPRET=1" in result.stderr
    assert "--attention-backend torch" in result.stderr
