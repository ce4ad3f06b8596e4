"""Makes the quantized checkpoints that tests/models/quantized/ loads, with the field's own tools.

Each checkpoint is a tiny random Llama (hidden 128, intermediate 384, vocab 512, 2 layers, seed 0, with the tiny
test tokenizer), or for the ``*-moe-*`` ones a tiny random mixture of experts (``MOE_MODELS``: Qwen3-MoE, Mixtral,
Qwen2-MoE), quantized by llm-compressor (compressed-tensors formats) or GPTQModel (GPTQ and AWQ formats) on random
token calibration data. CI cannot install either tool (llm-compressor pins an older transformers; GPTQModel is a
large install), so the checkpoints are carried in ``checkpoints/`` and this script remakes them. Run each producer
in a virtual environment that has it, with this repository on ``PYTHONPATH`` (for the tiny model factory)::

    python -m venv /tmp/lc && /tmp/lc/bin/pip install -c constraints.txt torch==2.13.0 llmcompressor msgspec pluggy
    PYTHONPATH=core:. /tmp/lc/bin/python tests/models/quantized/make_checkpoints.py llmcompressor
    python -m venv /tmp/gq && /tmp/gq/bin/pip install -c constraints.txt torch==2.13.0 gptqmodel msgspec pluggy
    GPTQMODEL_CPU_WORKERS=2 PYTHONPATH=core:. /tmp/gq/bin/python tests/models/quantized/make_checkpoints.py gptqmodel

(seen working with llmcompressor 0.14.0.1 / compressed-tensors 0.19.0 / transformers 5.17.0, and GPTQModel 7.6.0 /
transformers 5.24.0, torch 2.13.0+cpu, 2026-11-25.)

Beside each checkpoint it stores ``reference.safetensors``: the producing tool's float32 logits at every position
of each of ``PROMPTS``, its greedy continuation of each, and at each greedy step the margin between its two best
logits (so that tests can tell a near tie from a wrong token). For llm-compressor's checkpoints the reference is
transformers running them through compressed-tensors (transformers 5.24 with compressed-tensors 0.19 fails to load
the asymmetric ones, so the tests do not recompute it live); for GPTQModel's, transformers in float32 with each
quantized linear replaced by GPTQModel's own dequantization of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
CHECKPOINTS = HERE / "checkpoints"
#: The tiny base model: group sizes up to 128 divide every in_features (128 and 384).
BASE_CONFIG: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 384}
#: The tiny mixtures of experts (8 experts, top 2; Qwen3-MoE with every layer sparse, as in the released models and
#: as AWQ's mappings for it expect) for the formats' MoE checkpoints (``*-moe-*``), by factory name. Group sizes up
#: to 128 divide every in_features here too.
MOE_MODELS: dict[str, dict[str, Any]] = {
    "qwen3-moe-tiny": {"hidden_size": 128, "moe_intermediate_size": 128, "mlp_only_layers": []},
    "mixtral-tiny": {"hidden_size": 128, "intermediate_size": 128},
    "qwen2-moe-tiny": {"hidden_size": 128, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 256},
}
#: The tools' own advice for MoE models: routers stay in float (they are no quantized linears in tokenmill).
MOE_IGNORE = ["lm_head", "re:.*mlp.gate$"]
#: Token prompts the references are computed on (ids of the tiny tokenizer, none special).
PROMPTS: tuple[tuple[int, ...], ...] = (
    (17, 260, 301, 45, 99, 400, 12, 7, 388, 261, 262, 263),
    (500, 3, 77, 78, 79),
)
NUM_GREEDY_TOKENS = 12
NUM_CALIBRATION_SAMPLES = 32
CALIBRATION_LENGTH = 64


def _calibration_ids() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return [
        torch.randint(3, 512, (CALIBRATION_LENGTH,), generator=generator).tolist()
        for _ in range(NUM_CALIBRATION_SAMPLES)
    ]


def _base(directory: Path) -> Path:
    from tokenmill.testing.factories import save_tiny_model

    shutil.rmtree(directory, ignore_errors=True)
    return save_tiny_model(directory, "llama-tiny", seed=0, **BASE_CONFIG)


def _moe_base(directory: Path, name: str = "qwen3-moe-tiny") -> Path:
    from tokenmill.testing.factories import save_hf_model, save_tiny_tokenizer

    shutil.rmtree(directory, ignore_errors=True)
    save_hf_model(name, directory, seed=0, **MOE_MODELS[name])
    save_tiny_tokenizer(directory)
    return directory


def _clean(directory: Path) -> None:
    """Keep what a model directory needs; drop tool logs and recipes that would only churn."""
    for name in ("recipe.yaml", "quant_log.csv"):
        (directory / name).unlink(missing_ok=True)


# ------------------------------------------------------------------ llm-compressor


def make_with_llmcompressor(work: Path, only: list[str]) -> None:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        # llm-compressor's AWQ pins its activation cache in page-locked memory, which torch refuses without
        # an accelerator; on the CPU pinning would change nothing, so it becomes a no-op.
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    base = _base(work / "base")
    ids = _calibration_ids()
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})

    def group_scheme(num_bits: int, group_size: int, symmetric: bool, actorder: str | None = None) -> Any:
        weights = QuantizationArgs(
            num_bits=num_bits,
            type="int",
            strategy="group",
            group_size=group_size,
            symmetric=symmetric,
            actorder=actorder,
        )
        return QuantizationScheme(targets=["Linear"], weights=weights)

    recipes: dict[str, Any] = {
        # The W4A16 preset: symmetric, groups of 128.
        "ct-w4a16-gptq": GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
        # Activation order ("weight": columns visited by Hessian order, groups kept in place) with groups of 32.
        "ct-w4a16-gptq-actorder": GPTQModifier(
            config_groups={"group_0": group_scheme(4, 32, True, actorder="weight")}, ignore=["lm_head"]
        ),
        # The W4A16_ASYM preset through AWQ: zero points.
        "ct-w4a16-asym-awq": AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=["lm_head"]),
        # 8-bit weights per channel.
        "ct-w8a16-gptq": GPTQModifier(targets="Linear", scheme="W8A16", ignore=["lm_head"]),
        # FP8 weights per channel, FP8 activations per token (dynamic): the FP8_DYNAMIC preset.
        "ct-fp8-dynamic": QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]),
        # FP8 weights per tensor, FP8 activations per tensor with a calibrated (static) scale: the FP8 preset.
        "ct-fp8-static": QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"]),
        # INT8 weights per channel, INT8 activations per token (dynamic): the W8A8 preset.
        "ct-w8a8-int8": GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
    }
    moe_recipes: dict[str, Any] = {
        # The routed experts quantized per expert, as llm-compressor's MoE examples do (routers left in float).
        "ct-moe-w4a16-gptq": GPTQModifier(config_groups={"group_0": group_scheme(4, 32, True)}, ignore=MOE_IGNORE),
        # No reference beside it: with linear experts, transformers' forward disagrees with the checkpoint's own
        # dequantized weights by about 0.06 per linear (why, I did not find), and with fused experts it runs them
        # in bfloat16 without rounding their inputs; the tests check it against the format's definition instead.
        "ct-moe-fp8-dynamic": QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=MOE_IGNORE),
        # INT8 experts per channel with INT8 activations per token (dynamic): the W8A8 preset.
        "ct-moe-w8a8-int8": GPTQModifier(targets="Linear", scheme="W8A8", ignore=MOE_IGNORE),
        # The W4A16_ASYM preset through AWQ: zero points.
        "ct-moe-w4a16-asym-awq": AWQModifier(targets="Linear", scheme="W4A16_ASYM", ignore=MOE_IGNORE),
    }
    for output in _oneshot_each(recipes, only, base, dataset, CHECKPOINTS, CALIBRATION_LENGTH):
        # transformers runs the checkpoint through compressed-tensors (weights dequantized, activations
        # quantized and dequantized as the scheme says).
        _write_reference(AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32), output)
    moe_base = _moe_base(work / "moe-base")
    for output in _oneshot_each(moe_recipes, only, moe_base, dataset, CHECKPOINTS, CALIBRATION_LENGTH):
        if output.name != "ct-moe-fp8-dynamic":
            # With int8 activations, one rounding step apart between two implementations can pick another expert
            # at a near tie: the reference keeps its routing, and the tests route as it did.
            _write_reference(_linearized_qwen3_moe(output), output, routing="w8a8" in output.name)


def _linearized_qwen3_moe(directory: Path) -> Any:
    """A Qwen3-MoE compressed-tensors checkpoint in transformers with llm-compressor's linear experts, so that
    compressed-tensors runs each expert as the scheme says. transformers' own fused experts dequantize them to
    bfloat16 and skip the activations' quantization, and llm-compressor's ``load_quantizable_moe`` walks every
    transformers module, which needs torchvision; so this does its two steps for Qwen3-MoE alone."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3_moe
    from llmcompressor.modeling.moe.conversion_mappings import get_linearize_load_mappings
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    if not issubclass(qwen3_moe.Qwen3MoeExperts, LinearExperts2D):  # patched once per process
        experts, load_map, _ = get_linearize_load_mappings("qwen3_moe")
        qwen3_moe.Qwen3MoeExperts = LinearExperts2D.get_linear_experts_cls(experts)  # type: ignore[misc]
        register_checkpoint_conversion_mapping("qwen3_moe", load_map, overwrite=True)
        init_weights = qwen3_moe.Qwen3MoePreTrainedModel._init_weights

        def _init_weights(self: Any, module: Any) -> None:  # the fused experts' random init, on linear ones
            if not isinstance(module, LinearExperts2D):
                init_weights(self, module)

        qwen3_moe.Qwen3MoePreTrainedModel._init_weights = _init_weights  # type: ignore[method-assign]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert isinstance(model.model.layers[0].mlp.experts, LinearExperts2D)
    return model


