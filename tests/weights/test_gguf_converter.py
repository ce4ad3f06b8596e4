"""GGUF files written by llama.cpp's own converter (``convert_hf_to_gguf.py``) for the architectures beyond the
Llama family: Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral (which llama.cpp writes as ``llama`` with stacked experts), Gemma 2,
Gemma 3 text and Phi-3. Each tiny random model is saved with ``save_pretrained``, converted to F32 and to Q8_0, and
read back through tokenmill's loader; the reference is the original checkpoint run by transformers.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file

from tests.factories import make_engine, run_to_completion, save_hf_model, save_tiny_tokenizer
from tests.weights.gguf_util import requantize_gguf
from tests.weights.llama_cpp import convert, save_tiny_sentencepiece
from tokenmill.config import load_config
from tokenmill.engine import now
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.models.architecture import ArchitectureConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.weights import GGUFFormat

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")

#: Tiny config -> overrides. What a GGUF file cannot say is set to what llama.cpp assumes when it runs the file.
CASES: dict[str, dict[str, Any]] = {
    "qwen3-moe-tiny": {"mlp_only_layers": []},  # llama.cpp makes every Qwen-MoE layer sparse
    # Widths the int8 quantizer (which keeps Q8_0 weights exactly) can hold: multiples of 32.
    "qwen2-moe-tiny": {"shared_expert_intermediate_size": 64},
    "mixtral-tiny": {},
    # The converter writes an rms eps of 1e-5 and drops clip_qkv, which llama.cpp's OLMoE never applies.
    "olmoe-tiny": {"rms_norm_eps": 1e-5, "clip_qkv": None},
    # Not stored: llama.cpp scales queries by head_dim below the 27B size,
    "gemma2-tiny": {"query_pre_attn_scalar": 16},
    # ... and makes every sixth Gemma 3 layer global.
    "gemma3-tiny": {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": None},
    "phi3-tiny": {},
    "phi3-longrope": {},  # partial rotary; the LongRoPE factors become tensors
}
#: These ship a byte-level BPE tokenizer; the others a SentencePiece model.
_BPE_TOKENIZER = {"qwen3-moe-tiny", "qwen2-moe-tiny", "olmoe-tiny"}
OUTTYPES = ("f32", "q8_0")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """name -> (the transformers model, its directory); ``{dir}/model-{outtype}.gguf`` beside it."""
    models, jobs = {}, []
    for name, overrides in CASES.items():
        directory = tmp_path_factory.mktemp(name)
        models[name] = (save_hf_model(name, directory, **overrides), directory)
        if name in _BPE_TOKENIZER:
            save_tiny_tokenizer(directory)
        else:
            save_tiny_sentencepiece(directory)
        jobs += [(directory, directory / f"model-{outtype}.gguf", outtype) for outtype in OUTTYPES]
    convert(jobs)
    return models


def _gguf(converted: dict[str, tuple[torch.nn.Module, Path]], name: str, outtype: str) -> Path:
    return converted[name][1] / f"model-{outtype}.gguf"


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", CASES)
def test_config_describes_the_original_model(name: str, converted) -> None:
    from tokenmill_plugins.architectures.moe import moe_config

    hf_model, directory = converted[name]
    original = ArchitectureConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
    for outtype in OUTTYPES:
        from_gguf = ArchitectureConfig.from_hf_config(GGUFFormat().read_config(_gguf(converted, name, outtype)))
        differences = {
            field.name: (getattr(from_gguf, field.name), getattr(original, field.name))
            for field in fields(ArchitectureConfig)
            if field.name not in ("hf_config", "stored_weight_type")
            and getattr(from_gguf, field.name) != getattr(original, field.name)
        }
        if not original.eos_token_ids:  # the file's tokenizer names one where the config has none
            differences.pop("eos_token_ids", None)
        assert differences == {}, (outtype, differences)
        if "moe" in name or "mixtral" in name:
            assert moe_config(from_gguf) == moe_config(original)
    assert (
        ArchitectureConfig.from_hf_config(GGUFFormat().read_config(_gguf(converted, name, "q8_0"))).stored_weight_type
        == "Q8_0"
    )


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("name", CASES)
def test_tensors_are_the_checkpoints(name: str, outtype: str, converted) -> None:
    """Every tensor under its Hugging Face name, experts split back out of llama.cpp's stacks, q/k rows
    unpermuted (Mixtral), Gemma's ``1 + weight`` norms back to ``weight``."""
    hf_model, directory = converted[name]
    original = load_file(directory / "model.safetensors")  # experts one by one, as checkpoints store them
    loaded = {item.name: item.tensor for item in GGUFFormat().iter_tensors(_gguf(converted, name, outtype))}
    tied = {"lm_head.weight"} if hf_model.config.tie_word_embeddings else set()
    assert set(loaded) == set(original) - tied
    # F32 holds the checkpoint (Gemma's norms: (w + 1) - 1 rounds once); Q8_0 each weight within half a step.
    tolerance = 3e-7 if outtype == "f32" else 3e-3
    for tensor_name, tensor in loaded.items():
        torch.testing.assert_close(tensor, original[tensor_name], atol=tolerance, rtol=0, msg=tensor_name)


