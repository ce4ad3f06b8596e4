"""What a quantized checkpoint's linear holds, whatever format wrote it: integer codes with group scales and zero
points (GPTQ, AWQ, compressed-tensors' pack- and int-quantized), or FP8 values with scales (float-quantized).

The format readers (``gptq``, ``awq``, ``compressed_tensors``) unpack their tensors into these, laid out
``[out_features, in_features]`` like ``nn.Linear.weight``, so that the parts of a merged linear (q, k, v) stack
along the output dimension and one runtime (``checkpoint_quantizer``) repacks them for the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from tokenmill_plugins.quant import packing


@dataclass(frozen=True)
class ActivationScheme:
    """How the checkpoint quantizes a linear's input: its values are rounded to this grid and back before the
    matmul, as compressed-tensors and vLLM do (symmetric, scale = absmax / largest code)."""

    type: str  # "int" or "float"
    num_bits: int  # 8
    strategy: str  # "token", "tensor" or "group"
    is_dynamic: bool  # scales from each input (else the checkpoint's ``input_scale``)
    group_size: int | None = None  # for strategy "group"


@dataclass(frozen=True)
class IntWeight:
    """``w[n, i] = (codes[n, i] - zeros[n, g(i)]) * scales[n, g(i)]`` with ``g(i) = g_idx[i]``, or ``i // group_size``
    when ``g_idx`` is None (groups of consecutive inputs)."""

    bits: int
    codes: Tensor  # uint8 [out, in], 0 .. 2**bits - 1
    scales: Tensor  # float32 [out, num_groups]
    zeros: Tensor  # float32 [out, num_groups], in the codes' unsigned domain (2**(bits-1) when symmetric)
    group_size: int  # inputs per group; in_features for one scale per output channel
    g_idx: Tensor | None = None  # int64 [in]: each input's group (activation order), None when consecutive
    input_scale: Tensor | None = None  # float32 [1] for static activation quantization

    def dequantize(self) -> Tensor:
        """Float32 ``[out, in]``: the weight the format defines."""
        groups = self.group_index()
        return (self.codes.float() - self.zeros[:, groups]) * self.scales[:, groups]

    def group_index(self) -> Tensor:
        """Each input's group: int64 [in]."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.codes.shape[1]) // self.group_size


@dataclass(frozen=True)
class FloatWeight:
    """FP8 (e4m3) values times a scale per tensor, per output channel or per block: ``w = float(values) * scale``."""

    values: Tensor  # float8_e4m3fn [out, in]
    scales: Tensor  # float32 [out, in // block_in] after expansion of per-tensor and per-channel scales
    block_size: tuple[int, int]  # (rows, columns) one scale covers; (1, in) per channel
    input_scale: Tensor | None = None  # float32 [1] for static activation quantization

    def dequantize(self) -> Tensor:
        rows, columns = self.block_size
        scales = self.scales.repeat_interleave(rows, dim=0)[: self.values.shape[0]]
        scales = scales.repeat_interleave(columns, dim=1)[:, : self.values.shape[1]]
        return self.values.float() * scales


def merge_parts(parts: Sequence[IntWeight | FloatWeight]) -> IntWeight | FloatWeight:
    """The parts of a merged linear (q, k, v) as one weight, stacked along the output dimension.

    Raises ``ValueError`` when they cannot share one input: different activation orders or group sizes."""
    first = parts[0]
    if any(type(part) is not type(first) for part in parts):
        raise ValueError("the parts of a merged linear are stored in different formats")
    input_scale = _merged_input_scale([part.input_scale for part in parts])
    if isinstance(first, IntWeight):
        ints = [part for part in parts if isinstance(part, IntWeight)]
        if any(p.bits != first.bits or p.group_size != first.group_size for p in ints):
            raise ValueError("the parts of a merged linear (q/k/v or gate/up) have different bit widths or group sizes")
        if any(not _same(p.g_idx, first.g_idx) for p in ints):
            raise ValueError(
                "the parts of a merged linear (q/k/v or gate/up) were quantized with different activation orders "
                "(g_idx); they share one input, so tokenmill needs one order"
            )
        return IntWeight(
            bits=first.bits,
            codes=torch.cat([p.codes for p in ints]),
            scales=torch.cat([p.scales for p in ints]),
            zeros=torch.cat([p.zeros for p in ints]),
            group_size=first.group_size,
            g_idx=first.g_idx,
            input_scale=input_scale,
        )
    floats = [part for part in parts if isinstance(part, FloatWeight)]
    if any(p.block_size != first.block_size for p in floats):
        raise ValueError("the parts of a merged linear have FP8 scales of different granularity")
    return FloatWeight(
        values=torch.cat([p.values for p in floats]),
        scales=torch.cat([p.scales for p in floats]),
        block_size=first.block_size,
        input_scale=input_scale,
    )


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _merged_input_scale(scales: Sequence[Tensor | None]) -> Tensor | None:
    """One static input scale for parts that read the same input: the largest, as vLLM does (llm-compressor
    calibrates each part on the same activations, so they are equal in practice)."""
    present = [s for s in scales if s is not None]
    if not present:
        return None
    return torch.stack([s.reshape(()) for s in present]).amax().reshape(1)