def make_default_with_llmcompressor(work: Path, only: list[str]) -> None:
    """The default model (SmolLM2-135M-Instruct Q4_1), dequantized by transformers into a float32 Hugging Face
    directory, then quantized by llm-compressor in each format, calibrated on 64 windows of 512 tokens of
    tokenmill's bundled calibration text: the checkpoints docs/quantization.md measures. Written to ``work``
    (about 1.3 GB in all), not committed."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from tokenmill_plugins.commands.quantize.calibration import default_calibration_text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenmill.model_files import resolve_model

    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    gguf = resolve_model("SmolLM2-135M-Instruct-Q4_1")
    base = work / "default-float32"
    if not (base / "model.safetensors").is_file():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # Dequantized on load; what remains of "GGUF" is a marker that makes save_pretrained refuse.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenizer(default_calibration_text())["input_ids"]
    windows = [ids[i : i + 512] for i in range(0, len(ids) - 512, 512)][:64]
    dataset = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * len(w) for w in windows]})

    def groups_of_64(num_bits: int, symmetric: bool) -> Any:
        # The presets' groups of 128 do not divide the default model's hidden size (576); 64 does.
        weights = QuantizationArgs(num_bits=num_bits, type="int", strategy="group", group_size=64, symmetric=symmetric)
        return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}

    recipes: dict[str, Any] = {
        "default-w4a16-gptq": GPTQModifier(config_groups=groups_of_64(4, True), ignore=["lm_head"]),
        "default-w4a16-asym-awq": AWQModifier(config_groups=groups_of_64(4, False), ignore=["lm_head"]),
        "default-w8a16-gptq": GPTQModifier(config_groups=groups_of_64(8, True), ignore=["lm_head"]),
        "default-w8a8-int8": GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
        "default-fp8-dynamic": QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]),
    }
    for _ in _oneshot_each(recipes, only, base, dataset, work, 512):
        pass


def _oneshot_each(
    recipes: dict[str, Any], only: list[str], base: Path, dataset: Any, root: Path, max_seq_length: int
) -> Iterator[Path]:
    """Run llm-compressor's ``oneshot`` with each recipe (those in ``only``, if given) on a fresh float32 copy of
    ``base``, writing ``root / name``; yields each output directory once it is written."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    for name, recipe in recipes.items():
        if only and name not in only:
            continue
        output = root / name
        shutil.rmtree(output, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        oneshot(
            model=model,
            dataset=dataset,
            recipe=recipe,
            num_calibration_samples=len(dataset),
            max_seq_length=max_seq_length,
            output_dir=str(output),
        )
        _clean(output)
        yield output
        print(f"wrote {output}", file=sys.stderr)


# ------------------------------------------------------------------ GPTQModel


def make_with_gptqmodel(work: Path, only: list[str]) -> None:
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    base = _base(work / "base")
    calibration = [{"input_ids": i, "attention_mask": [1] * len(i)} for i in _calibration_ids()]
    configs: dict[str, dict[str, Any]] = {
        "gptq-4bit-g32-sym": {"bits": 4, "group_size": 32, "desc_act": False, "sym": True},
        "gptq-4bit-g128-asym-actorder": {"bits": 4, "group_size": 128, "desc_act": True, "sym": False},
        "gptq-4bit-g64-asym": {"bits": 4, "group_size": 64, "desc_act": False, "sym": False},
        "gptq-8bit-channel-sym": {
            "bits": 8,
            "group_size": -1,
            "desc_act": False,
            "sym": True,
            "act_group_aware": False,
        },
        "gptq-8bit-g128-asym-actorder": {"bits": 8, "group_size": 128, "desc_act": True, "sym": False},
        "awq-4bit-g128-gemm": {"bits": 4, "group_size": 128, "sym": False, "quant_method": "awq", "format": "gemm"},
        # The routed experts quantized per expert (GPTQModel leaves the routers in float).
        "gptq-moe-4bit-g32-asym": {"bits": 4, "group_size": 32, "desc_act": False, "sym": False},
        "gptq-moe-mixtral-4bit-g64-sym": {"bits": 4, "group_size": 64, "desc_act": False, "sym": True},
        "gptq-moe-qwen2-4bit-g32-sym": {"bits": 4, "group_size": 32, "desc_act": False, "sym": True},
        "awq-moe-4bit-g32-gemm": {"bits": 4, "group_size": 32, "sym": False, "quant_method": "awq", "format": "gemm"},
    }
    moe_bases = {
        "qwen3": _moe_base(work / "moe-base"),
        "mixtral": _moe_base(work / "mixtral-base", "mixtral-tiny"),
        "qwen2": _moe_base(work / "qwen2-moe-base", "qwen2-moe-tiny"),
    }
    for name, settings in configs.items():
        if only and name not in only:
            continue
        output = CHECKPOINTS / name
        shutil.rmtree(output, ignore_errors=True)
        family = next((f for f in moe_bases if f"-{f}-" in name), "qwen3")
        source = moe_bases[family] if "-moe-" in name else base
        model = GPTQModel.load(str(source), QuantizeConfig(**settings), device="cpu")
        # AWQ picks a CUDA kernel unless told to pack for the portable torch one.
        backend = BACKEND.TORCH if settings.get("quant_method") == "awq" else BACKEND.AUTO
        model.quantize(calibration, batch_size=1, backend=backend)
        model.save(str(output))
        _clean(output)
        quantized = GPTQModel.load(str(output), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
        _write_reference(_dequantized(quantized.model), output)
        print(f"wrote {output}", file=sys.stderr)


def _dequantized(model: Any) -> Any:
    """``model`` with each GPTQModel quantized linear replaced by a float32 ``nn.Linear`` holding GPTQModel's own
    dequantization of its weights: its torch kernel runs only in float16 or bfloat16, whose rounding would swamp
    the differences the tests look for, while its unpacking is what defines the reference."""
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear, dequantize_gemm

    for name, module in list(model.named_modules()):
        if isinstance(module, AwqTorchLinear):
            weight = dequantize_gemm(
                qweight=module.qweight,
                qzeros=module.qzeros,
                scales=module.scales,
                bits=module.bits,
                group_size=module.group_size,
            )
            weight = weight.float().T.contiguous()  # [out, in]
        elif isinstance(module, BaseQuantLinear):
            weight = module.dequantize_weight().float().T.contiguous()  # [out, in]
        else:
            continue
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None)
        linear.weight.data.copy_(weight)
        if module.bias is not None:
            linear.bias.data.copy_(module.bias.float())
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, linear)
    return model.float()


