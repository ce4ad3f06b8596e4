"""Running quantized checkpoints on the CPU kernels: the runtime shared by the GPTQ, AWQ and compressed-tensors
readers.

Each reader unpacks its format into an ``IntWeight`` or ``FloatWeight`` (``checkpoint_weights``); this module
repacks that once, at load, for the kernels in ``tokenmill_kernels.quant_matmul``:

* **4-bit codes** become the int4 kernel's Q4_1 layout (``w = d * q + m`` per 32 inputs): ``d`` is the group's
  scale and ``m = -zero * d``, so GPTQ/AWQ groups of 32, 64, 128 split into groups of 32 with the same scale.
  With one scale per output channel the kernel runs with ``d = 1, m = -zero`` (exact in float16) and the output
  is multiplied by the float32 channel scale. Group scales are stored as float16, the kernel's format: a relative
  rounding of at most 2**-11 on a scale (GPTQ and AWQ store float16 scales already; compressed-tensors' float32 or
  bfloat16 scales round), and ``m`` rounds to float16 too when the zero point is not a power of two.
* **8-bit codes** become the int8 kernel's Q8_0 layout (``q - 128`` as int8); an asymmetric zero point adds
  ``sum_g (128 - zero_g) * d_g * sum(x in group g)``, one small float32 matmul.
* **Activation order** (GPTQ ``desc_act``, a non-trivial ``g_idx``): the input columns are permuted once at load so
  that each group is contiguous, and each input row is permuted the same way (a gather) before the kernel.
* **FP8** weights stay FP8 (one byte each) and are converted to float32 one tile of 128 output rows at a time
  inside ``apply`` (:func:`fp8_to_float`), then multiplied in float32 (CPUs have no FP8 arithmetic): the conversion
  costs more than the float32 matmul it feeds (docs/quantization.md gives the figures).
* **INT8 weights and activations** (W8A8, one scale per output channel): each input row is rounded to int8 (per
  token, or per tensor with the checkpoint's static ``input_scale``) and multiplied by the int8 weights in integers
  (``torch._int_mm``: oneDNN's int8 GEMM, VNNI where the CPU has it), then scaled: the checkpoint's numerics exactly,
  up to float32 rounding of the scales. (The int16-activation kernel would round the already rounded activations a
  second time.)
* **FP8 activations**: each input is rounded to FP8 and back (per token, per tensor or per group), as
  compressed-tensors does, before the float32 matmul.

On CUDA (the layer's buffers live on the GPU when its weight loads; ``apply`` dispatches on the input's device) the
model computes in float16, bfloat16 or float32 and the same names hold GPU layouts:

* **4- and 8-bit weights** (weight-only) run the Triton kernel ``tokenmill_kernels.quant_matmul.triton``:
  ``qweight`` int32 ``[in * bits / 32, out]`` (codes packed along the input), float32 ``scales`` and ``mins``
  (``-zero * scale``) ``[groups, out]`` at the checkpoint's own group size (one group per channel included), and
  ``perm`` for activation order as on the CPU. Each tile is dequantized inside the kernel and accumulated in float32.
* **W8A8** keeps the CPU layout (int8 ``[out, in]``, ``out_scale``) and ``torch._int_mm`` (cuBLAS) multiplies; it
  needs more than 16 rows, so a decode batch of 16 tokens or fewer is padded with zero rows to 17, which costs far
  less than dequantizing the weight; inputs or outputs not a multiple of 8 fall back to a float32 matmul of the codes.
* **FP8** keeps the CPU layout. With FP8 activations per token or per tensor, per-channel (or per-tensor) weight
  scales, dimensions that are multiples of 16 and a GPU of compute capability 8.9 or more, ``torch._scaled_mm``
  multiplies the FP8 codes (unit scales, float32 output) and the token and channel scales multiply its output.
  Otherwise (older GPUs, weight-only FP8, block scales, per-group activations) activations are rounded to FP8 and
  back as on the CPU and the weight is dequantized ``FP8_GPU_TILE_ROWS`` output rows at a time into the model's
  dtype for ``F.linear``.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from tokenmill_kernels import quant_matmul
from tokenmill_kernels.quant_matmul import cpu as quant_cpu
from torch import Tensor, nn

from tokenmill.layers.dense import DenseQuantizer
from tokenmill.layers.quantizer import Quantizer, layer_bias, layer_tensor
from tokenmill_plugins.quant.checkpoint_weights import (
    ActivationScheme,
    FloatWeight,
    IntWeight,
    merge_parts,
    shard_part,
)
from tokenmill_plugins.quant.options import QuantOptions
from tokenmill_plugins.quant.weight_only import Int8Quantizer

#: The kernels' group: 32 consecutive inputs share a scale.
KERNEL_GROUP = quant_matmul.GROUP


def integer_input_group(group_size: int) -> int:
    """``input_group_size`` for integer weights in groups of ``group_size`` inputs (-1: one scale per output
    channel): a shard's inputs must be whole groups and whole blocks of the kernels."""
    return math.lcm(KERNEL_GROUP, group_size) if group_size > 0 else KERNEL_GROUP


