"""Adapters against PEFT's forward: logits within 1e-4 in float32, greedy tokens equal, mixed batches exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.factories import make_engine, run_to_completion
from tests.lora.conftest import peft_model
from tokenmill import LoRARequest, SamplingParams
from tokenmill.engine import EngineCore, now
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_runner import SequenceChunk

PROMPTS = [[5, 17, 300, 42, 9, 77, 123, 8, 64, 200, 31], [400, 3, 3, 90], [250, 251, 252, 253, 254, 255, 256]]


def _lora_engine(model_dir: Path, **lora: object) -> EngineCore:
    return make_engine(model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, **lora})


def _request(request_id: str, prompt: list[int], lora: LoRARequest | None, max_tokens: int = 12) -> EngineCoreRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, [], now(), lora_request=lora)


def _logits_beside_peft(
    engine: EngineCore, lora: LoRARequest, reference: Any, prompt: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's logits for ``prompt`` under ``lora``, PEFT's with the adapter, and PEFT's without it."""
    assert engine.lora is not None
    engine.lora.set_batch([lora], [len(prompt)])
    logits = engine.executor.runner.execute([SequenceChunk(prompt, 0, list(range(8)))], all_logits=True)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
        with reference.disable_adapter():
            base = reference(torch.tensor([prompt])).logits[0]
    return logits, expected, base


