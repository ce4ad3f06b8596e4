"""Checkpoints quantized by llm-compressor and GPTQModel (``checkpoints/``, made by ``make_checkpoints.py``) run in
tokenmill as the producing tool runs them: logits at every prompt position against the tool's own (stored in each
checkpoint's ``reference.safetensors``), and greedy continuations through the engine, alone and batched.

Tolerances, in logits (the references' logits reach about 4):

* weight-only formats (GPTQ, AWQ, W4A16, W8A16): 0.01. tokenmill stores group scales as float16 and rounds its
  inputs to int16 per 32 for the kernels; GPTQModel's references dequantize in float16.
* formats that quantize activations (FP8, W8A8): 0.1. Both sides round every linear's input to 8 bits; a float32
  difference of one ulp upstream can move an input across a rounding boundary, which moves it by a whole step
  (1/127 of the token's absmax for int8), and the tiny random model passes such steps on. With the same rounding
  and float32 matmuls (FP8 dynamic) the logits agree to 1e-5.

Greedy tokens must equal the tool's, except where its two best logits are within ``NEAR_TIE`` (0.05) of each other
(the tiny random model has such near ties; ``ct-fp8-dynamic`` decodes one with a margin of 0.022 differently);
after such a step the texts differ and are not compared.

A MoE checkpoint that quantizes activations (``ct-moe-w8a8-int8``) moves its routers' logits by those steps too (up
to 0.05), and the tiny random model's routers have near ties in both prompts (layer 1, token 9 of the first: the
second and third experts 0.006 apart; token 1 of the second: 0.0008), where the two sides pick different experts.
Its reference keeps the tool's router logits: tokenmill's must be within 0.1 of them, and the logits are compared
with tokenmill routing as the tool did. Its greedy tokens, downstream of those ties, are compared between alone and
batched instead.
"""

from __future__ import annotations

import contextlib
import json
import unittest.mock
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.factories import make_engine, run_to_completion
from tokenmill.config import load_config
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.sampling_params import SamplingParams

CHECKPOINTS = Path(__file__).parent / "checkpoints"
NAMES = sorted(p.name for p in CHECKPOINTS.iterdir() if (p / "reference.safetensors").is_file())
#: Which quantizer ``quantization = "auto"`` must pick, by the checkpoint name's prefix.
QUANTIZERS = {"ct-": "compressed-tensors", "gptq-": "gptq", "awq-": "awq"}
ACTIVATION_QUANTIZED = ("ct-fp8-", "ct-w8a8-", "ct-moe-w8a8-")
NEAR_TIE = 0.05


def _reference(name: str) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = CHECKPOINTS / name / "reference.safetensors"
    with safe_open(path, framework="pt") as f:
        prompts = json.loads((f.metadata() or {})["prompts"])
    return prompts, load_file(path)


def _tolerance(name: str) -> float:
    return 0.1 if name.startswith(ACTIVATION_QUANTIZED) else 0.01


def test_every_producer_and_format_is_carried() -> None:
    """The suite covers what the issue lists; a checkpoint dropped by a remake fails here, not silently."""
    assert set(NAMES) >= {
        "ct-w4a16-gptq", "ct-w4a16-gptq-actorder", "ct-w4a16-asym-awq", "ct-w8a16-gptq", "ct-fp8-dynamic",
        "ct-fp8-static", "ct-w8a8-int8", "gptq-4bit-g32-sym", "gptq-4bit-g64-asym", "gptq-4bit-g128-asym-actorder",
        "gptq-8bit-channel-sym", "gptq-8bit-g128-asym-actorder", "awq-4bit-g128-gemm",
        "ct-moe-w4a16-gptq", "gptq-moe-4bit-g32-asym", "gptq-moe-mixtral-4bit-g64-sym", "gptq-moe-qwen2-4bit-g32-sym",
        "ct-moe-w8a8-int8", "ct-moe-w4a16-asym-awq", "awq-moe-4bit-g32-gemm",
    }  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_the_producing_tool(name: str) -> None:
    _check_logits(name)


