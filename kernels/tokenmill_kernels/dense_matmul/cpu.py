"""Launcher for the dense float32 matmul kernels in ``cpu/dense_matmul.cpp`` (AVX2, and AVX-512 where present).

The weight is packed once (:func:`pack`) into panels of 32 outputs, k-major, and :func:`linear` multiplies by it
reading every weight once for up to 12 input rows (3 with AVX2 alone): a decode step of one request streams the weights
at the memory's speed, and a step verifying a few speculative tokens costs about as much
(docs/benchmarks-history.md, "Dense float32 linears: the cpu layer kernels against oneDNN").

The C++ is compiled on first use (see ``tokenmill_kernels.cpp_build``), like the quantized matmul kernels. The
variants are ``"avx2"`` (tiles of up to 3 rows x 32 outputs) and ``"avx512"`` (12 rows x 32 outputs); the best the
CPU supports is used, :func:`set_isa` forces one. Both sum each output's products in blocks of 64 k with fused
multiply-adds and add the blocks' sums in order, so they give bit-identical outputs, as near float64's as MKL's.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from torch import Tensor

from tokenmill_kernels.cpp_build import CppExtension

__all__ = ["PANEL", "is_available", "isa", "linear", "load", "pack", "prepare", "set_isa", "supported_isas"]

#: Outputs per panel of a packed weight: ``pack`` returns ``[ceil(N / PANEL), K, PANEL]``.
PANEL = 32

_EXTENSION = CppExtension(
    "tokenmill_dense_matmul",
    Path(__file__).resolve().parent / "cpu" / "dense_matmul.cpp",
    ["-O3", "-mavx2", "-mfma"],
    "dense matmul kernels",
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


def pack(weight: Tensor) -> Tensor:
    """``weight [N, K] float32`` (CPU) as :func:`linear` reads it: ``[ceil(N / 32), K, 32]``, zero past ``N``."""
    return (_module or load()).pack(weight)


def linear(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """``x [M, K] float32 @ W.T + bias -> [M, out_features]`` for ``packed = pack(W)``.

    The compiled op checks every shape, dtype, device and contiguity first and raises ``ValueError``; validating
    there rather than here keeps the per-call overhead near 1 us.
    """
    return (_module or load()).linear(x, packed, out_features, bias)


def supported_isas() -> list[str]:
    """The kernel variants this CPU can run, best last: ``"avx2"``, then ``"avx512"``."""
    return _EXTENSION.supported_isas()


def isa() -> str:
    """The variant :func:`linear` uses now."""
    return _EXTENSION.isa()


def set_isa(name: str) -> None:
    """Use variant ``name`` (one of :func:`supported_isas`, or ``"auto"`` for the best) in this process from now on.

    Raises ``ValueError`` for a variant the CPU lacks. Outputs do not change, only speed.
    """
    _EXTENSION.set_isa(name)
