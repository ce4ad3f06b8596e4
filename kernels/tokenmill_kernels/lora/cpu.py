"""Launcher for the CPU LoRA kernel in ``cpu/lora.cpp`` (AVX2, FMA, F16C): float32 activations, adapter weights in
float32, float16 or bfloat16.

``add_lora`` adds each token's adapter product to a linear's output in place: ``h = lora_a[slot] @ x[t]``, then
for each part ``p`` of a merged linear ``y[t, offsets[p]:offsets[p] + out_p] += h[p] @ lora_b[p][slot]``.

An engine step calls it for every adapted linear with the same tokens: ``plan`` groups a step's tokens by slot
once, ``weights`` checks one linear's slot tensors once, and ``weights(...).add(plan, x, y)`` is then one call
that checks only ``x`` and ``y`` (about a microsecond where ``add_lora`` takes several: at one token, 120 such
calls a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from tokenmill_kernels.cpp_build import CppExtension

__all__ = ["add_lora", "c_api", "is_available", "load", "plan", "prepare", "weights"]

_EXTENSION = CppExtension(
    "tokenmill_lora_kernels",
    Path(__file__).resolve().parent / "cpu" / "lora.cpp",
    ["-O3", "-mavx2", "-mfma", "-mf16c"],
    "CPU LoRA kernels",
)


def is_available() -> bool:
    """True when the CPU can run the kernel and the toolchain to build it is present."""
    return _EXTENSION.is_available()


def prepare() -> None:
    """Start building (first use on a machine) or loading the extension in the background and return; the first
    call that needs it waits."""
    _EXTENSION.prepare()


def load() -> None:
    """Build (first use on a machine) or load the extension; raises ``RuntimeError`` naming what is missing."""
    _EXTENSION.load()


def c_api() -> object:
    """The extension's C++ entry points for another extension's C++, in a capsule (``cpu_common/kernel_api.h``):
    the layer kernels' decoder stack adds a step's adapter products with them."""
    return _EXTENSION.load().c_api()


def add_lora(
    x: Tensor, lora_a: Tensor, lora_b: Sequence[Tensor], offsets: Sequence[int], token_slots: Tensor, y: Tensor
) -> None:
    """Add to ``y`` [tokens, out] (rows contiguous) in place each token's adapter product, for ``x`` [tokens, in]
    (rows contiguous), ``lora_a`` [slots, parts * rank, in], ``lora_b[p]`` [slots, rank, out_p] (contiguous, float32,
    float16 or bfloat16, one dtype) and ``token_slots`` [tokens] int64 (-1: no adapter), on the CPU; ``x`` and ``y``
    float32. The compiled op checks
    shapes, dtypes, strides and slots and raises ``ValueError``."""
    weights(lora_a, lora_b, offsets).add(plan(token_slots), x, y)


def plan(token_slots: Tensor) -> Any:
    """A step's tokens grouped by slot, for ``token_slots`` [tokens] (contiguous int64 on the CPU, -1: no
    adapter); raises ``ValueError`` on a slot below -1."""
    return _EXTENSION.load().Plan(token_slots)


def weights(lora_a: Tensor, lora_b: Sequence[Tensor], offsets: Sequence[int]) -> Any:
    """One adapted linear's slots, checked once (as ``add_lora`` takes them; raises ``ValueError``). Its
    ``add(plan, x, y)`` adds the products for the tokens of ``plan``; the tensors must keep their storage (an
    adapter is loaded into a slot in place)."""
    return _EXTENSION.load().Weights(lora_a, list(lora_b), list(offsets))