def _write_reference(model: Any, directory: Path, routing: bool = False) -> None:
    """The producer's float32 logits at every position of each prompt, and its greedy continuation; with
    ``routing`` (a MoE model), also its routers' logits over each prompt."""
    from safetensors.torch import save_file

    tensors = {}
    model = model.eval()
    routers: list[torch.Tensor] = []

    def keep(module: Any, args: Any, out: Any) -> None:  # transformers' routers return their logits first
        routers.append(out[0] if isinstance(out, tuple) else out)

    if routing:
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(keep)
    with torch.no_grad():
        for index, prompt in enumerate(PROMPTS):
            routers.clear()
            tensors[f"logits.{index}"] = model(torch.tensor([prompt])).logits[0].float().contiguous()
            if routing:  # [layers, tokens, experts]
                tensors[f"router_logits.{index}"] = torch.stack([r.float().reshape(len(prompt), -1) for r in routers])
            tokens, margins = list(prompt), []
            for _ in range(NUM_GREEDY_TOKENS):
                top2 = model(torch.tensor([tokens])).logits[0, -1].float().topk(2)
                tokens.append(int(top2.indices[0]))
                margins.append(float(top2.values[0] - top2.values[1]))
            tensors[f"greedy.{index}"] = torch.tensor(tokens[len(prompt) :])
            tensors[f"margins.{index}"] = torch.tensor(margins)  # top logit minus the runner-up, per step
    save_file(tensors, directory / "reference.safetensors", metadata={"prompts": json.dumps(PROMPTS)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("producer", choices=["llmcompressor", "gptqmodel", "llmcompressor-default"])
    parser.add_argument("only", nargs="*", help="checkpoint names to remake (default: all of the producer's)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tokenmill-quantized-base"))
    args = parser.parse_args()
    torch.manual_seed(0)
    producers = {
        "llmcompressor": make_with_llmcompressor,
        "gptqmodel": make_with_gptqmodel,
        "llmcompressor-default": make_default_with_llmcompressor,
    }
    producers[args.producer](args.work, args.only)


if __name__ == "__main__":
    main()
