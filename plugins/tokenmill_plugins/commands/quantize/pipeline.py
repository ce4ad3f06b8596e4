"""``tokenmill quantize``: load a model in float32, quantize its linears layer by layer, write a checkpoint.

The model loads through tokenmill's own loader with ``quantization = "none"`` (a GGUF file's blocks
dequantized exactly) on the CPU, so no other library is needed. Calibration runs like llm-compressor's
sequential pipeline: the calibration samples are embedded, then for each decoder layer in turn

1. the layer runs over the samples (tokenmill's own layer, attention through the configured backend over
   a scratch KV cache) while hooks on its linears gather what the method needs (GPTQ: the Hessian of
   each linear's input; AWQ: the inputs themselves);
2. its linears are quantized, and their weights replaced by what the codes stand for;
3. the layer runs again, now quantized, and its outputs are the next layer's inputs,

so each layer is calibrated on the inputs the quantized model will actually give it. fp8 rounds to
nearest and needs no calibration. The merged projections (q/k/v, gate/up) are quantized as one weight:
every output row has its own scales, and the parts share their input (so their Hessian), which makes
this exactly what quantizing them one by one computes. The output projection (``lm_head``) and the
embedding stay in float.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.quantizer import layer_tensor
from tokenmill_plugins.commands.quantize.awq import search_scales
from tokenmill_plugins.commands.quantize.calibration import calibration_samples, default_calibration_text
from tokenmill_plugins.commands.quantize.gptq import HessianAccumulator, gptq_quantize
from tokenmill_plugins.commands.quantize.schemes import (
    QuantizedWeight,
    QuantizeError,
    QuantScheme,
    check_shape,
    quantize_rtn,
)
from tokenmill_plugins.commands.quantize.writer import write_checkpoint

if TYPE_CHECKING:
    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.config import EngineConfig
    from tokenmill.model_loader import LoadedModel
    from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

#: Called after each decoder layer with the number of layers done and the number of layers.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class QuantizeOptions:
    """What ``tokenmill quantize`` was asked to do (its flags)."""

    output: Path
    calibration_text: str | None = None  # None: the bundled text
    num_samples: int = 64
    seq_len: int = 512
    block_size: int = 128  # GPTQ columns per lazy batch update
    dampening: float = 0.01  # GPTQ: fraction of the Hessian's mean diagonal added to it
    batch_size: int = 4  # calibration samples per forward
    dtype: str = "auto"  # of the tensors left in float and of the scales: auto | float32 | bfloat16 | float16


@dataclass(frozen=True)
class QuantizeResult:
    output: Path
    method: str
    num_layers: int
    num_samples: int  # calibration samples used (0 for round to nearest)
    seq_len: int
    size_bytes: int


class _Calibration:
    """The calibration samples laid out for the paged attention backend, a batch of samples per forward,
    over one scratch KV cache that every layer reuses (each forward writes its keys before reading them)."""

    def __init__(self, loaded: LoadedModel, samples: list[list[int]], batch_size: int, block_size: int) -> None:
        from tokenmill.step_batch import SequenceChunk, build_batch

        self.loaded = loaded
        seq_len = len(samples[0])
        blocks_per_sample = -(-seq_len // block_size)
        self.batches: list[tuple[AttentionMetadata, torch.Tensor, int]] = []  # metadata, input ids, num samples
        for start in range(0, len(samples), batch_size):
            batch = samples[start : start + batch_size]
            chunks = [
                SequenceChunk(ids, 0, list(range(i * blocks_per_sample, (i + 1) * blocks_per_sample)))
                for i, ids in enumerate(batch)
            ]
            input_ids, metadata = build_batch(chunks, block_size, loaded.device)
            loaded.attention.prepare(metadata, block_size)
            self.batches.append((metadata, input_ids, len(batch)))
        arch = loaded.arch
        shape = loaded.attention.kv_cache_shape(
            blocks_per_sample * batch_size, block_size, arch.num_kv_heads, arch.head_dim
        )
        self.kv_cache = torch.zeros(shape, dtype=loaded.kv_cache_dtype, device=loaded.device)

    def embed(self, model: LlamaForCausalLM) -> list[torch.Tensor]:
        return [model.model.embed_tokens(input_ids) for _, input_ids, _ in self.batches]  # each [num_tokens, hidden]

    def run_layer(
        self, model: LlamaForCausalLM, layer: LlamaDecoderLayer, hidden: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        outputs = []
        for (metadata, _, _), states in zip(self.batches, hidden, strict=True):
            model.model.rotary.set_positions(metadata.positions)
            output, residual = layer(metadata.positions, states, None, self.kv_cache, metadata)
            outputs.append(output + residual)  # the layer's whole output: the next one's input
        return outputs


@contextmanager
def _capture_inputs(linears: dict[str, Linear]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Record each linear's input, one tensor per forward, while the context is open."""
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in linears}
    handles = [
        linear.register_forward_pre_hook(lambda _module, args, name=name: captured[name].append(args[0].detach()))
        for name, linear in linears.items()
    ]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _set_weight(linear: Linear, weight: torch.Tensor) -> None:
    layer_tensor(linear, "weight").data.copy_(weight)