def unpack_int32(packed: Tensor, bits: int, dim: int, count: int) -> Tensor:
    """Codes packed ``32 // bits`` to an int32 along ``dim``, lowest bits first (GPTQ, AWQ before reordering,
    compressed-tensors): uint8 with ``count`` elements along ``dim``. The bit layout is the quantize writer's
    (:mod:`tokenmill_plugins.quant.packing`), whose signed codes are these minus ``2**(bits - 1)``."""
    available = packed.shape[dim] * (32 // bits)
    if available < count:
        raise ValueError(f"holds {available} codes along dimension {dim}, expected {count}")
    signed = packing.unpack_int32(packed.to(torch.int32), bits, count, dim=dim)
    return (signed.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)


def shard_part(weight: IntWeight | FloatWeight, dim: int, rank: int, size: int) -> IntWeight | FloatWeight:
    """Tensor-parallel rank ``rank``'s part of a weight read whole: its share of the output rows (``dim`` 0) or of
    the input columns (``dim`` 1), of ``size`` equal shares.

    Raises ``ValueError`` where a share would cut through a group or block of one scale, and along the inputs of
    activation-ordered groups (a share would hold parts of groups scattered over the whole width)."""
    if isinstance(weight, IntWeight):
        count = weight.codes.shape[dim] // size
        start = rank * count
        if dim == 0:
            rows = slice(start, start + count)
            return replace(weight, codes=weight.codes[rows], scales=weight.scales[rows], zeros=weight.zeros[rows])
        if weight.g_idx is not None and not torch.equal(
            weight.g_idx, torch.arange(weight.codes.shape[1]) // weight.group_size
        ):
            raise ValueError(
                "has activation-ordered groups (g_idx), which tokenmill does not split over the shards' inputs; "
                "use tensor_parallel_size = 1 or a checkpoint quantized without activation order"
            )
        if weight.group_size >= weight.codes.shape[1]:  # one scale per output channel: every share keeps it
            return replace(
                weight, codes=weight.codes[:, start : start + count].contiguous(), group_size=count, g_idx=None
            )
        if count % weight.group_size:
            raise ValueError(f"gives each shard {count} inputs, not whole groups of {weight.group_size}")
        groups = slice(start // weight.group_size, (start + count) // weight.group_size)
        return replace(
            weight,
            codes=weight.codes[:, start : start + count].contiguous(),
            scales=weight.scales[:, groups].contiguous(),
            zeros=weight.zeros[:, groups].contiguous(),
            g_idx=None,  # groups of consecutive inputs (checked above)
        )
    count = weight.values.shape[dim] // size
    start = rank * count
    block = weight.block_size[dim]
    values = weight.values.narrow(dim, start, count).contiguous()
    if block >= weight.values.shape[dim]:  # one scale along this dimension: every share keeps it
        sizes = list(weight.block_size)
        sizes[dim] = count
        return replace(weight, values=values, block_size=(sizes[0], sizes[1]))
    if count % block:
        raise ValueError(f"gives each shard {count} rows or columns, not whole FP8 blocks of {block}")
    scales = weight.scales.narrow(dim, start // block, count // block).contiguous()
    return replace(weight, values=values, scales=scales)
