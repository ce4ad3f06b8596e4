"""compressed-tensors checkpoints, as llm-compressor writes them (``quant_method: compressed-tensors``).

``quantization_config`` holds ``config_groups`` (each a scheme for the modules its ``targets`` name), an
``ignore`` list and a ``format``. Supported, with one scheme for every ``Linear`` but ``lm_head`` (the ``ignore`` list
may also name modules that tokenmill does not build as linears, such as MoE routers):

* ``pack-quantized``: 4- or 8-bit integer weights (W4A16, W8A16, W4A16_ASYM; what llm-compressor's GPTQ and AWQ
  write). ``weight_packed`` int32 ``[out, in * bits / 32]`` holds ``q + 2**(bits-1)`` packed along the input,
  lowest bits first; ``weight_scale`` ``[out, groups]``; asymmetric schemes add ``weight_zero_point`` packed the
  same way along the output (``[out * bits / 32, groups]``); ``weight_g_idx`` ``[in]`` for activation-ordered
  groups. ``w = (q - zero_point) * scale``. Strategies ``group``, ``channel`` and ``tensor``.
* ``int-quantized``: int8 ``weight`` ``[out, in]`` and ``weight_scale``; with INT8 activations per token (dynamic)
  or per tensor (static ``input_scale``): W8A8.
* ``float-quantized``: FP8 e4m3 ``weight`` ``[out, in]`` and ``weight_scale`` per tensor, per channel or per
  block (``block_structure``); activations unquantized, FP8 per token (dynamic) or per tensor (static
  ``input_scale``): FP8_DYNAMIC, FP8, FP8_BLOCK.

Anything else (sparsity, transforms, a quantized KV cache scheme, several config groups, NVFP4/MXFP4) is refused by
``configure`` with a one-line error before loading; an ``ignore`` entry that leaves a linear other than ``lm_head``
in float is refused when the model's weights start loading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from tokenmill_plugins.quant.checkpoint_quantizer import CheckpointQuantizer, integer_input_group
from tokenmill_plugins.quant.checkpoint_weights import ActivationScheme, FloatWeight, IntWeight, unpack_int32
from tokenmill_plugins.quant.config_checks import check_choice, check_group_size, expect_shape, num_groups

_FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
_STRATEGIES = {"int": ("group", "channel", "tensor"), "float": ("channel", "tensor", "block")}


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == {"config_groups": {}}


class CompressedTensorsQuantizer(CheckpointQuantizer):
    name: ClassVar[str] = "compressed-tensors"
    quant_methods: ClassVar[tuple[str, ...]] = ("compressed-tensors",)

    format: str = "pack-quantized"
    bits: int = 4
    strategy: str = "group"
    group_size: int = -1
    block: tuple[int, int] = (1, 1)
    is_symmetric: bool = True
    ignore: tuple[str, ...] = ()

    def configure(self, quantization_config: Mapping[str, Any]) -> None:
        config = quantization_config
        method = "compressed-tensors"
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if not _empty(config.get(key)):
                raise ValueError(f"{method}: {key} is not supported; supported: weight (and activation) quantization")
        status = config.get("quantization_status", "compressed")
        check_choice(method, "quantization_status", status, ("compressed",))
        # Checked against the model's linears at load (leaves_unquantized): MoE routers are no linears here.
        self.ignore = tuple(str(pattern) for pattern in config.get("ignore") or [])
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise ValueError(f"{method}: {len(groups)} config_groups are not supported; supported: exactly one")
        (scheme,) = groups.values()
        targets = scheme.get("targets") or []
        if targets != ["Linear"]:
            raise ValueError(f"{method}: targets {targets!r} are not supported; supported: ['Linear']")
        self.format = check_choice(method, "format", scheme.get("format") or config.get("format"), _FORMATS)
        if scheme.get("output_activations"):
            raise ValueError(f"{method}: output_activations are not supported; supported: weights and inputs")
        weights = scheme.get("weights") or {}
        kind = "float" if self.format == "float-quantized" else "int"
        check_choice(method, "weights.type", weights.get("type"), (kind,))
        self.bits = check_choice(
            method, "weights.num_bits", weights.get("num_bits"), (8,) if kind == "float" else (4, 8)
        )
        if self.format == "int-quantized":
            check_choice(method, "weights.num_bits for int-quantized", self.bits, (8,))
        self.strategy = check_choice(method, "weights.strategy", weights.get("strategy"), _STRATEGIES[kind])
        if self.strategy == "group":
            self.group_size = check_group_size(method, weights.get("group_size"))
        if self.strategy == "block":
            block = weights.get("block_structure") or []
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"{method}: block_structure {block!r} is not [rows, columns]")
            self.block = (block[0], block[1])
        self.is_symmetric = bool(weights.get("symmetric", True))
        if kind == "int":
            self.input_group_size = integer_input_group(self.group_size if self.strategy == "group" else -1)
        else:
            self.input_group_size = self.block[1] if self.strategy == "block" else 1
        if kind == "float" and not self.is_symmetric:
            raise ValueError(f"{method}: asymmetric FP8 weights are not supported; supported: symmetric")
        if weights.get("dynamic"):
            raise ValueError(f"{method}: dynamic weight scales are not supported; supported: static (stored) scales")
        self.activations = _activation_scheme(scheme.get("input_activations"))
        self.weight_kind = "fp8" if kind == "float" else f"int{self.bits}"
        if self.activations is not None and kind == "int":
            if (
                self.activations.type != "int"
                or self.bits != 8
                or self.strategy not in ("channel", "tensor")
                or not self.is_symmetric
            ):
                raise ValueError(
                    f"{method}: integer weights with {self.activations.type} activations and {self.bits}-bit "
                    f"{self.strategy} weights are not supported; supported: W8A8 (int8 per-channel symmetric "
                    "weights, int8 activations) and weight-only W4A16/W8A16"
                )
            if self.activations.strategy not in ("token", "tensor"):
                raise ValueError(
                    f"{method}: int8 {self.activations.strategy} activations are not supported; "
                    "supported: token, tensor"
                )
            self.weight_kind = "w8a8"
        names = {
            "pack-quantized": ["weight_packed", "weight_scale", "weight_shape"],
            "int-quantized": ["weight", "weight_scale"],
            "float-quantized": ["weight", "weight_scale"],
        }[self.format]
        if not self.is_symmetric:
            names.append("weight_zero_point")
        if weights.get("actorder") == "group":
            names.append("weight_g_idx")
        if self.activations is not None and not self.activations.is_dynamic:
            names.append("input_scale")
        self.checkpoint_tensor_names = tuple(names)

    def leaves_unquantized(self, module_name: str) -> bool:
        # compressed-tensors' matching: "re:" entries match from the start of the name, others name it whole.
        return any(
            re.match(pattern[3:], module_name) if pattern.startswith("re:") else pattern == module_name
            for pattern in self.ignore
        )

    def read_checkpoint(self, tensors: Mapping[str, Tensor], out_features: int, in_features: int) -> Any:
        input_scale = tensors["input_scale"].float().reshape(1) if "input_scale" in tensors else None
        if input_scale is not None and input_scale.numel() != 1:
            raise ValueError("belongs to a module whose 'input_scale' is not one value (per-tensor)")
        if self.format == "float-quantized":
            values = expect_shape(tensors, "weight", (out_features, in_features), torch.float8_e4m3fn)
            scales, block = self._fp8_scales(tensors["weight_scale"], out_features, in_features)
            return FloatWeight(values=values, scales=scales, block_size=block, input_scale=input_scale)
        group_size, groups = num_groups(in_features, self.group_size if self.strategy == "group" else -1)
        offset = 1 << (self.bits - 1)
        if self.format == "pack-quantized":
            shape = expect_shape(tensors, "weight_shape", (2,), None)
            if shape.tolist() != [out_features, in_features]:
                raise ValueError(
                    f"belongs to a module whose weight_shape is {shape.tolist()}, expected "
                    f"{[out_features, in_features]}"
                )
            packed = expect_shape(
                tensors, "weight_packed", (out_features, -(-in_features * self.bits // 32)), torch.int32
            )
            codes = unpack_int32(packed, self.bits, dim=1, count=in_features)
        else:
            signed = expect_shape(tensors, "weight", (out_features, in_features), torch.int8)
            codes = (signed.to(torch.int16) + offset).to(torch.uint8)
        scales = self._int_scales(tensors["weight_scale"], out_features, groups)
        if self.is_symmetric:
            zeros = torch.full_like(scales, float(offset))
        elif self.format == "pack-quantized":
            packed_zeros = expect_shape(
                tensors, "weight_zero_point", (-(-out_features * self.bits // 32), groups), torch.int32
            )
            zeros = unpack_int32(packed_zeros, self.bits, dim=0, count=out_features).float()
        else:
            zero_point = tensors["weight_zero_point"].float().reshape(out_features, -1)
            zeros = zero_point.expand(out_features, groups) + offset
        g_idx = (
            expect_shape(tensors, "weight_g_idx", (in_features,), None).long() if "weight_g_idx" in tensors else None
        )
        if g_idx is not None and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise ValueError(f"belongs to a module whose weight_g_idx names groups outside 0..{groups - 1}")
        return IntWeight(self.bits, codes, scales, zeros.contiguous(), group_size, g_idx, input_scale)

    def _int_scales(self, scale: Tensor, out_features: int, groups: int) -> Tensor:
        """``weight_scale`` as float32 ``[out, groups]`` (a per-tensor scale repeated per channel)."""
        if self.strategy == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"belongs to a module whose 'weight_scale' has {scale.numel()} values, expected 1")
            return scale.float().reshape(1, 1).expand(out_features, 1).contiguous()
        return expect_shape({"weight_scale": scale}, "weight_scale", (out_features, groups), None).float()

    def _fp8_scales(self, scale: Tensor, out_features: int, in_features: int) -> tuple[Tensor, tuple[int, int]]:
        """FP8 ``weight_scale`` as float32 ``[out, in // block columns]`` and the block's ``(1, columns)``."""
        if self.strategy == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"belongs to a module whose 'weight_scale' has {scale.numel()} values, expected 1")
            return scale.float().reshape(1, 1).expand(out_features, 1).contiguous(), (1, in_features)
        if self.strategy == "channel":
            scale = expect_shape({"weight_scale": scale}, "weight_scale", (out_features, 1), None)
            return scale.float(), (1, in_features)
        rows, columns = self.block
        shape = (-(-out_features // rows), -(-in_features // columns))
        scale = expect_shape({"weight_scale": scale}, "weight_scale", shape, None)
        return scale.float().repeat_interleave(rows, dim=0)[:out_features].contiguous(), (1, columns)


def _activation_scheme(args: Mapping[str, Any] | None) -> ActivationScheme | None:
    if not args:
        return None
    method = "compressed-tensors"
    kind = check_choice(method, "input_activations.type", args.get("type"), ("int", "float"))
    check_choice(method, "input_activations.num_bits", args.get("num_bits"), (8,))
    strategy = check_choice(method, "input_activations.strategy", args.get("strategy"), ("token", "tensor", "group"))
    if not args.get("symmetric", True):
        raise ValueError(f"{method}: asymmetric input activations are not supported; supported: symmetric")
    is_dynamic = bool(args.get("dynamic"))
    if strategy != "tensor" and not is_dynamic:
        raise ValueError(f"{method}: static {strategy} activation scales are not supported; supported: per tensor")
    group_size = args.get("group_size") if strategy == "group" else None
    return ActivationScheme(type=kind, num_bits=8, strategy=strategy, is_dynamic=is_dynamic, group_size=group_size)