def _quantize_layer_gptq(
    layer: LlamaDecoderLayer,
    linears: dict[str, Linear],
    calibration: _Calibration,
    model: LlamaForCausalLM,
    hidden: list[torch.Tensor],
    scheme: QuantScheme,
    options: QuantizeOptions,
) -> dict[str, QuantizedWeight]:
    with _capture_inputs(linears) as captured:
        calibration.run_layer(model, layer, hidden)
    results = {}
    for name, linear in linears.items():
        hessian = HessianAccumulator(linear.in_features)
        for inputs, (_, _, num_samples) in zip(captured.pop(name), calibration.batches, strict=True):
            hessian.add(inputs, num_samples)
        quantized = gptq_quantize(
            layer_tensor(linear, "weight"),
            hessian.result(),
            scheme,
            block_size=options.block_size,
            dampening=options.dampening,
        )
        _set_weight(linear, quantized.dequantize())
        results[name] = quantized
    return results


def _quantize_layer_awq(
    layer: LlamaDecoderLayer,
    linears: dict[str, Linear],
    calibration: _Calibration,
    model: LlamaForCausalLM,
    hidden: list[torch.Tensor],
    scheme: QuantScheme,
) -> dict[str, QuantizedWeight]:
    from tokenmill.models.llama import LlamaMLP

    attention, mlp = layer.self_attn, layer.mlp
    assert isinstance(mlp, LlamaMLP), "AWQ smooths a dense MLP's gate/up and down"
    qkv, o_proj, gate_up, down = attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj
    with _capture_inputs({"qkv": qkv, "o": o_proj, "gate_up": gate_up, "down": down}) as captured:
        calibration.run_layer(model, layer, hidden)

    def run_attention(x: torch.Tensor, batch: int) -> torch.Tensor:
        metadata = calibration.batches[batch][0]
        model.model.rotary.set_positions(metadata.positions)
        return attention(metadata.positions, x, calibration.kv_cache, metadata)

    def smooth(
        inputs: list[torch.Tensor],
        balance: Linear,
        parent: Callable[[torch.Tensor, int], torch.Tensor],
        smooth_weight: torch.Tensor,
        smooth_bias: torch.Tensor | None,
    ) -> None:
        reference = [parent(x, batch) for batch, x in enumerate(inputs)]
        num_values = sum(r.numel() for r in reference)

        def loss() -> float:
            pairs = enumerate(zip(inputs, reference, strict=True))
            total = sum(float(((parent(x, batch) - r) ** 2).sum()) for batch, (x, r) in pairs)
            return total / num_values

        activation_mean = torch.cat(inputs).abs().float().mean(dim=0)  # [in]
        weight = layer_tensor(balance, "weight")
        assert isinstance(weight, nn.Parameter)
        scales = search_scales(activation_mean, [weight], scheme, loss)
        weight.data.mul_(scales[None, :])
        smooth_weight.div_(scales if smooth_weight.dim() == 1 else scales[:, None])
        if smooth_bias is not None:
            smooth_bias.div_(scales)

    with torch.inference_mode():
        # input_layernorm -> q, k, v (judged on the attention output)
        smooth(captured["qkv"], qkv, run_attention, layer.input_layernorm.weight.data, None)
        spec = attention.spec
        v_rows = spec.num_kv_heads * spec.head_dim
        if v_rows == o_proj.in_features:  # v -> o only without grouped-query attention, as AutoAWQ
            qkv_weight, qkv_bias = layer_tensor(qkv, "weight").data, getattr(qkv, "bias", None)
            smooth(
                captured["o"], o_proj, lambda x, _b: o_proj(x), qkv_weight[-v_rows:],
                None if qkv_bias is None else qkv_bias.data[-v_rows:],
            )  # fmt: skip
        # post_attention_layernorm -> gate, up (judged on the MLP output)
        smooth(captured["gate_up"], gate_up, lambda x, _b: mlp(x), layer.post_attention_layernorm.weight.data, None)
        # up -> down
        inner = down.in_features
        gate_up_bias = getattr(gate_up, "bias", None)
        smooth(
            captured["down"], down, lambda x, _b: down(x), layer_tensor(gate_up, "weight").data[inner:],
            None if gate_up_bias is None else gate_up_bias.data[inner:],
        )  # fmt: skip
    return _quantize_layer_rtn(linears, scheme)  # the smoothed weights, rounded with zero points


def _quantize_layer_rtn(linears: dict[str, Linear], scheme: QuantScheme) -> dict[str, QuantizedWeight]:
    results = {}
    for name, linear in linears.items():
        quantized = quantize_rtn(layer_tensor(linear, "weight"), scheme)
        _set_weight(linear, quantized.dequantize())
        results[name] = quantized
    return results


