"""Writing a quantized model as a Hugging Face directory in compressed-tensors format.

Tensor for tensor what llm-compressor writes for the same scheme (checked against its output in
``tests/quantize``): ``pack-quantized`` linears store ``weight_packed`` (int32, eight int4 codes a word),
``weight_scale`` [out, in / group_size], ``weight_shape`` (int64 [2]) and, when asymmetric,
``weight_zero_point`` (int32, packed along the output dimension); ``float-quantized`` and
``int-quantized`` ones store ``weight`` (float8_e4m3fn or int8) and ``weight_scale`` [out, 1]. Merged
projections are written as the checkpoint's separate ones (q/k/v, gate/up). Everything else (embedding,
norms, biases, an untied ``lm_head``) stays in float. The tokenizer files and generation config are
copied from a model directory, or rebuilt from a GGUF file's metadata.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.layers.quantizer import layer_tensor
from tokenmill_plugins.commands.quantize.schemes import QuantizedWeight, QuantScheme
from tokenmill_plugins.quant.packing import pack_int32

if TYPE_CHECKING:
    from tokenmill.models.base import CausalLM
    from tokenmill.tokenizer import Tokenizer

#: Files copied from a Hugging Face source directory when present.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def quantized_tensors(
    prefix: str, quantized: QuantizedWeight, scheme: QuantScheme, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one linear ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``)."""
    tensors = {f"{prefix}.weight_scale": quantized.scale.to(dtype)}
    if scheme.format == "pack-quantized":
        tensors[f"{prefix}.weight_packed"] = pack_int32(quantized.codes, scheme.num_bits)
        tensors[f"{prefix}.weight_shape"] = torch.tensor(list(quantized.codes.shape), dtype=torch.int64)
        if quantized.zero_point is not None:
            tensors[f"{prefix}.weight_zero_point"] = pack_int32(quantized.zero_point, scheme.num_bits, dim=0)
    else:
        tensors[f"{prefix}.weight"] = quantized.codes
    return tensors


def _split_rows(quantized: QuantizedWeight, start: int, end: int) -> QuantizedWeight:
    zero_point = None if quantized.zero_point is None else quantized.zero_point[start:end]
    return QuantizedWeight(quantized.codes[start:end], quantized.scale[start:end], zero_point)


def checkpoint_tensors(
    model: CausalLM, quantized: dict[str, QuantizedWeight], scheme: QuantScheme, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Every tensor of the quantized checkpoint, by its Hugging Face name."""
    tensors: dict[str, torch.Tensor] = {}
    linear_params: set[str] = set()
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        linear_params.update(f"{name}.{p}" for p, _ in module.named_parameters(recurse=False))
        parent, _, attribute = name.rpartition(".")
        if isinstance(module, MergedLinear):
            parts = [f"{parent}.{part}" for part in model.packed_modules[attribute]]
            sizes = list(module.shard_sizes)
        else:
            parts, sizes = [name], [module.out_features]
        bias = getattr(module, "bias", None)
        start = 0
        for part, size in zip(parts, sizes, strict=True):
            end = start + size
            if name in quantized:
                tensors.update(quantized_tensors(part, _split_rows(quantized[name], start, end), scheme, dtype))
            else:  # left in float (lm_head)
                tensors[f"{part}.weight"] = layer_tensor(module, "weight")[start:end].to(dtype)
            if isinstance(bias, torch.Tensor):
                tensors[f"{part}.bias"] = bias[start:end].to(dtype)
            start = end
    for name, parameter in model.named_parameters():
        if name not in linear_params:
            tensors[name] = parameter.detach().to(dtype)
    return {name: tensor.detach().contiguous().clone() for name, tensor in tensors.items()}


def write_checkpoint(
    output: Path,
    model: CausalLM,
    quantized: dict[str, QuantizedWeight],
    scheme: QuantScheme,
    hf_config: dict[str, Any],
    source: Path,
    tokenizer: Tokenizer,
    dtype: torch.dtype,
) -> None:
    """Write ``config.json``, ``model.safetensors``, the tokenizer files and the generation config."""
    output.mkdir(parents=True, exist_ok=True)
    ignore = ["lm_head"]
    save_file(checkpoint_tensors(model, quantized, scheme, dtype), str(output / "model.safetensors"), {"format": "pt"})
    config = {**hf_config, "quantization_config": scheme.quantization_config(ignore)}
    config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
    (output / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if source.is_dir():
        for file_name in _TOKENIZER_FILES:
            if (source / file_name).is_file():
                shutil.copyfile(source / file_name, output / file_name)
    else:
        _write_tokenizer(output, tokenizer, hf_config)


def _write_tokenizer(output: Path, tokenizer: Tokenizer, hf_config: dict[str, Any]) -> None:
    """A GGUF file's tokenizer as ``tokenizer.json`` + ``tokenizer_config.json``, and its special token ids
    as ``generation_config.json``, which transformers reads."""
    tokenizer.backend.save(str(output / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template"):
        value = getattr(tokenizer, key)
        if value is not None:
            tokenizer_config[key] = value
    (output / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    generation = {key: hf_config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in hf_config}
    (output / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
