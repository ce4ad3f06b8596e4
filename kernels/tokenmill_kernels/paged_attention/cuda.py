"""Launcher of the CUDA decode-attention kernel (``cuda/decode.cu``), compiled by NVRTC through CuPy.

The kernel works on torch tensors directly: the launcher passes their device
pointers (``data_ptr``) by value, on torch's current stream, so no copy and no
conversion to CuPy arrays is involved (CuPy has no bfloat16 dtype anyway).
CuPy is imported inside the functions: importing this module works on a
machine without CUDA or CuPy, and ``unavailable_reason`` says why it cannot run.
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Any

import numpy
import torch

__all__ = ["SUPPORTED_HEAD_DIMS", "cuda_source", "paged_attention_decode_cuda", "unavailable_reason"]

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
#: Threads per block; must match NUM_WARPS * WARP_SIZE in decode.cu.
_NUM_THREADS = 128
_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def unavailable_reason() -> str | None:
    """Why the CUDA kernel cannot run in this process, or None when it can.

    Called by the CUDA attention backend at construction and by the kernel
    tests to skip with that reason.
    """
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); install tokenmill[gpu] or cupy-cuda12x"
    return None


def cuda_source() -> str:
    """The CUDA C++ source of the decode kernels (shipped as package data)."""
    return (importlib.resources.files(__package__) / "cuda" / "decode.cu").read_text()


@functools.cache
def _module(device_index: int) -> Any:
    """The compiled module for one device, built on first use (NVRTC; CuPy also caches it on disk)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=cuda_source(), options=("--std=c++14",))


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _pointer(tensor: torch.Tensor) -> numpy.uint64:
    # A numpy scalar is passed by value with its own width: 8 bytes, as a device pointer.
    return numpy.uint64(tensor.data_ptr())


def paged_attention_decode_cuda(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written for decode tokens only
    *,
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Decode attention for every request whose query length is 1, like ``triton.paged_attention_decode``.

    Called by the CUDA attention backend once per layer per step (after the
    cache write) and by the GPU kernel tests. Rows of other requests' tokens
    in ``out`` are left as they are.
    """
    _expect(query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    _expect(
        key_cache.dim() == 4,
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)}",
    )
    num_kv_heads = key_cache.shape[2]
    _expect(query.dtype in _DTYPE_NAMES, f"dtype {query.dtype} is not one of {tuple(_DTYPE_NAMES)}")
    _expect(head_dim in SUPPORTED_HEAD_DIMS, f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}")
    _expect(key_cache.shape[3] == head_dim, f"query head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    _expect(num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
    _expect(
        value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride(),
        "value_cache must match key_cache in shape and strides",
    )
    for name, tensor in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        _expect(tensor.dtype == query.dtype, f"{name} is {tensor.dtype}, query is {query.dtype}")
        _expect(tensor.stride(-1) == 1, f"{name}'s head_dim must be contiguous, got strides {tensor.stride()}")
    _expect(out.shape == query.shape, f"out {tuple(out.shape)} must have the query's shape {tuple(query.shape)}")
    num_reqs = query_start_loc.shape[0] - 1
    for name, tensor, shape, dtype in (
        ("seq_lens", seq_lens, (num_reqs,), torch.int32),
        ("query_start_loc", query_start_loc, (num_reqs + 1,), torch.int32),
        ("positions", positions, (num_tokens,), torch.int64),
        ("block_tables", block_tables, (num_reqs, block_tables.shape[-1]), torch.int32),
    ):
        _expect(tuple(tensor.shape) == shape, f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
        _expect(tensor.dtype == dtype, f"{name} must be {dtype}, got {tensor.dtype}")
        _expect(tensor.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
                         ("seq_lens", seq_lens), ("query_start_loc", query_start_loc), ("positions", positions),
                         ("out", out)):  # fmt: skip
        _expect(tensor.device == query.device, f"{name} is on {tensor.device}, query on {query.device}")
    _expect(query.device.type == "cuda", f"the CUDA kernel needs CUDA tensors, got {query.device}")
    _expect(sliding_window is None or sliding_window > 0, f"sliding_window must be positive, got {sliding_window}")
    if num_reqs == 0:
        return

    import cupy

    device_index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    kernel = _module(device_index).get_function(f"paged_attention_decode_{_DTYPE_NAMES[query.dtype]}_d{head_dim}")
    args = (
        _pointer(out), _pointer(query), _pointer(key_cache), _pointer(value_cache),
        _pointer(block_tables), _pointer(seq_lens), _pointer(query_start_loc), _pointer(positions),
        numpy.float32(scale), numpy.int32(sliding_window or 0),
        numpy.int32(num_heads), numpy.int32(num_kv_heads), numpy.int32(key_cache.shape[1]),
        *(numpy.int64(s) for s in (query.stride(0), query.stride(1), out.stride(0), out.stride(1))),
        *(numpy.int64(s) for s in (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))),
        numpy.int64(block_tables.stride(0)),
    )  # fmt: skip
    stream = torch.cuda.current_stream(query.device)
    with cupy.cuda.Device(device_index), cupy.cuda.ExternalStream(stream.cuda_stream, device_index):
        kernel((num_reqs, num_heads), (_NUM_THREADS,), args)