#: Output rows of an FP8 weight converted to float32 at a time.
FP8_TILE_ROWS = 128
#: Output rows of an FP8 weight dequantized at a time on a GPU without FP8 matmuls (or for block scales).
FP8_GPU_TILE_ROWS = 1024
#: ``torch._int_mm`` on CUDA needs more rows than 16: fewer are padded to this.
INT_MM_MIN_ROWS = 17
#: Model dtypes the CUDA paths compute in.
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The layer buffers this runtime fills (empty when unused); named alike for every layer so the weight cache
#: stores and restores them.
_STORAGE = ("qweight", "scales", "mins", "perm", "out_scale", "zero_term", "input_scale")


class CheckpointQuantizer(Quantizer):
    """A quantizer that reads a checkpoint format (subclasses: GPTQ, AWQ, compressed-tensors) and runs it on the
    CPU kernels, or on CUDA (module docstring). ``configure`` sets :attr:`checkpoint_tensor_names`,
    :attr:`weight_kind` and :attr:`activations`; ``read_checkpoint`` unpacks one module's tensors."""

    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    auto_priority: ClassVar[int] = 10

    #: "int4", "int8", "w8a8" or "fp8": which kernel the weights run on, known from the config.
    weight_kind: str = "int4"
    #: How inputs are quantized before the matmul, or None (weight-only).
    activations: ActivationScheme | None = None

    @classmethod
    def is_available(cls) -> bool:
        return quant_cpu.is_available() or _cuda_is_available()

    def __init__(self, options: QuantOptions | None = None) -> None:
        self.output_quantization = (options or QuantOptions()).output_quantization
        self._dtype = torch.float32
        if quant_cpu.is_available():  # a GPU host may lack AVX2 or a compiler; the CUDA paths need neither
            quant_cpu.prepare()  # start building or loading the C++ now, beside the weights

    def output_quantizer(self) -> Quantizer:
        # The tools this reads leave lm_head in float (configure refuses a checkpoint that quantized it);
        # [plugins.quant] output_quantization = "int8" quantizes it at load, as GGUF files store it.
        if self.output_quantization == "int8":
            return Int8Quantizer()
        return DenseQuantizer()

    def merge(self, parts: Sequence[Any]) -> Any:
        return merge_parts(parts)

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, bias: bool, dtype: torch.dtype
    ) -> None:
        if dtype != torch.float32 and not (dtype in _CUDA_DTYPES and _cuda_is_available()):
            raise ValueError(
                f"quantizer {self.name!r} computes in float32 on the CPU; set model.dtype to float32 or auto"
            )
        self._dtype = dtype
        if self.weight_kind != "fp8" and in_features % KERNEL_GROUP:
            raise ValueError(
                f"quantizer {self.name!r} needs in_features divisible by {KERNEL_GROUP}, got {in_features}"
            )
        for name in _STORAGE:  # shaped by the weight when it arrives
            layer.register_buffer(name, torch.empty(0))
        bias_param = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        layer.register_parameter("bias", bias_param)

    def load_weight(self, layer: nn.Module, param_name: str, tensor: Any) -> None:
        if param_name == "bias":
            layer_tensor(layer, "bias").data.copy_(tensor)
            return
        device = layer_tensor(layer, "qweight").device  # the placeholder's: the layer is on its device already
        is_cpu = not _takes_gpu_paths(device)
        if is_cpu and self._dtype != torch.float32:
            raise ValueError(
                f"quantizer {self.name!r} computes in float32 on the CPU; set model.dtype to float32 or auto"
            )
        if isinstance(tensor, IntWeight):
            storage = repack_int(tensor) if is_cpu or self.weight_kind == "w8a8" else repack_int_gpu(tensor)
        elif isinstance(tensor, FloatWeight):
            storage = {"qweight": tensor.values.contiguous(), "scales": tensor.scales.float().contiguous()}
            if tensor.input_scale is not None:
                storage["input_scale"] = tensor.input_scale.float().reshape(1)
        else:
            raise ValueError(f"quantizer {self.name!r} reads quantized checkpoints, not a float weight")
        for name, value in storage.items():
            setattr(layer, name, value.to(device))  # the same tensor on the CPU

    def apply(self, layer: nn.Module, x: Tensor) -> Tensor:
        if _takes_gpu_paths(x.device):
            return self._apply_gpu(layer, x)
        plan = layer.__dict__.get("_cpu_plan")
        if plan is None or plan.qweight is not layer._buffers["qweight"]:
            plan = _CpuPlan.of(layer)
            layer.__dict__["_cpu_plan"] = plan
        x = x.float()
        if plan.perm is not None:
            x = x.index_select(1, plan.perm)
        if self.weight_kind == "w8a8":
            assert self.activations is not None and plan.out_scale is not None
            codes, x_scale = quantize_activations(x, self.activations, plan.input_scale)
            out = torch._int_mm(codes.to(torch.int8), plan.qweight.T).float() * (
                x_scale.reshape(-1, 1) * plan.out_scale
            )
            return out if plan.bias is None else out + plan.bias
        if self.activations is not None:
            codes, x_scale = quantize_activations(x, self.activations, plan.input_scale)
            x = (codes * x_scale).reshape(x.shape)
        x = x.contiguous()
        # The kernels add the bias themselves when nothing comes after the matmul.
        is_final = plan.zero_term is None and plan.out_scale is None
        kernel_bias = plan.bias if is_final else None
        if self.weight_kind == "fp8":
            out, kernel_bias = _fp8_matmul(x, plan.qweight, plan.scales), None
        elif self.weight_kind == "int4":
            out = quant_matmul.matmul_int4(x, plan.qweight, plan.scales, plan.mins, kernel_bias)
        else:
            out = quant_matmul.matmul_int8(x, plan.qweight, plan.scales, kernel_bias)
        if plan.zero_term is not None:  # [out, num_groups]
            out = out + x.reshape(x.shape[0], plan.zero_term.shape[1], -1).sum(dim=-1) @ plan.zero_term.T
        if plan.out_scale is not None:
            out = out * plan.out_scale
        return out if plan.bias is None or kernel_bias is not None else out + plan.bias

    def _apply_gpu(self, layer: nn.Module, x: Tensor) -> Tensor:
        """``apply`` on CUDA (module docstring): ``[num_tokens, out]`` in ``x``'s dtype."""
        qweight = layer_tensor(layer, "qweight")
        scales = layer_tensor(layer, "scales")
        bias = layer_bias(layer)
        if self.weight_kind in ("int4", "int8"):
            from tokenmill_kernels.quant_matmul import triton as quant_triton

            perm = layer_tensor(layer, "perm")
            bits = 4 if self.weight_kind == "int4" else 8
            mins = layer_tensor(layer, "mins")
            return quant_triton.dequant_matmul(x, qweight, scales, mins, bits, bias, perm if perm.numel() else None)
        input_scale = layer_tensor(layer, "input_scale")
        if self.weight_kind == "w8a8":
            assert self.activations is not None
            out = int8_matmul(x, qweight, layer_tensor(layer, "out_scale"), self.activations, input_scale)
            out = out if bias is None else out + bias
            return out.to(x.dtype)
        use_scaled_mm = supports_fp8_matmul(x.device)
        return fp8_matmul(x, qweight, scales, self.activations, input_scale, bias, use_scaled_mm=use_scaled_mm)

    def shard_weight(self, weight: Any, dim: int, rank: int, size: int) -> Any:
        return shard_part(weight, dim, rank, size)

    # What each format supplies.
    def configure(self, quantization_config: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def read_checkpoint(self, tensors: Mapping[str, Tensor], out_features: int, in_features: int) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class _CpuPlan:
    """A layer's CPU storage as ``apply`` uses it, read once (attribute lookups through ``nn.Module`` cost about a
    microsecond each, and a model runs a few hundred linears per step); None where the layer does not use it."""

    qweight: Tensor
    scales: Tensor
    mins: Tensor
    perm: Tensor | None
    out_scale: Tensor | None
    zero_term: Tensor | None
    input_scale: Tensor
    bias: Tensor | None

    @classmethod
    def of(cls, layer: nn.Module) -> _CpuPlan:
        def optional(name: str) -> Tensor | None:
            value = layer_tensor(layer, name)
            return value if value.numel() else None

        return cls(
            qweight=layer_tensor(layer, "qweight"),
            scales=layer_tensor(layer, "scales"),
            mins=layer_tensor(layer, "mins"),
            perm=optional("perm"),
            out_scale=optional("out_scale"),
            zero_term=optional("zero_term"),
            input_scale=layer_tensor(layer, "input_scale"),
            bias=layer_bias(layer),
        )


def repack_int(weight: IntWeight) -> dict[str, Tensor]:
    """The kernel storage for ``weight`` (see the module docstring): ``qweight``, ``scales`` and, as needed,
    ``mins``, ``perm``, ``out_scale``, ``zero_term`` and ``input_scale``."""
    out_features, in_features = weight.codes.shape
    codes, groups = weight.codes, weight.group_index()
    storage: dict[str, Tensor] = {}
    if weight.g_idx is not None and not torch.equal(groups, torch.arange(in_features) // weight.group_size):
        perm = torch.argsort(groups, stable=True)
        if not torch.equal(torch.bincount(groups), torch.full((weight.scales.shape[1],), weight.group_size)):
            raise ValueError("its g_idx does not put group_size inputs in every group")
        codes, storage["perm"] = codes[:, perm], perm
    num_groups = weight.scales.shape[1]
    per_channel = num_groups == 1
    if not per_channel and weight.group_size % KERNEL_GROUP:
        raise ValueError(f"group size {weight.group_size} is not a multiple of {KERNEL_GROUP}")
    repeat = in_features // KERNEL_GROUP // num_groups  # kernel groups per checkpoint group
    if per_channel:
        d = torch.ones(out_features, 1)  # [out, 1]; the channel scale multiplies the output instead
        storage["out_scale"] = weight.scales[:, 0].float().contiguous()
    else:
        d = weight.scales.float().to(torch.float16).float()  # [out, num_groups], as the kernel stores it
    zeros = weight.zeros.float()
    if weight.bits == 4:
        mins = (-zeros * d).to(torch.float16)
        storage["qweight"] = quant_matmul.pack_int4_codes(codes)
        storage["scales"] = d.to(torch.float16).repeat_interleave(repeat, dim=1).contiguous()
        storage["mins"] = mins.repeat_interleave(repeat, dim=1).contiguous()
    elif weight.bits == 8:
        storage["qweight"] = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
        storage["scales"] = d.to(torch.float16).repeat_interleave(repeat, dim=1).contiguous()
        if not torch.all(zeros == 128):
            storage["zero_term"] = ((128 - zeros) * d).contiguous()  # [out, num_groups]
    else:
        raise ValueError(f"{weight.bits}-bit codes have no kernel (4 and 8 bits do)")
    if weight.input_scale is not None:
        storage["input_scale"] = weight.input_scale.float().reshape(1)
    return storage


def quantize_activations(x: Tensor, scheme: ActivationScheme, input_scale: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[num_tokens, in]`` on the scheme's symmetric grid, as compressed-tensors does: ``(codes, scale)``
    with ``x ~= codes * scale``, the codes as float32 (integers, or FP8 values), shaped ``[num_tokens, in]`` (for
    groups ``[num_tokens, groups, group_size]``). The scale is absmax over the token (or tensor, or group) / half
    the code range (127.5 for int8, 448 for FP8 e4m3), or the static ``input_scale``; codes are clamped to the
    range (-128..127, +-448)."""
    if scheme.type == "int":
        low, high = -float(2 ** (scheme.num_bits - 1)), float(2 ** (scheme.num_bits - 1) - 1)
    else:
        high = torch.finfo(torch.float8_e4m3fn).max
        low = -high
    if scheme.strategy == "group" and scheme.group_size:
        x = x.reshape(x.shape[0], -1, scheme.group_size)
    if scheme.is_dynamic:
        dims: tuple[int, ...] = tuple(range(x.dim())) if scheme.strategy == "tensor" else (-1,)
        amax = x.abs().amax(dim=dims, keepdim=True)
        # A tensor divisor: CUDA divides by a host scalar as a multiplication by its reciprocal, which rounds
        # differently from the CPU (and from the tool that made the checkpoint) and moves codes at midpoints.
        scale = amax / amax.new_tensor((high - low) / 2)
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    else:
        scale = input_scale
    scaled = torch.clamp(x / scale, low, high)
    codes = scaled.round() if scheme.type == "int" else scaled.to(torch.float8_e4m3fn).float()
    return codes, scale


def _fp8_matmul(x: Tensor, values: Tensor, scales: Tensor) -> Tensor:
    """``x @ (float(values) * scales).T``, converting ``FP8_TILE_ROWS`` output rows at a time. ``scales`` is
    float32 ``[out, in // block]``: ``[out, 1]`` per channel (applied to the output), wider for blocks."""
    out = torch.empty(x.shape[0], values.shape[0])  # [num_tokens, out]
    per_channel = scales.shape[1] == 1
    block = -(-values.shape[1] // scales.shape[1])
    codes = values.view(torch.uint8)
    for start in range(0, values.shape[0], FP8_TILE_ROWS):
        rows = slice(start, start + FP8_TILE_ROWS)
        tile = fp8_to_float(codes[rows])  # [tile, in], FP8_SCALE times too small
        if per_channel:
            out[:, rows] = F.linear(x, tile) * (scales[rows, 0] * FP8_SCALE)
        else:
            tile *= scales[rows].repeat_interleave(block, dim=1)[:, : values.shape[1]] * FP8_SCALE
            out[:, rows] = F.linear(x, tile)
    return out


#: What :func:`fp8_to_float`'s results must be multiplied by: 2 ** (float16's exponent bias - e4m3's).
FP8_SCALE = 2.0 ** (15 - 7)


def fp8_to_float(codes: Tensor) -> Tensor:
    """FP8 e4m3 bytes (uint8) as float32, divided by :data:`FP8_SCALE`: each byte's sign, exponent and mantissa
    moved into float16's fields (exponent unbiased by e4m3's bias, so the value comes out 2**-8 of the FP8 one,
    subnormals included), then float16 -> float32. Exact for every finite e4m3 value and much faster than
    torch's own FP8 -> float32 conversion on the CPU, which is what an FP8 matmul here spends its time on; the two
    NaN codes come out as +-1.875 (checkpoints have none)."""
    wide = codes.to(torch.int16)
    return (((wide & 0x80) << 8) | ((wide & 0x7F) << 7)).view(torch.float16).float()


# ---------------------------------------------------------------- CUDA


def _takes_gpu_paths(device: torch.device) -> bool:
    """Whether a layer on ``device`` stores and runs the GPU layouts. Tests route CPU tensors through them (the
    Triton kernel under the interpreter) by replacing this."""
    return device.type != "cpu"


def _cuda_is_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def supports_fp8_matmul(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies float8 e4m3 on ``device``: NVIDIA GPUs of compute capability 8.9
    (Ada) or more."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


def repack_int_gpu(weight: IntWeight) -> dict[str, Tensor]:
    """The Triton kernel's storage for ``weight`` (``tokenmill_kernels.quant_matmul.triton``): ``qweight`` int32
    ``[in * bits / 32, out]``, float32 ``scales`` and ``mins = -zero * scale`` ``[groups, out]`` and, for
    activation order, ``perm`` (as in :func:`repack_int`). On the CPU; the caller moves it to the device."""
    from tokenmill_kernels.quant_matmul import triton as quant_triton

    in_features = weight.codes.shape[1]
    codes, groups = weight.codes, weight.group_index()
    storage: dict[str, Tensor] = {}
    if weight.g_idx is not None and not torch.equal(groups, torch.arange(in_features) // weight.group_size):
        if not torch.equal(torch.bincount(groups), torch.full((weight.scales.shape[1],), weight.group_size)):
            raise ValueError("its g_idx does not put group_size inputs in every group")
        storage["perm"] = torch.argsort(groups, stable=True)
        codes = codes[:, storage["perm"]]
    if weight.bits not in quant_triton.SUPPORTED_BITS:
        raise ValueError(f"{weight.bits}-bit codes have no kernel (4 and 8 bits do)")
    if (in_features // weight.scales.shape[1]) % KERNEL_GROUP:
        raise ValueError(f"group size {weight.group_size} is not a multiple of {KERNEL_GROUP}")
    scales = weight.scales.float()  # [out, num_groups]
    storage["qweight"] = quant_triton.pack_int_weight(codes, weight.bits)
    storage["scales"] = scales.T.contiguous()
    storage["mins"] = (-weight.zeros.float() * scales).T.contiguous()
    return storage


def int8_matmul(x: Tensor, qweight: Tensor, out_scale: Tensor, scheme: ActivationScheme, input_scale: Tensor) -> Tensor:
    """W8A8 on any device: ``x`` rounded to int8 as ``scheme`` says, times the int8 ``qweight`` ``[out, in]`` in
    integers, times the token and channel scales: float32 ``[num_tokens, out]``.

    ``torch._int_mm`` (cuBLAS on CUDA) needs more than 16 rows and dimensions that are multiples of 8: fewer rows
    are padded with zeros; other dimensions multiply the codes in float32 (exact while the sums stay below 2**24)."""
    codes, x_scale = quantize_activations(x.float(), scheme, input_scale)
    num_tokens = codes.shape[0]
    out_features, in_features = qweight.shape
    if in_features % 8 or out_features % 8:
        dots = codes @ qweight.float().T
    else:
        rows = codes.to(torch.int8)
        if num_tokens < INT_MM_MIN_ROWS:
            rows = F.pad(rows, (0, 0, 0, INT_MM_MIN_ROWS - num_tokens))  # [17, in]
        dots = torch._int_mm(rows, qweight.T)[:num_tokens].float()
    return dots * (x_scale.reshape(-1, 1) * out_scale)


def fp8_matmul(
    x: Tensor,
    values: Tensor,
    scales: Tensor,
    scheme: ActivationScheme | None,
    input_scale: Tensor,
    bias: Tensor | None,
    *,
    use_scaled_mm: bool,
) -> Tensor:
    """``x @ (float(values) * scales).T + bias`` for FP8 ``values`` ``[out, in]`` and float32 ``scales``
    ``[out, in // block]``, with ``x`` first rounded to FP8 and back when ``scheme`` says: ``[num_tokens, out]`` in
    ``x``'s dtype, on any device.

    With ``use_scaled_mm`` (:func:`supports_fp8_matmul`) and a scheme ``torch._scaled_mm`` can take (FP8 per token
    or per tensor, per-channel weight scales, dimensions multiples of 16) the FP8 codes are multiplied as they are;
    otherwise the weight is dequantized ``FP8_GPU_TILE_ROWS`` rows at a time into ``x``'s dtype."""
    out_features, in_features = values.shape
    scaled_mm_fits = (
        scheme is not None
        and scheme.type == "float"
        and scheme.strategy in ("token", "tensor")
        and scales.shape[1] == 1
        and in_features % 16 == 0
        and out_features % 16 == 0
    )
    if use_scaled_mm and scaled_mm_fits:
        assert scheme is not None
        codes, x_scale = quantize_activations(x.float(), scheme, input_scale)
        one = torch.ones((), device=x.device)  # unit scales: the token and channel scales multiply the output
        dots = torch._scaled_mm(codes.to(torch.float8_e4m3fn), values.T, one, one, out_dtype=torch.float32)
        out = dots * (x_scale.reshape(-1, 1) * scales.reshape(1, -1))
        return (out if bias is None else out + bias).to(x.dtype)
    if scheme is not None:
        codes, x_scale = quantize_activations(x.float(), scheme, input_scale)
        x = (codes * x_scale).reshape(x.shape).to(x.dtype)
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)  # [num_tokens, out]
    block = -(-in_features // scales.shape[1])
    for start in range(0, out_features, FP8_GPU_TILE_ROWS):
        rows = slice(start, start + FP8_GPU_TILE_ROWS)
        if scales.shape[1] == 1:  # FP8 values are exact in x's dtype; the channel scale multiplies the output
            out[:, rows] = F.linear(x, values[rows].to(x.dtype)) * scales[rows, 0]
        else:
            tile = values[rows].float() * scales[rows].repeat_interleave(block, dim=1)[:, :in_features]
            out[:, rows] = F.linear(x, tile.to(x.dtype))
    return out if bias is None else out + bias
