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
from tokenmill.testing.factories import save_tiny_model

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
                         lora={"enable_lora": True, "lora_dtype": "float32"})  # fmt: skip
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


@pytest.mark.parametrize(("quantization", "dtype"), [("none", torch.float32), ("int8", torch.float16),
                                                     ("int4", torch.float16)])  # fmt: skip
def test_auto_dtype_is_float16_over_quantized_linears_on_a_cpu(
    lora_model_dir: Path, quantization: str, dtype: torch.dtype
) -> None:
    """``--lora-dtype auto`` on a CPU: float32 slots over float linears, float16 over quantized ones (a decode step
    reads their weights at 4-8 bits; float32 adapters would add a fifth as much again)."""
    engine = make_engine(lora_model_dir, model={"dtype": "float32", "quantization": quantization},
                         lora={"enable_lora": True})  # fmt: skip
    assert engine.lora is not None and engine.lora.dtype == dtype
    assert all(layer.lora_a.dtype == dtype for layer in engine.lora.layers)


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


@pytest.mark.parametrize("base", ["qwen3-moe-tiny", "mixtral-tiny", "olmoe-tiny", "qwen2-moe-tiny"])
def test_adapters_on_a_mixture_of_experts_match_peft(tmp_path: Path, base: str) -> None:
    """Every target on a MoE base: attention, and the routed experts, which PEFT adapts through their fused
    parameters (``target_parameters`` gate_up_proj and down_proj; Qwen2-MoE's through its shared expert). Each
    expert runs its adapter on the tokens routed to it: logits as PEFT's, greedy tokens too."""
    from tests.lora.conftest import save_peft_adapter

    model_dir = save_tiny_model(tmp_path / "base", base)
    adapter = save_peft_adapter(tmp_path / "adapter", base=base)
    engine = _lora_engine(model_dir, max_lora_rank=16)  # gate_up_proj's rank is gate's and up's: 16
    assert engine.lora is not None
    lora = LoRARequest("m", 1, str(adapter))
    engine.lora.add_adapter(lora)
    reference = peft_model(base, adapter)
    for prompt in PROMPTS:
        logits, expected, base_logits = _logits_beside_peft(engine, lora, reference, prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert (logits - base_logits).abs().max() > 0.1
    tokens = run_to_completion(engine, [_request("r", PROMPTS[0], lora)])["r"]
    with torch.no_grad():
        generated = reference.generate(input_ids=torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert tokens == generated[0, len(PROMPTS[0]) :].tolist()


def _per_expert_adapter(fused: Path, directory: Path, num_experts: int) -> Path:
    """``fused``'s adapter rewritten as adapters over per-expert linears are saved (transformers 4's experts,
    vLLM's per-expert names): ``experts.{e}.gate_proj``/``up_proj``/``down_proj``, each its own lora_A/lora_B."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((fused / "adapter_config.json").read_text())
    tensors = load_file(fused / "adapter_model.safetensors")
    out: dict[str, torch.Tensor] = {}
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for name, tensor in tensors.items():
        if ".experts." not in name or not name.endswith("lora_A.weight"):
            out.setdefault(name, tensor)
            continue
        prefix = name.removesuffix(".lora_A.weight")
        a, b = tensor, tensors[f"{prefix}.lora_B.weight"]
        layer = prefix.split(".experts")[0] + ".experts"
        rank = a.shape[0] // num_experts
        # PEFT wraps target_parameters in order, the last outermost: gate_up_proj is the inner wrapper.
        param = "gate_up_proj" if prefix.endswith(".base_layer") else "down_proj"
        leaves = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
        for expert in range(num_experts):
            a_e = a.reshape(num_experts, rank, -1)[expert]
            b_e = b.reshape(b.shape[0], rank, num_experts)[:, :, expert]
            for index, leaf in enumerate(leaves):
                rows = b_e.shape[0] // len(leaves)
                out[f"{layer}.{expert}.{leaf}.lora_A.weight"] = a_e.clone()
                out[f"{layer}.{expert}.{leaf}.lora_B.weight"] = b_e[index * rows : (index + 1) * rows].clone()
            for leaf in leaves:
                rank_pattern[leaf] = rank
                alpha_pattern[leaf] = config["alpha_pattern"].get(rf".*\.{param}", config["lora_alpha"])
        out.pop(name, None)
        out.pop(f"{prefix}.lora_B.weight", None)
    for name in list(out):
        if ".experts.base_layer." in name or name.endswith(".experts.lora_B.weight"):
            del out[name]
    directory.mkdir()
    config.update(target_parameters=None, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                  target_modules=sorted(set(config["target_modules"]) | set(rank_pattern)))  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(out, directory / "adapter_model.safetensors")
    return directory


def test_per_expert_adapters_equal_the_fused_ones(tmp_path: Path) -> None:
    """An adapter saved over per-expert linears (``experts.{e}.gate_proj``..., as transformers 4 named them) gives
    the logits of the same weights saved over the fused experts; a batch mixing the two, another adapter and the
    base model gives each request what it gets alone."""
    from tests.lora.conftest import save_peft_adapter

    model_dir = save_tiny_model(tmp_path / "base", "qwen3-moe-tiny")
    fused = save_peft_adapter(tmp_path / "fused", base="qwen3-moe-tiny")
    split = _per_expert_adapter(fused, tmp_path / "split", num_experts=8)
    other = save_peft_adapter(tmp_path / "other", base="qwen3-moe-tiny", seed=5)
    loras = [LoRARequest("fused", 1, str(fused)), LoRARequest("split", 2, str(split)),
             LoRARequest("other", 3, str(other)), None]  # fmt: skip
    engine = _lora_engine(model_dir, max_lora_rank=16, max_loras=3)
    assert engine.lora is not None
    for lora in loras[:3]:
        assert lora is not None
        engine.lora.add_adapter(lora)
    prompt = PROMPTS[0]
    outputs = []
    for lora in loras[:2]:
        assert lora is not None
        engine.lora.set_batch([lora], [len(prompt)])
        outputs.append(engine.executor.runner.execute([SequenceChunk(prompt, 0, list(range(8)))], all_logits=True))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
    alone = {}
    for i, lora in enumerate(loras):
        alone[i] = run_to_completion(_lora_engine(model_dir, max_lora_rank=16), [_request(f"r{i}", prompt, lora)])
    together = run_to_completion(
        _lora_engine(model_dir, max_lora_rank=16, max_loras=3),
        [_request(f"r{i}", prompt, lora) for i, lora in enumerate(loras)],
    )
    assert together == {k: v for out in alone.values() for k, v in out.items()}
    assert alone[0]["r0"] == alone[1]["r1"] and len({tuple(alone[i][f"r{i}"]) for i in (0, 2, 3)}) == 3


def test_adapters_on_experts_need_fused_experts_kernels_that_run_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under fused experts kernels that do not run adapters, an adapter on the routed experts is refused in one
    line, and one on attention still serves (the experts hold no slots: an attention adapter once failed the first
    adapted step of a MoE model, whose experts' linears held slots but saw only their tokens)."""
    from tests.lora.conftest import save_peft_adapter
    from tokenmill.layers.fused_experts import TorchFusedExperts
    from tokenmill.lora.adapter import LoRAAdapterError

    monkeypatch.setattr(TorchFusedExperts, "supports_lora", False)
    model_dir = save_tiny_model(tmp_path / "base", "qwen3-moe-tiny")
    engine = make_engine(
        model_dir,
        model={"dtype": "float32", "fused_experts": "torch"},
        lora={"enable_lora": True, "max_lora_rank": 16},
    )
    assert engine.lora is not None
    experts = save_peft_adapter(tmp_path / "experts", base="qwen3-moe-tiny")
    with pytest.raises(LoRAAdapterError, match=r"adapts the routed experts of a mixture of experts \(model\.layers"):
        engine.lora.add_adapter(LoRARequest("e", 1, str(experts)))
    attention = save_peft_adapter(tmp_path / "attention", base="qwen3-moe-tiny", target_modules=["q_proj", "o_proj"])
    lora = LoRARequest("a", 2, str(attention))
    engine.lora.add_adapter(lora)
    logits, expected, _ = _logits_beside_peft(engine, lora, peft_model("qwen3-moe-tiny", attention), PROMPTS[1])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