def _float_config(config: EngineConfig) -> EngineConfig:
    """``config`` loading dense float32 weights on the CPU with the torch attention reference."""
    model = msgspec.structs.replace(config.model, quantization="none", dtype="float32")
    device = msgspec.structs.replace(config.device, device="cpu")
    cache = msgspec.structs.replace(config.cache, kv_cache_dtype="auto")
    return msgspec.structs.replace(config, model=model, device=device, cache=cache)


def quantize_model(
    config: EngineConfig, scheme: QuantScheme, options: QuantizeOptions, progress: Progress | None = None
) -> QuantizeResult:
    """Quantize the configured model with ``scheme`` and write it to ``options.output``."""
    from tokenmill.model_files import resolve_model, resolve_tokenizer
    from tokenmill.model_loader import load_model
    from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM
    from tokenmill.tokenizer import Tokenizer

    output = options.output
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise QuantizeError(f"--output {output}: exists and is not an empty directory; choose a new one")
    source = resolve_model(config.model.model)
    tokenizer = Tokenizer.from_path(resolve_tokenizer(config.model.model, config.model.tokenizer))
    samples: list[list[int]] = []
    if scheme.algorithm != "rtn":
        text = options.calibration_text if options.calibration_text is not None else default_calibration_text()
        samples = calibration_samples(tokenizer, text, options.num_samples, options.seq_len)

    loaded = load_model(_float_config(config))
    model = loaded.model
    if not isinstance(model, LlamaForCausalLM):
        raise QuantizeError(f"{source}: tokenmill quantize supports the Llama family, not {type(model).__name__}")
    layers = [layer for layer in model.model.layers if isinstance(layer, LlamaDecoderLayer)]
    assert len(layers) == len(model.model.layers)
    _check_shapes(layers, scheme)

    quantized: dict[str, QuantizedWeight] = {}
    with torch.inference_mode():
        calibration = hidden = None
        if samples:
            calibration = _Calibration(loaded, samples, options.batch_size, config.cache.block_size)
            hidden = calibration.embed(model)
        for index, layer in enumerate(layers):
            linears = _layer_linears(layer)
            if scheme.algorithm == "rtn":
                results = _quantize_layer_rtn(linears, scheme)
            else:
                assert calibration is not None and hidden is not None
                if scheme.algorithm == "gptq":
                    results = _quantize_layer_gptq(layer, linears, calibration, model, hidden, scheme, options)
                else:
                    results = _quantize_layer_awq(layer, linears, calibration, model, hidden, scheme)
                hidden = calibration.run_layer(model, layer, hidden)  # the quantized layer's outputs
            quantized.update({f"model.layers.{index}.{name}": q for name, q in results.items()})
            if progress is not None:
                progress(index + 1, len(layers))

    dtype = _output_dtype(options.dtype, loaded)
    hf_config = _hf_config(source, config)
    write_checkpoint(output, model, quantized, scheme, hf_config, source, tokenizer, dtype)
    size = sum(f.stat().st_size for f in output.glob("*.safetensors"))
    logger.info("wrote %s (%s, %.1f MiB)", output, scheme.method, size / 2**20)
    return QuantizeResult(output, scheme.method, len(layers), len(samples), options.seq_len, size)


def _check_shapes(layers: list[LlamaDecoderLayer], scheme: QuantScheme) -> None:
    """Raise, suggesting a group size that fits, unless every linear splits into the scheme's groups."""
    in_features = {linear.in_features for layer in layers for linear in _layer_linears(layer).values()}
    fits = next((size for size in (128, 64, 32, 16, 8) if all(n % size == 0 for n in in_features)), None)
    for index, layer in enumerate(layers):
        for name, linear in _layer_linears(layer).items():
            try:
                check_shape(f"model.layers.{index}.{name}", linear.in_features, scheme)
            except QuantizeError as exc:
                hint = f" ({fits} fits every linear of this model)" if fits else ""
                raise QuantizeError(f"{exc}{hint}") from None


def _layer_linears(layer: nn.Module) -> dict[str, Linear]:
    """The layer's linears by module name (merged ones once, under their tokenmill name)."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, Linear)}


def _output_dtype(name: str, loaded: LoadedModel) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name != "auto":
        if name not in dtypes:
            raise QuantizeError(f"--dtype {name!r}: choose auto, {', '.join(dtypes)}")
        return dtypes[name]
    return dtypes.get(loaded.arch.torch_dtype or "", torch.float32)


def _hf_config(source: Path, engine_config: EngineConfig) -> dict[str, Any]:
    """The source's Hugging Face config (a directory's ``config.json``; for a GGUF file, the one tokenmill
    derives from its metadata), without any quantization of its own."""
    if source.is_dir() and (source / "config.json").is_file():
        config: dict[str, Any] = json.loads((source / "config.json").read_text(encoding="utf-8"))
    else:
        from tokenmill.model_loader import select_weight_format
        from tokenmill.plugin_manager import resolve_plugins

        config = dict(select_weight_format(source, resolve_plugins(engine_config), None).read_config(source))
    if config.get("quantization_config", {}).get("quant_method") not in (None, "gguf"):
        raise QuantizeError(f"{source}: already quantized ({config['quantization_config']['quant_method']})")
    config.pop("quantization_config", None)
    return config