def _load(path: Path) -> LoadedModel:
    return load_model(load_config(overrides={"model": {"model": str(path)}, "device": {"device": "cpu"}}))


@pytest.mark.parametrize("name", CASES)
def test_logits_match_the_original_within_1e_4(name: str, converted) -> None:
    hf_model, _ = converted[name]
    loaded = _load(_gguf(converted, name, "f32"))
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    prompts = _prompts([23, 5, 40], seed=1)  # longer than the sliding windows (8)
    chunks, next_block = [], 0
    for prompt in prompts:
        num_blocks = -(-len(prompt) // 4)
        chunks.append(SequenceChunk(prompt, 0, list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    logits = runner.execute(chunks, all_logits=True)
    start = 0
    for prompt in prompts:
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0].float()  # [seq_len, vocab]
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=1e-4, rtol=0)
        start += len(prompt)


def _expected_quantizer() -> str:
    """What ``quantization = "auto"`` keeps a Q8_0 file's weights in: int8 holds them exactly, where it runs."""
    from tokenmill_plugins.quant.weight_only import Int8Quantizer

    return "int8" if Int8Quantizer.is_available() else "none"


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("name", CASES)
def test_greedy_through_the_engine_equals_transformers(name: str, outtype: str, converted, tmp_path: Path) -> None:
    """Batched, chunked prefill and paged decode on the GGUF file against transformers' ``generate`` on the same
    weights: the original checkpoint for F32, the file's dequantized weights for Q8_0 (run by tokenmill through
    the int8 quantizer, experts included)."""
    from tokenmill.layers.linear import Linear

    hf_model, directory = converted[name]
    path = _gguf(converted, name, outtype)
    if outtype != "f32":  # the file's weights, dequantized, as a checkpoint of the same config
        dequantized = tmp_path / "dequantized"
        dequantized.mkdir()
        shutil.copy(directory / "config.json", dequantized)
        save_file(
            {item.name: item.tensor for item in GGUFFormat().iter_tensors(path)}, dequantized / "model.safetensors"
        )
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    engine = make_engine(path, scheduler={"max_num_batched_tokens": 16})  # forces chunked prefill
    model = engine.executor.runner.loaded.model
    expected_quantizer = "none" if outtype == "f32" else _expected_quantizer()
    assert {m.quantizer.name for m in model.modules() if isinstance(m, Linear)} == {expected_quantizer}
    prompts = _prompts([5, 30, 12], seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = run_to_completion(
        engine, [EngineCoreRequest(str(i), p, params, [], now()) for i, p in enumerate(prompts)]
    )
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None
            )
        assert outputs[str(i)] == generated[0, len(prompt) :].tolist(), i


def test_docs_models_gguf_column_says_which_architectures_read_gguf() -> None:
    from tokenmill.models.catalog import architecture_table
    from tokenmill.plugin_manager import load_plugins

    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    rows = {
        line.split("|")[1].strip(" `"): line.split("|")[-2].strip()
        for line in page.splitlines()
        if line.startswith("| `")
    }
    for row in architecture_table(load_plugins(allowlist=["architectures"]).registry):
        if not row.is_fallback:
            assert rows[row.architecture].startswith("yes") == row.reads_gguf, row.architecture


def test_q4_1_experts_are_held_exactly_by_int4(converted, tmp_path: Path) -> None:
    """A Q4_1 MoE file (the converter's F32 one quantized as llama-quantize would): ``auto`` keeps every linear,
    each expert included, in the int4 quantizer, which holds the file's blocks exactly."""
    from tokenmill_plugins.quant.weight_only import Int4Quantizer

    from tokenmill.layers.moe import ExpertMLP, Experts

    if not Int4Quantizer.is_available():
        pytest.skip("the int4 quantizer needs AVX2, FMA and a compiler")
    path = requantize_gguf(_gguf(converted, "qwen3-moe-tiny", "f32"), tmp_path / "model-q4_1.gguf", QType.Q4_1)
    tensors = {item.name: item.tensor for item in GGUFFormat().iter_tensors(path)}
    model = _load(path).model
    experts_by_name = {name: module for name, module in model.named_modules() if isinstance(module, Experts)}
    assert len(experts_by_name) == 2  # one per layer
    for module_name, experts in experts_by_name.items():
        for expert_index, expert in enumerate(experts):
            assert isinstance(expert, ExpertMLP)
            prefix = f"{module_name}.{expert_index}"
            for linear, parts in ((expert.gate_up_proj, ("gate_proj", "up_proj")), (expert.down_proj, ("down_proj",))):
                quantizer = linear.quantizer
                assert isinstance(quantizer, Int4Quantizer)
                held = quantizer.dequantize(*(getattr(linear, name) for name in quantizer.storage_names))
                assert torch.equal(held, torch.cat([tensors[f"{prefix}.{part}.weight"] for part in parts])), prefix