@pytest.mark.parametrize(
    ("name", "planted"),
    [
        ("gptq-4bit-g32-sym", "tokenmill_plugins.quant.gptq.GPTQQuantizer.zero_offset"),  # v1's stored zero - 1
        ("awq-4bit-g128-gemm", "tokenmill_plugins.quant.awq._ORDER"),  # AWQ's interleaved columns
    ],
)
def test_a_wrong_unpacking_fails_the_comparison(name: str, planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The logit comparison can fail: ignoring GPTQ v1's zero offset or AWQ's column order is caught."""
    wrong: object = 0 if planted.endswith("zero_offset") else tuple(range(8))
    if planted.endswith("zero_offset"):
        real_configure = __import__("tokenmill_plugins.quant.gptq", fromlist=["GPTQQuantizer"]).GPTQQuantizer.configure

        def configure(self, quantization_config) -> None:  # type: ignore[no-untyped-def]
            real_configure(self, quantization_config)
            self.zero_offset = wrong

        monkeypatch.setattr("tokenmill_plugins.quant.gptq.GPTQQuantizer.configure", configure)
    else:
        monkeypatch.setattr(planted, wrong)
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE", "0")
    with pytest.raises(AssertionError):
        _check_logits(name)


def test_experts_loaded_in_the_wrong_order_fail_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE checkpoints' comparison can fail: experts 0 and 1 of each layer swapped at load is caught."""
    from tokenmill_plugins.architectures import moe

    real = moe.local_expert_tensors

    def swapped(model, tensors):  # type: ignore[no-untyped-def]
        for item in real(model, tensors):
            swap = {".experts.0.": ".experts.1.", ".experts.1.": ".experts.0."}
            name = next((item.name.replace(a, b) for a, b in swap.items() if a in item.name), item.name)
            yield type(item)(name, item.tensor, item.file)

    monkeypatch.setattr(moe, "local_expert_tensors", swapped)
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE", "0")
    for name in NAMES:
        if "-moe-" not in name:
            continue
        with pytest.raises(AssertionError):
            _check_logits(name)


def _check_logits(name: str, device: str = "cpu") -> None:
    """tokenmill's logits at every prompt position against the tool's, in float32 on ``device`` (tests/gpu runs it
    on CUDA, on the GPU's dequantizing matmuls)."""
    prompts, reference = _reference(name)
    config = load_config(overrides={
        "model": {"model": str(CHECKPOINTS / name), "dtype": "float32"}, "device": {"device": device},
        "cache": {"kv_cache_dtype": "float32"},  # the references keep K/V in float32
    })  # fmt: skip
    loaded = load_model(config)
    expected_quantizer = next(q for prefix, q in QUANTIZERS.items() if name.startswith(prefix))
    assert loaded.model.model.layers[0].self_attn.qkv_proj.quantizer.name == expected_quantizer
    assert loaded.model.lm_head.quantizer.name == "none"  # every tool leaves lm_head in float
    if "-moe-" in name:  # the routed experts are quantized per expert, the routers left in float
        assert loaded.model.model.layers[0].mlp.experts[0].gate_up_proj.quantizer.name == expected_quantizer
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    # Both prompts in one flattened batch, disjoint blocks.
    chunks = [SequenceChunk(prompts[0], 0, list(range(0, 3))), SequenceChunk(prompts[1], 0, list(range(3, 5)))]
    with _routed_as_the_tool(reference, len(prompts), _tolerance(name)):
        logits = runner.execute(chunks, all_logits=True).cpu()
    start = 0
    for index, prompt in enumerate(prompts):
        expected = reference[f"logits.{index}"]
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=_tolerance(name), rtol=0)
        start += len(prompt)