@pytest.mark.parametrize("index", range(5))
def test_logits_match_peft(lora_model_dir: Path, adapters: list[Path], index: int) -> None:
    engine = _lora_engine(lora_model_dir, max_lora_rank=16)
    assert engine.lora is not None
    lora = LoRARequest(f"a{index}", index + 1, str(adapters[index]))
    engine.lora.add_adapter(lora)
    reference = peft_model("llama-tiny", adapters[index])
    for prompt in PROMPTS:
        logits, expected, base = _logits_beside_peft(engine, lora, reference, prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert (logits - base).abs().max() > 0.1  # the adapter changes the logits well beyond the tolerance


def test_greedy_tokens_match_peft(lora_model_dir: Path, adapters: list[Path]) -> None:
    engine = _lora_engine(lora_model_dir)
    lora = LoRARequest("a0", 1, str(adapters[0]))
    tokens = run_to_completion(engine, [_request("r", PROMPTS[0], lora)])["r"]
    reference = peft_model("llama-tiny", adapters[0])
    with torch.no_grad():
        generated = reference.generate(
            input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    assert tokens == generated[0, len(PROMPTS[0]) :].tolist()
    base = run_to_completion(engine, [_request("b", PROMPTS[0], None)])["b"]
    assert base != tokens


def test_mixed_batch_equals_alone(lora_model_dir: Path, adapters: list[Path]) -> None:
    """Four adapters and the base model in one batch (chunked prefill, prefix caching on): each request gets
    exactly the tokens it gets alone."""
    loras = [LoRARequest(f"a{i}", i + 1, str(adapters[i])) for i in range(4)] + [None]
    alone = {}
    for i, lora in enumerate(loras):
        engine = _lora_engine(lora_model_dir, max_loras=4)
        alone[i] = run_to_completion(engine, [_request(f"r{i}", PROMPTS[0], lora)])[f"r{i}"]
    assert len({tuple(t) for t in alone.values()}) == 5  # every adapter decodes differently
    engine = make_engine(
        lora_model_dir, model={"dtype": "float32"}, lora={"enable_lora": True, "max_loras": 4},
        scheduler={"max_num_batched_tokens": 16},
    )  # fmt: skip
    together = run_to_completion(engine, [_request(f"r{i}", PROMPTS[0], lora) for i, lora in enumerate(loras)])
    assert together == {f"r{i}": tokens for i, tokens in alone.items()}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_adds_the_adapter_on_top(lora_model_dir: Path, adapters: list[Path], quantization: str) -> None:
    """On a quantized base the matmul stays the quantizer's; each part of a merged linear gets its adapter."""
    from safetensors.torch import load_file

    engine = make_engine(lora_model_dir, model={"dtype": "float32", "quantization": quantization},
                         lora={"enable_lora": True})  # fmt: skip
    assert engine.lora is not None
    lora = LoRARequest("a0", 1, str(adapters[0]))
    engine.lora.add_adapter(lora)
    tensors = load_file(str(adapters[0] / "adapter_model.safetensors"))
    layer = engine.loaded.model.model.layers[1].self_attn.qkv_proj
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    base = layer.quantizer.apply(layer, x)
    parts = []
    for name in ("q_proj", "k_proj", "v_proj"):
        prefix = f"base_model.model.model.layers.1.self_attn.{name}"
        parts.append(x @ tensors[f"{prefix}.lora_A.weight"].T @ tensors[f"{prefix}.lora_B.weight"].T * 2.0)
    engine.lora.set_batch([lora], [5])
    torch.testing.assert_close(layer(x), base + torch.cat(parts, dim=1), atol=1e-5, rtol=1e-5)
    engine.lora.set_batch([None], [5])
    torch.testing.assert_close(layer(x), base)


@pytest.mark.parametrize(("lora_dtype", "share"), [("float16", 0.01), ("bfloat16", 0.1)])
@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_narrow_adapter_dtypes_stay_close_to_peft(
    lora_model_dir: Path, adapters: list[Path], lora_dtype: str, share: float, kernels: str
) -> None:
    """--lora-dtype float16/bfloat16 stores the adapters narrower and still adds them in float32: the logits move
    by the weights' rounding only, a small share of what the adapter moves them by."""
    engine = _lora_engine(lora_model_dir, lora_dtype=lora_dtype, lora_kernels=kernels)
    assert engine.lora is not None
    lora = LoRARequest("a0", 1, str(adapters[0]))
    engine.lora.add_adapter(lora)
    logits, expected, base = _logits_beside_peft(engine, lora, peft_model("llama-tiny", adapters[0]), PROMPTS[0])
    error, effect = (logits - expected).abs().max().item(), (expected - base).abs().max().item()
    assert 1e-6 < error < share * effect  # rounded (not float32), but only by the weights' precision


@pytest.mark.parametrize(
    ("base", "targets"),
    [
        ("qwen3-moe-tiny", ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("qwen2-moe-tiny", r".*(self_attn\.(q|v)_proj|shared_expert\.(gate|up|down)_proj)"),
    ],
)
def test_adapters_on_a_mixture_of_experts_base_match_peft(tmp_path: Path, base: str, targets: Any) -> None:
    """On a MoE base, adapters apply to what every token passes through (attention; a shared expert's MLP):
    logits as PEFT's. The routed experts each see only their tokens, so they hold no slots (an adapter on
    attention alone once failed the first adapted step there), and an adapter that adapts them is refused."""
    from tests.lora.conftest import save_peft_adapter
    from tokenmill.lora.adapter import LoRAAdapterError
    from tokenmill.testing.factories import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "base", base)
    adapter = save_peft_adapter(tmp_path / "adapter", base=base, target_modules=targets)
    engine = _lora_engine(model_dir, max_lora_rank=16)
    assert engine.lora is not None
    lora = LoRARequest("m", 1, str(adapter))
    engine.lora.add_adapter(lora)
    reference = peft_model(base, adapter)
    for prompt in PROMPTS[:2]:
        logits, expected, base_logits = _logits_beside_peft(engine, lora, reference, prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert (logits - base_logits).abs().max() > 0.1
    tokens = run_to_completion(engine, [_request("r", PROMPTS[0], lora)])["r"]
    assert len(tokens) == 12
    # Every target: PEFT adapts Qwen3-MoE's routed experts too (Qwen2-MoE's only through the shared expert).
    experts = save_peft_adapter(tmp_path / "experts", base=base)
    if base == "qwen3-moe-tiny":
        with pytest.raises(LoRAAdapterError, match=r"adapts the routed experts of a mixture of experts \(model\."):
            engine.lora.add_adapter(LoRARequest("e", 2, str(experts)))
    else:
        engine.lora.add_adapter(LoRARequest("e", 2, str(experts)))
