"""Launcher for the quantized matmul kernels in ``cpu/quant_matmul.cpp`` (AVX2, and VNNI and AMX where present).

The C++ is compiled on first use (see ``tokenmill_kernels.cpp_build``): the wheel ships the source rather
than a binary tied to one torch build. The kernels need AVX2 and FMA, and :func:`load` says what is missing
rather than letting the process die of an illegal instruction; they also need F16C for the float16 scales,
which every AVX2 CPU has and the compiled op checks.

The kernels come in one variant per instruction set, all multiplying int16 activation codes with the weights
widened to int16: ``"avx2"`` (``vpmaddwd`` on 256-bit vectors, a group of 32 in two halves; from 5 rows on, two
groups in four registers whose int32 lanes alternate between them, one conversion and scaled add for both, the
weights widened once per row group for every activation tile), ``"avx_vnni"`` (the same with ``vpdpwssd``
adding the products) and ``"avx512"`` (one 512-bit ``vpmaddwd`` per group, 32 vector registers, 4 x 4 tiles),
``"avx512_vnni16"`` (AVX512-VNNI ``vpdpwssd``; from 5 rows on for int4 weights and 8 for int8, the column tiles:
16 weight rows to a register, one pair of codes per lane, each activation row's code pair broadcast against all
16, a strip of 32 weight rows laid out once for every tile of up to 6 activation rows; ``"avx512"``'s tiles for
int8 under 8 rows), and ``"amx"``
(``"avx512_vnni16"``, and for inputs of 16 rows or more AMX int8 tile products: each int16 code
split exactly into a signed high and an unsigned low byte, two tile products a group, the same integer dot
products; Sapphire Rapids on, where Linux grants the tile state). Under 5 rows every variant runs int4 weights
through the nibble tiles: two groups (256-bit) or four (512-bit) unpacked from one load by shifts and masks into
the order the activation codes are laid out in, one conversion and scaled add for all of them, 4 weight rows a
tile. The best variant the CPU supports is used;
:func:`supported_isas` lists them and :func:`set_isa` forces one, e.g. to compare speeds. ``"avx2"`` and
``"avx_vnni"`` give bit-identical outputs; the 512-bit variants sum 16 float32 lanes instead of 8
(``"avx512_vnni16"`` four groups before converting them, or with the column tiles one group at a time and its min
term after its scaled product; ``"amx"`` each group's scaled product and its min term apart), so their outputs
differ from the others' in float32 rounding only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor

from tokenmill_kernels.cpp_build import CppExtension

__all__ = [
    "c_api",
    "experts",
    "is_available",
    "isa",
    "load",
    "matmul_int4",
    "matmul_int8",
    "prepare",
    "quantize_activations",
    "set_isa",
    "supported_isas",
]

# -ffp-contract=off keeps the compiler from fusing scalar a * b + c into FMAs, which would round differently
# from reference.py; the kernels' own FMAs are explicit intrinsics.
_EXTENSION = CppExtension(
    "tokenmill_quant_matmul",
    Path(__file__).resolve().parent / "cpu" / "quant_matmul.cpp",
    ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"],
    "quantized matmul kernels",
)
_module: ModuleType | None = None  # the loaded extension, kept here to skip a call per matmul


def is_available() -> bool:
    """True when the CPU can run the kernels and the toolchain to build them is present."""
    return _EXTENSION.is_available()


def prepare() -> None:
    """Start building (first use on a machine) or loading the extension in the background and return; the first
    call that needs it waits. Several extensions prepared together build side by side."""
    _EXTENSION.prepare()


def load() -> ModuleType:
    """The compiled extension, built on first call; raises ``RuntimeError`` naming what is missing."""
    global _module
    if _module is None:
        _module = _EXTENSION.load()
    return _module


def c_api() -> object:
    """The extension's C++ entry points for another extension's C++, in a capsule (``cpu_common/kernel_api.h``)."""
    return (_module or load()).c_api()


def matmul_int8(x: Tensor, qweight: Tensor, scales: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [M, K] float32 @ W.T + bias`` for ``W`` from :func:`~.reference.quantize_int8` -> ``[M, N] float32``.

    ``qweight`` is int8 ``[N, K]`` and ``scales`` float16 ``[N, K // 32]``.

    The compiled op checks every shape, dtype, device and contiguity first and raises ``ValueError`` (e.g. for
    K not a multiple of 32); validating there rather than here keeps the per-call overhead near 1 us.
    """
    return (_module or load()).matmul_int8(x, qweight, scales, bias)


def matmul_int4(x: Tensor, qweight: Tensor, scales: Tensor, mins: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [M, K] float32 @ W.T + bias`` for ``W`` from :func:`~.reference.quantize_int4` -> ``[M, N] float32``.

    ``qweight`` is uint8 ``[N, K // 2]`` (packed codes), ``scales`` and ``mins`` float16 ``[N, K // 32]``.

    Inputs are validated by the compiled op, as for :func:`matmul_int8`.
    """
    return (_module or load()).matmul_int4(x, qweight, scales, mins, bias)


def experts(gate_up: Sequence[Tensor], down: Sequence[Tensor], *, gelu: bool = False) -> Any:
    """A mixture-of-experts layer's routed experts in int8 or int4, checked once (raises ``ValueError``):
    ``gate_up`` holds each expert's ``qweight``, ``scales`` (and, int4, ``mins``) of its gate and up projections
    merged ([2 * inner, hidden]), ``down`` the same of its down projection ([hidden, inner]), as
    :func:`matmul_int8`/:func:`matmul_int4` take them, without biases. Its ``apply(x, topk_ids, topk_weights)``
    (``x`` [tokens, hidden] float32, ``topk_ids`` [tokens, top_k] int64 with -1 for an expert held elsewhere,
    ``topk_weights`` [tokens, top_k] float32) returns ``sum_k topk_weights[t, k] * expert[topk_ids[t, k]](x[t])``
    [tokens, hidden], each expert's MLP ``down(act(gate) * up)`` with ``act`` SiLU or (``gelu``) GELU's tanh form,
    in one call: each chosen expert runs once over its tokens. The tensors must keep their storage."""
    return (_module or load()).Experts(list(gate_up), list(down), gelu)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' own rounding of ``x [M, K] float32``: ``(qx int16 [M, K], dx, sx float32 [M, K // 32])``,
    which must equal :func:`~.reference.quantize_activations` exactly (tests compare them)."""
    q, d, s = load().quantize_activations(x)
    return q, d, s


def supported_isas() -> list[str]:
    """The kernel variants this CPU can run, best last: ``"avx2"``, then ``"avx_vnni"``, ``"avx512"``."""
    return _EXTENSION.supported_isas()


def isa() -> str:
    """The variant :func:`matmul_int8` and :func:`matmul_int4` use now."""
    return _EXTENSION.isa()


def set_isa(name: str) -> None:
    """Use variant ``name`` (one of :func:`supported_isas`, or ``"auto"`` for the best) in this process from now on.

    Raises ``ValueError`` for a variant the CPU lacks. Outputs do not change, only speed.
    """
    _EXTENSION.set_isa(name)
