"""``bench accuracy``: how far the engine's greedy output is from transformers float32 on the same weights.

transformers loads the model (for a GGUF file: its blocks dequantized exactly), so on the same weights
every difference from it is the engine's arithmetic: activation rounding in quantized kernels, the
KV cache's dtype, summation order. For each chat prompt the engine's model runner decodes greedily,
as the engine runs a lone request (the prompt in one step, then one token a step), and transformers
scores the same tokens in one forward. Per prompt the report gives, in nats, the largest and mean
``|log p_engine(t) - log p_reference(t)|`` over the chosen tokens ``t``, where the worst one is, and the
first position where the reference's own greedy choice differs (where the two greedy outputs part;
later positions compare on the engine's text). A fixed English text is scored token by token the
same way (one token a step) for its perplexity under each path.

Variants measure where the error comes from. Each is ``default`` (the configured engine) or
comma-separated ``key=value`` changes to it:

* ``kv=float32|float16|bfloat16|fp8|int8``: the KV cache's dtype (``cache.kv_cache_dtype``; ``fp8`` and
  ``int8`` are the quantized caches, one byte per value and a scale per token and KV head). The text is
  scored one token a step, so every position reads its context from the cache as stored: comparing
  ``kv=fp8`` with ``kv=float16`` gives what quantizing the cache costs in perplexity;
* ``quantization=NAME``: ``model.quantization`` (``none`` is the float32 path);
* ``act=MODE`` for every linear, ``body_act=MODE`` for all but the output projection,
  ``head_act=MODE`` for the output projection (``lm_head``). ``kernel`` leaves the layer as its
  quantizer runs it; ``float`` keeps its input in float32, ``int8`` / ``int16`` round the input per
  block of 32 to that many bits (absmax scaling, llama.cpp's Q8_1 without its float16 scale for
  ``int8``), and multiply in float32 with the layer's own weights, which are read back through the
  layer from one-hot inputs (exact to float32 rounding: any absmax scheme represents a one-hot row).

transformers is a test-only dependency of tokenmill, imported when the reference loads.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.config.cache import CacheConfig
from tokenmill.layers.quantizer import Quantizer
from tokenmill_plugins.commands.bench.metrics import build_report, format_header

if TYPE_CHECKING:  # torch loads with the engine, transformers with the reference
    import torch
    from torch import nn

    from tokenmill.layers.linear import Linear
    from tokenmill.model_runner import ModelRunner
    from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: Short chat prompts whose first tokens are near-ties for SmolLM2 (the capital), and a longer answer.
PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 7 times 8?",
    "Explain in a few sentences why the sky is blue during the day and red at sunset.",
)

#: Scored for perplexity: plain encyclopedic prose, about 200 tokens.
PERPLEXITY_TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. Heat from the "
    "sun evaporates water from the surface of seas, lakes and rivers, and plants release more of it "
    "through their leaves. As the warm, moist air rises it cools, and the vapour condenses into tiny "
    "droplets that form clouds. When the droplets grow heavy enough they fall back to the ground as "
    "rain, snow or hail. Some of this water flows over the land into streams and rivers, which carry "
    "it back to the sea; some soaks into the soil and fills the layers of rock beneath it, where it can "
    "stay for thousands of years. Glaciers and ice caps hold most of the fresh water on Earth, and "
    "their slow melting feeds many of the world's great rivers during the summer months. The cycle has "
    "no beginning or end, and the total amount of water on the planet stays almost the same."
)

ACTIVATION_MODES = ("kernel", "float", "int8", "int16")
_LEVELS = {"int8": 127, "int16": 32767}
_GROUP = 32


@dataclass(frozen=True)
class Variant:
    """One way of running the engine, compared with the reference."""

    name: str
    kv_cache_dtype: str | None = None  # None: as configured
    quantization: str | None = None
    body_activations: str = "kernel"
    head_activations: str = "kernel"

    _KEYS: ClassVar[tuple[str, ...]] = ("kv", "quantization", "act", "body_act", "head_act")

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``default`` or ``key=value[,key=value...]`` (see the module docstring); ``ValueError`` otherwise."""
        text = text.strip()
        if text == "default":
            return cls("default")
        settings: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in cls._KEYS or not value:
                raise ValueError(
                    f"variant {text!r}: expected 'default' or comma-separated key=value with keys "
                    f"{', '.join(cls._KEYS)}, got {part!r}"
                )
            if key.endswith("act") and value not in ACTIVATION_MODES:
                raise ValueError(f"variant {text!r}: {key} must be one of {', '.join(ACTIVATION_MODES)}, got {value!r}")
            if key == "kv":
                try:  # the setting's own check: the names cache.kv_cache_dtype takes
                    msgspec.convert({"kv_cache_dtype": value}, CacheConfig)
                except msgspec.ValidationError as exc:
                    raise ValueError(f"variant {text!r}: kv: {exc}") from None
            settings[key] = value
        body = settings.get("body_act", settings.get("act", "kernel"))
        head = settings.get("head_act", settings.get("act", "kernel"))
        return cls(text, settings.get("kv"), settings.get("quantization"), body, head)

    def apply_to(self, config: EngineConfig) -> EngineConfig:
        """``config`` with this variant's cache dtype and quantization."""
        if self.kv_cache_dtype is not None:
            cache = msgspec.structs.replace(config.cache, kv_cache_dtype=self.kv_cache_dtype)
            config = msgspec.structs.replace(config, cache=cache)
        if self.quantization is not None:
            model = msgspec.structs.replace(config.model, quantization=self.quantization)
            config = msgspec.structs.replace(config, model=model)
        return config


