"""Launcher for the CPU decoder stack in ``cpu/decoder.cpp``: a Llama-shaped model's layers run in one C++ call.

Each layer is the RMSNorm (with the residual add), the int4/int8 qkv projection, rope, the KV cache write, paged
attention, the output projection, the second norm, and the SiLU MLP, run through the ``layer_kernels``,
``paged_attention`` and ``quant_matmul`` extensions' own C++ (their ``c_api()`` tables,
``cpu_common/kernel_api.h``) in the order the Python forward calls them: the same result, bit for bit, without a
Python call between the kernels.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from tokenmill_kernels.cpp_build import CppExtension
from tokenmill_kernels.layer_kernels import cpu as layer_kernels
from tokenmill_kernels.paged_attention import cpu as paged_attention
from tokenmill_kernels.quant_matmul import cpu as quant_matmul

__all__ = ["DecoderStack", "is_available", "prepare"]

_EXTENSION = CppExtension(
    "tokenmill_decoder", Path(__file__).resolve().parent / "cpu" / "decoder.cpp", ["-O3", "-mavx2", "-mfma"],
    "CPU decoder stack",
)  # fmt: skip


def is_available() -> bool:
    """True when this stack and the kernels it calls can build and run here."""
    return all(e.is_available() for e in (_EXTENSION, layer_kernels, paged_attention, quant_matmul))


def prepare() -> None:
    """Start building (first use on a machine) or loading the extension in the background and return."""
    _EXTENSION.prepare()


#: A linear's tensors as the quantized matmuls take them: ``[qweight, scales, mins, bias]``, ``mins`` None for int8
#: and ``bias`` None without one.
LinearTensors = Sequence[Tensor | None]


def DecoderStack(  # noqa: N802 - it constructs the C++ class
    linears: Sequence[LinearTensors],
    norms: Sequence[Tensor],
    attention: Sequence[tuple[int, int, int, float, int, float]],
    eps: float,
) -> Any:
    """The C++ stack of ``len(attention)`` layers, checked once (``ValueError``): ``linears`` holds each layer's
    qkv (q, k and v merged, [heads + 2 * kv_heads] x head_dim outputs), o, gate_up (gate then up) and down
    projections in that order; ``norms`` each layer's input and post-attention RMSNorm weights [hidden] float32,
    then the final norm's; ``attention`` each layer's ``(num_heads, num_kv_heads, head_dim, scale, sliding_window
    or 0, logits_soft_cap or 0.0)``; ``eps`` the norms' epsilon. The tensors must keep their storage.

    Its ``forward(hidden, cos, sin, kv_caches, slot_mapping, block_tables, token_req, positions)`` takes the
    embeddings [tokens, hidden] float32, the step's rope ``cos``/``sin`` [tokens, 1, head_dim // 2], each layer's KV
    cache [2, num_blocks, block_size, kv_heads, row] and the step's paged-attention inputs as
    ``paged_attention.cpu.paged_attention`` and ``write_kv_cache`` take them, and returns the final norm of the
    last layer's output [tokens, hidden]."""
    return _EXTENSION.load().DecoderStack(
        [list(parts) for parts in linears], list(norms), list(attention), eps, layer_kernels.c_api(),
        paged_attention.c_api(), quant_matmul.c_api(),
    )  # fmt: skip
