"""What each ``tokenmill quantize --method`` writes, and round-to-nearest quantization with its parameters.

Each method is a compressed-tensors scheme as llm-compressor names and writes it:

=======  ===================  ==================================================  ===============
method   preset               weights                                             format
=======  ===================  ==================================================  ===============
gptq     W4A16                int4 symmetric, groups of 128, GPTQ                 pack-quantized
awq      W4A16_ASYM           int4 asymmetric (zero points), groups of 128, AWQ   pack-quantized
fp8      FP8_DYNAMIC          float8 e4m3 per output channel, round to nearest    float-quantized
int8     W8A8                 int8 symmetric per output channel, GPTQ             int-quantized
=======  ===================  ==================================================  ===============

fp8 and int8 also quantize each linear's input per token at run time (dynamic activations), as those
presets do. Scales and zero points follow compressed-tensors' ``calculate_qparams`` exactly: the range
always includes 0, a symmetric scale is ``absmax / ((qmax - qmin) / 2)`` (``absmax / 7.5`` for int4,
``/ 127.5`` for int8, ``/ 448`` for float8), an asymmetric one ``(max - min) / (qmax - qmin)`` with the zero
point ``round(qmin - min / scale)`` clamped to the code range, and a zero scale becomes float32's epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tokenmill.errors import TokenmillError

if TYPE_CHECKING:
    import torch

METHODS = ("gptq", "awq", "fp8", "int8")
#: The compressed-tensors version whose format this writes (the config's ``version``).
COMPRESSED_TENSORS_VERSION = "0.19.0"
_FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


class QuantizeError(TokenmillError, ValueError):
    """A ``tokenmill quantize`` setting or input that cannot work (method, group size, calibration text)."""


@dataclass(frozen=True)
class QuantScheme:
    """How one method stores a linear's weights (and quantizes its input at run time)."""

    method: str
    algorithm: Literal["gptq", "awq", "rtn"]
    weight_type: Literal["int", "float"]
    num_bits: int
    symmetric: bool
    group_size: int | None  # None: one scale per output channel
    activations: Literal["int", "float"] | None  # dynamic per-token input quantization; None: float input
    format: str  # compressed-tensors format name
    act_order: bool = False  # GPTQ only: columns in decreasing Hessian diagonal (llm-compressor's "static")

    @property
    def code_range(self) -> tuple[float, float]:
        """Smallest and largest code: [-8, 7] for int4, [-128, 127] for int8, +-448 for float8."""
        if self.weight_type == "float":
            return -_FP8_MAX, _FP8_MAX
        return -(2 ** (self.num_bits - 1)), 2 ** (self.num_bits - 1) - 1

    def weight_args(self) -> dict[str, Any]:
        """The scheme's ``weights`` entry in ``quantization_config.config_groups``."""
        return {
            "actorder": "static" if self.act_order else None,
            "block_structure": None,
            "dynamic": False,
            "group_size": self.group_size,
            "num_bits": self.num_bits,
            "observer": "memoryless_minmax",
            "observer_kwargs": {},
            "scale_dtype": None,
            "strategy": "group" if self.group_size is not None else "channel",
            "symmetric": self.symmetric,
            "type": self.weight_type,
            "zp_dtype": None if self.symmetric else "torch.int8",
        }

    def activation_args(self) -> dict[str, Any] | None:
        if self.activations is None:
            return None
        return {
            "actorder": None,
            "block_structure": None,
            "dynamic": True,
            "group_size": None,
            "num_bits": 8,
            "observer": None,
            "observer_kwargs": {},
            "scale_dtype": None,
            "strategy": "token",
            "symmetric": True,
            "type": self.activations,
            "zp_dtype": None,
        }

    def quantization_config(self, ignore: list[str]) -> dict[str, Any]:
        """``config.json``'s ``quantization_config``, field for field as llm-compressor writes it."""
        return {
            "config_groups": {
                "group_0": {
                    "format": self.format,
                    "input_activations": self.activation_args(),
                    "output_activations": None,
                    "targets": ["Linear"],
                    "weights": self.weight_args(),
                }
            },
            "format": self.format,
            "global_compression_ratio": None,
            "ignore": ignore,
            "kv_cache_scheme": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION,
        }