@dataclass(frozen=True)
class PromptResult:
    prompt: str
    num_tokens: int  # greedy tokens the engine generated (to EOS or max_tokens)
    max_error: float  # nats: max |log p_engine - log p_reference| of the chosen tokens
    mean_error: float
    worst_position: int  # generated token where max_error occurs (0: the first)
    divergence: int | None  # first generated token where the reference's greedy choice differs; None: none
    text: str  # what the engine generated


@dataclass(frozen=True)
class VariantResult:
    variant: str
    quantization: str  # of the linears, as loaded
    kv_cache_dtype: str
    perplexity: float  # of PERPLEXITY_TEXT
    text_max_error: float  # nats, over the perplexity text's tokens
    prompts: list[PromptResult] = field(default_factory=list)

    @property
    def max_error(self) -> float:
        return max(p.max_error for p in self.prompts)


class Reference:
    """transformers float32 on the model's own weights (a GGUF file's blocks dequantized exactly)."""

    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.model_files import resolve_model
        from tokenmill_plugins.commands.bench.hf_baseline import HFModel

        self.model = HFModel.load(resolve_model(config.model.model), dtype="float32").model

    def logprobs(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Float64 log-probabilities [len(token_ids), vocab] of each position of ``token_ids`` after
        ``prompt_ids`` (teacher-forced: position i sees ``token_ids[:i]``)."""
        import torch

        with torch.inference_mode():
            input_ids = torch.tensor([[*prompt_ids, *token_ids]])  # [1, seq_len]
            logits = self.model(input_ids=input_ids).logits[0]  # [seq_len, vocab]
        start = len(prompt_ids) - 1
        return torch.log_softmax(logits[start : start + len(token_ids)].double(), dim=-1)

    def greedy(self, prompt_ids: Sequence[int], max_tokens: int, stop_ids: frozenset[int]) -> list[int]:
        """The reference's own greedy continuation, up to ``max_tokens`` or a stop token."""
        import torch
        from transformers import GenerationConfig

        generation = GenerationConfig(
            do_sample=False, max_new_tokens=max_tokens, eos_token_id=sorted(stop_ids) or None, pad_token_id=0
        )
        with torch.inference_mode():
            output = self.model.generate(input_ids=torch.tensor([list(prompt_ids)]), generation_config=generation)
        return [int(t) for t in output[0, len(prompt_ids) :]]


class EmulatedActivations(Quantizer):
    """A layer's own weights applied in float32 to its input kept as is or rounded per block of 32:
    what the layer computes with that activation precision. Replaces a built layer's quantizer."""

    name: ClassVar[str] = "emulated"

    def __init__(self, layer: Linear, levels: int | None) -> None:
        import torch

        with torch.inference_mode():
            # Read the weights back through the layer: a zero row gives the bias, one-hot rows W^T + bias.
            self.bias = layer(torch.zeros(1, layer.in_features))[0].clone()  # [out_features]
            eye = torch.eye(layer.in_features)  # [in_features, in_features]
            self.weight = (layer(eye) - self.bias).T.contiguous()  # [out_features, in_features]
        self.levels = levels

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: Any) -> None:
        raise NotImplementedError("EmulatedActivations wraps a loaded layer; it does not load weights")

    def load_weight(self, layer: nn.Module, param_name: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError("EmulatedActivations wraps a loaded layer; it does not load weights")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        x = x.float()
        if self.levels is not None:
            x = round_activations(x, self.levels)
        return F.linear(x, self.weight, self.bias)


def round_activations(x: torch.Tensor, levels: int) -> torch.Tensor:
    """``x [M, K]`` rounded per block of 32 to integer codes in ``[-levels, levels]`` times the block's
    absmax / levels (float32 scale), as the quantized kernels round their input."""
    import torch

    blocks = x.reshape(x.shape[0], -1, _GROUP)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / levels  # [M, K // 32, 1]
    inverse = torch.where(scale > 0, 1.0 / scale, 0.0)
    return (torch.round(blocks * inverse).clamp_(-levels, levels) * scale).reshape(x.shape)


def _emulate(model: nn.Module, variant: Variant) -> None:
    """Give the linears the variant's activation precision (``kernel`` leaves a layer as it is)."""
    from tokenmill.layers.linear import Linear

    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        mode = variant.head_activations if name.split(".")[-1] == "lm_head" else variant.body_activations
        if mode != "kernel":
            module.quantizer = EmulatedActivations(module, _LEVELS.get(mode))


def _engine_greedy(
    runner: ModelRunner, prompt_ids: Sequence[int], max_tokens: int, stop_ids: frozenset[int]
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their float64 log-probabilities: the prompt in one step, then one token a step."""
    import torch

    from tokenmill.model_runner import SequenceChunk

    blocks = list(range(runner.num_blocks))
    logits = runner.execute([SequenceChunk(list(prompt_ids), 0, blocks)])[0]  # [vocab]
    token_ids: list[int] = []
    logprobs: list[float] = []
    while True:
        token = int(logits.argmax())  # as the engine's greedy sampler picks, on float32 logits
        token_ids.append(token)
        logprobs.append(float(torch.log_softmax(logits.double(), dim=-1)[token]))
        if token in stop_ids or len(token_ids) == max_tokens:
            return token_ids, logprobs
        position = len(prompt_ids) + len(token_ids) - 1
        logits = runner.execute([SequenceChunk([token], position, blocks)])[0]


def _engine_text_logprobs(runner: ModelRunner, token_ids: Sequence[int]) -> list[float]:
    """Log-probability of each of ``token_ids[1:]`` given the ones before, one token a step."""
    import torch

    from tokenmill.model_runner import SequenceChunk

    blocks = list(range(runner.num_blocks))
    logprobs = []
    for position, (token, following) in enumerate(zip(token_ids, token_ids[1:], strict=False)):
        logits = runner.execute([SequenceChunk([token], position, blocks)])[0]
        logprobs.append(float(torch.log_softmax(logits.double(), dim=-1)[following]))
    return logprobs


def _render_prompts(tokenizer: Tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt as one user message through the chat template, as the chat API sends it."""
    rendered = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        assert isinstance(text, str)
        rendered.append(tokenizer.encode(text, add_special_tokens=False))  # the template wrote the special tokens
    return rendered


def run_accuracy(
    config: EngineConfig,
    variants: Sequence[Variant],
    *,
    prompts: Sequence[str] = PROMPTS,
    max_tokens: int = 64,
    text: str = PERPLEXITY_TEXT,
) -> dict[str, Any]:
    """Measure each variant against transformers float32 on ``prompts`` and ``text``; returns the report."""
    import torch

    from tokenmill.layers.linear import Linear
    from tokenmill.model_files import resolve_tokenizer
    from tokenmill.model_loader import load_model
    from tokenmill.model_runner import ModelRunner
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(resolve_tokenizer(config.model.model, config.model.tokenizer))
    stop_ids = frozenset(t for t in (tokenizer.eos_token_id,) if t is not None)
    prompt_ids = _render_prompts(tokenizer, prompts)
    text_ids = tokenizer.encode(text)
    reference = Reference(config)
    text_reference = reference.logprobs(text_ids[:1], text_ids[1:])  # [len(text_ids) - 1, vocab]
    text_targets = torch.tensor(text_ids[1:])
    text_reference_chosen = text_reference[torch.arange(len(text_targets)), text_targets]
    reference_prompts = []
    for prompt, ids in zip(prompts, prompt_ids, strict=True):
        generated = reference.greedy(ids, max_tokens, stop_ids)
        reference_prompts.append({"prompt": prompt, "num_prompt_tokens": len(ids), "text": tokenizer.decode(generated)})

    block_size = config.cache.block_size
    max_len = max(len(text_ids), *(len(ids) + max_tokens for ids in prompt_ids))
    results = []
    for variant in variants:
        loaded = load_model(variant.apply_to(config))
        _emulate(loaded.model, variant)
        runner = ModelRunner(loaded, num_blocks=-(-max_len // block_size), block_size=block_size)
        prompt_results = []
        for prompt, ids in zip(prompts, prompt_ids, strict=True):
            token_ids, logprobs = _engine_greedy(runner, ids, max_tokens, stop_ids)
            expected = reference.logprobs(ids, token_ids)  # [num_tokens, vocab]
            chosen = expected[torch.arange(len(token_ids)), torch.tensor(token_ids)]
            errors = (torch.tensor(logprobs, dtype=torch.float64) - chosen).abs()
            divergence = next(
                (i for i, (a, b) in enumerate(zip(token_ids, expected.argmax(-1).tolist(), strict=True)) if a != b),
                None,
            )
            prompt_results.append(
                PromptResult(
                    prompt=prompt,
                    num_tokens=len(token_ids),
                    max_error=float(errors.max()),
                    mean_error=float(errors.mean()),
                    worst_position=int(errors.argmax()),
                    divergence=divergence,
                    text=tokenizer.decode(token_ids),
                )
            )
        text_logprobs = torch.tensor(_engine_text_logprobs(runner, text_ids), dtype=torch.float64)
        quantizers = sorted({m.quantizer.name for m in loaded.model.modules() if isinstance(m, Linear)})
        result = VariantResult(
            variant=variant.name,
            quantization="+".join(quantizers) or "none",
            kv_cache_dtype=str(loaded.kv_cache_dtype).removeprefix("torch."),
            perplexity=math.exp(-float(text_logprobs.mean())),
            text_max_error=float((text_logprobs - text_reference_chosen).abs().max()),
            prompts=prompt_results,
        )
        logger.info("%s: max error %.3f nats, perplexity %.3f", variant.name, result.max_error, result.perplexity)
        results.append(result)
        del runner, loaded

    parameters = {
        "model": str(config.model.model),
        "max_tokens": max_tokens,
        "num_prompts": len(prompts),
        "text_tokens": len(text_ids),
        "num_threads": torch.get_num_threads(),
    }
    reference_result = {
        "perplexity": math.exp(-float(text_reference_chosen.mean())),
        "prompts": reference_prompts,
    }
    return build_report(
        "accuracy", parameters, {"reference": reference_result, "variants": [_variant_dict(r) for r in results]}
    )


def _variant_dict(result: VariantResult) -> dict[str, Any]:
    return {**asdict(result), "max_error": result.max_error}


def format_accuracy(report: dict[str, Any]) -> str:
    """The report as text: per variant and prompt, the chosen-token logprob errors and where greedy parts."""
    results = report["results"]
    lines = format_header(report)
    lines.append(f"reference (transformers float32) perplexity {results['reference']['perplexity']:.4f}")
    for number, prompt in enumerate(results["reference"]["prompts"]):
        lines.append(f"  prompt {number}: {prompt['prompt']!r} -> {prompt['text']!r}")
    header = f"{'prompt':<8}{'tokens':>7}{'max err':>10}{'mean err':>10}{'worst at':>10}{'diverges':>10}"
    first = results["variants"][0] if results["variants"] else None
    for variant in results["variants"]:
        change = ""
        if first is not None and variant is not first:
            relative = variant["perplexity"] / first["perplexity"] - 1
            change = f" ({relative:+.2%} vs {first['variant']})"
        lines += [
            "-" * len(header),
            f"{variant['variant']} ({variant['quantization']}, KV cache {variant['kv_cache_dtype']}): "
            f"perplexity {variant['perplexity']:.4f}{change}, text max err {variant['text_max_error']:.4f}",
            header,
        ]
        for number, prompt in enumerate(variant["prompts"]):
            divergence = "-" if prompt["divergence"] is None else str(prompt["divergence"])
            lines.append(
                f"{number:<8}{prompt['num_tokens']:>7}{prompt['max_error']:>10.4f}{prompt['mean_error']:>10.4f}"
                f"{prompt['worst_position']:>10}{divergence:>10}"
            )
    lines.append("=" * len(header))
    return "\n".join(lines)
