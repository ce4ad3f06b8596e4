"""Launcher for the CPU layer kernels in ``cpu/layer_kernels.cpp`` (AVX2, FMA), float32 only.

``rms_norm`` normalises rows, after adding the residual when given (returning the sum too); ``rotary`` applies
rope in place on a strided [tokens, heads, head_dim] view; ``silu_and_mul`` is SiLU of a row's first half times
its second. One pass each, where torch runs several operators.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from tokenmill_kernels.cpp_build import CppExtension

__all__ = ["c_api", "is_available", "load", "prepare", "rms_norm", "rotary", "silu_and_mul"]

_EXTENSION = CppExtension(
    "tokenmill_layer_kernels",
    Path(__file__).resolve().parent / "cpu" / "layer_kernels.cpp",
    ["-O3", "-mavx2", "-mfma"],
    "CPU layer kernels",
)


def is_available() -> bool:
    """True when the CPU can run the kernels and the toolchain to build them is present."""
    return _EXTENSION.is_available()


def prepare() -> None:
    """Start building (first use on a machine) or loading the extension in the background and return; the first
    call that needs it waits. Several extensions prepared together build side by side."""
    _EXTENSION.prepare()


def load() -> None:
    """Build (first use on a machine) or load the extension; raises ``RuntimeError`` naming what is missing."""
    _EXTENSION.load()


def c_api() -> object:
    """The extension's C++ entry points for another extension's C++, in a capsule (``cpu_common/kernel_api.h``)."""
    return _EXTENSION.load().c_api()


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """RMSNorm of ``x`` [..., hidden] (of ``x + residual`` when given) scaled by ``weight`` [hidden], float32.

    Returns the norm, shaped like ``x``, and the sum ``x + residual`` (None without a residual). The compiled op
    checks shapes, dtypes and strides and raises ``ValueError``. Rows [tokens, hidden] (a layer's hidden states)
    go as they are: reshaping and viewing would cost more than the norm (about 1 us a call each)."""
    extension = _EXTENSION.load()
    if x.dim() != 2:  # q/k norms over [tokens, heads, head_dim]
        out, total = rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, None if residual is None else
                              residual.reshape(-1, x.shape[-1]))  # fmt: skip
        return out.view(x.shape), None if total is None else total.view(x.shape)
    if residual is None:
        return extension.rms_norm(x, weight, eps)[0], None
    out, total = extension.rms_norm(x, weight, eps, residual)
    return out, total


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rope in place on ``x`` [tokens, heads, head_dim] (last dimension contiguous) with ``cos`` and ``sin``
    [tokens, 1, head_dim // 2]; returns ``x``."""
    _EXTENSION.load().rotary(x, cos, sin)
    return x


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``gate_up`` [tokens, 2 * inner] (rows contiguous) holding gate then up ->
    [tokens, inner]. The exponential is a vectorised polynomial within 2 ulp of exact."""
    return _EXTENSION.load().silu_and_mul(gate_up)