def make_scheme(method: str, group_size: int = 128, act_order: bool = True) -> QuantScheme:
    """The scheme of ``method`` (one of ``METHODS``); ``group_size`` applies to the int4 methods."""
    if method not in METHODS:
        raise QuantizeError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if method in ("gptq", "awq") and (group_size < 8 or group_size % 8 != 0):
        raise QuantizeError(f"--group-size {group_size}: must be a positive multiple of 8 (e.g. 32, 64, 128)")
    if method == "gptq":
        return QuantScheme("gptq", "gptq", "int", 4, True, group_size, None, "pack-quantized", act_order)
    if method == "awq":
        return QuantScheme("awq", "awq", "int", 4, False, group_size, None, "pack-quantized")
    if method == "fp8":
        return QuantScheme("fp8", "rtn", "float", 8, True, None, "float", "float-quantized")
    return QuantScheme("int8", "gptq", "int", 8, True, None, "int", "int-quantized", act_order)


@dataclass
class QuantizedWeight:
    """A linear's weight as stored: codes [out, in] (int8 holding intN codes, or float8_e4m3fn), scale
    [out, num_groups] float32 and, for an asymmetric scheme, zero points [out, num_groups] int8."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the codes stand for [out, in]."""
        return dequantize(self.codes, self.scale, self.zero_point)


def check_shape(name: str, in_features: int, scheme: QuantScheme) -> None:
    """Raise unless a linear with ``in_features`` inputs splits into the scheme's groups."""
    if scheme.group_size is not None and in_features % scheme.group_size != 0:
        raise QuantizeError(
            f"{name}: {in_features} input features do not split into groups of {scheme.group_size}; "
            "choose a --group-size that divides it"
        )


def weight_qparams(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min-max scale [out, num_groups] float32 and zero point (int8, asymmetric schemes) of ``weight`` [out, in]."""
    import torch

    rows, cols = weight.shape
    group_size = scheme.group_size or cols
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    low = groups.amin(dim=-1).clamp(max=0)  # [out, num_groups]: the range always includes 0
    high = groups.amax(dim=-1).clamp(min=0)
    qmin, qmax = scheme.code_range
    eps = torch.finfo(torch.float32).eps
    if scheme.symmetric:
        scale = torch.maximum(low.abs(), high) / ((qmax - qmin) / 2)
        return torch.where(scale == 0, eps, scale), None
    scale = (high - low) / (qmax - qmin)
    is_zero = scale == 0  # an all-zero group: compressed-tensors' zero point comes out 0 (NaN cast to int)
    scale = torch.where(is_zero, eps, scale)
    zero_point = torch.where(is_zero, 0.0, torch.round(qmin - low / scale).clamp(qmin, qmax)).to(torch.int8)
    return scale, zero_point


def quantize(
    weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """Codes of ``weight`` [out, in] (or one column [out]) under per-group ``scale`` [out, num_groups]
    (or [out]): int8 holding the integer codes, or float8_e4m3fn."""
    import torch

    scale_full, zero_full = _expand(weight, scale), None if zero_point is None else _expand(weight, zero_point)
    scaled = weight.float() / scale_full
    if zero_full is not None:
        scaled = scaled + zero_full.float()
    qmin, qmax = scheme.code_range
    if scheme.weight_type == "float":
        return scaled.clamp(qmin, qmax).to(torch.float8_e4m3fn)
    return torch.round(scaled).clamp(qmin, qmax).to(torch.int8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> torch.Tensor:
    """Float32 values of ``codes`` (shapes as in ``quantize``)."""
    values = codes.float()
    if zero_point is not None:
        values = values - _expand(codes, zero_point).float()
    return values * _expand(codes, scale)


def fake_quantize(
    weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """``weight`` rounded to the nearest value its codes can hold, as float32."""
    return dequantize(quantize(weight, scale, zero_point, scheme), scale, zero_point)


def quantize_rtn(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round to nearest with min-max scales."""
    scale, zero_point = weight_qparams(weight, scheme)
    return QuantizedWeight(quantize(weight, scale, zero_point, scheme), scale, zero_point)


def _expand(values: torch.Tensor, per_group: torch.Tensor) -> torch.Tensor:
    """``per_group`` [out, num_groups] repeated over each group's columns to ``values``' shape [out, in];
    a column [out] takes a column of parameters [out] as it is."""
    if values.dim() == 1:
        return per_group
    group_size = values.shape[1] // per_group.shape[1]
    return per_group.repeat_interleave(group_size, dim=1)