@contextlib.contextmanager
def _routed_as_the_tool(reference: dict[str, torch.Tensor], num_prompts: int, tolerance: float) -> Iterator[None]:
    """While it lasts, each MoE layer (in order, over the prompts batched in order) checks its router logits against
    the tool's and picks the experts the tool's pick, when ``reference`` keeps them; otherwise nothing changes."""
    if "router_logits.0" not in reference:
        yield
        return
    from tokenmill.layers import moe

    layers = iter(torch.cat([reference[f"router_logits.{i}"] for i in range(num_prompts)], dim=1))  # [tokens, experts]
    select = moe.select_experts

    def as_the_tool(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        expected = next(layers)
        torch.testing.assert_close(router_logits.float().cpu(), expected, atol=tolerance, rtol=0)
        return select(expected.to(router_logits.device), top_k, renormalize)

    with unittest.mock.patch.object(moe, "select_experts", as_the_tool):
        yield
    assert next(layers, None) is None  # every layer was routed


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_the_producing_tool_alone_and_batched(name: str) -> None:
    prompts, reference = _reference(name)
    engine = make_engine(CHECKPOINTS / name, cache={"kv_cache_dtype": "float32"})
    num_tokens = len(reference["greedy.0"])
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    alone = [run_to_completion(engine, [EngineCoreRequest(f"a{i}", p, params, [], 0.0)])[f"a{i}"]
             for i, p in enumerate(prompts)]  # fmt: skip
    # Batched with each other and with a longer request that joins mid-way through their prompts.
    filler = [(7 * i) % 500 + 3 for i in range(40)]
    batch = [EngineCoreRequest(f"b{i}", p, params, [], 0.0) for i, p in enumerate(prompts)]
    batch.append(EngineCoreRequest("filler", filler, params, [], 0.0))
    batched = run_to_completion(engine, batch)
    if "router_logits.0" in reference:  # routed through near ties the two sides break differently (docstring)
        assert [alone[i] for i in range(len(prompts))] == [batched[f"b{i}"] for i in range(len(prompts))]
        return
    for index in range(len(prompts)):
        expected = reference[f"greedy.{index}"].tolist()
        margins = reference[f"margins.{index}"].tolist()
        _assert_same_up_to_near_tie(alone[index], expected, margins)
        _assert_same_up_to_near_tie(batched[f"b{index}"], expected, margins)


def _assert_same_up_to_near_tie(got: list[int], expected: list[int], margins: list[float]) -> None:
    """``got == expected`` up to the first step where the reference's two best logits were within NEAR_TIE; the
    rest follows a different text and is not compared."""
    for step, (token, reference_token) in enumerate(zip(got, expected, strict=True)):
        if token != reference_token:
            assert margins[step] < NEAR_TIE, (
                f"token {step} is {token}, the reference's {reference_token} led by {margins[step]:.3f}"
            )
            return


def test_fp8_dynamic_experts_follow_the_format_definition() -> None:
    """``ct-moe-fp8-dynamic`` (llm-compressor's FP8_DYNAMIC on a Qwen3-MoE, no tool reference: see
    make_checkpoints.py): a MoE block's output equals the format's definition computed here from the checkpoint's
    tensors (FP8 weights times their channel scales; each input rounded to FP8 per token, absmax / 448), and the
    same without the inputs' rounding is far from it, so a layer that skipped it would fail."""
    from safetensors.torch import load_file

    directory = CHECKPOINTS / "ct-moe-fp8-dynamic"
    config = load_config(overrides={"model": {"model": str(directory)}, "device": {"device": "cpu"}})
    block = load_model(config).model.model.layers[0].mlp
    tensors = load_file(directory / "model.safetensors")
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))

    def weight(name: str) -> torch.Tensor:
        return tensors[f"model.layers.0.mlp.{name}.weight"].float() * tensors[f"model.layers.0.mlp.{name}.weight_scale"]

    def fp8_rounded(t: torch.Tensor) -> torch.Tensor:
        scale = t.abs().amax(-1, keepdim=True) / 448.0
        return (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale

    def definition(rounded) -> torch.Tensor:  # type: ignore[no-untyped-def]
        probs = torch.softmax(x @ tensors["model.layers.0.mlp.gate.weight"].float().T, dim=-1)
        top, experts = probs.topk(2, dim=-1)
        top = top / top.sum(-1, keepdim=True)  # norm_topk_prob
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(2):
                e, xt = int(experts[t, k]), rounded(x[t : t + 1])
                inner = F.silu(xt @ weight(f"experts.{e}.gate_proj").T) * (xt @ weight(f"experts.{e}.up_proj").T)
                out[t] += top[t, k] * (rounded(inner) @ weight(f"experts.{e}.down_proj").T)[0]
        return out

    with torch.no_grad():
        got = block(x)
    torch.testing.assert_close(got, definition(fp8_rounded), atol=1e-5, rtol=0)
    assert (got - definition(lambda t: t)).abs().max() > 1e-2
