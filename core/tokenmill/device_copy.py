"""Host-to-device copies that do not wait for the device.

A plain copy to a GPU (``tensor.to("cuda")``, ``torch.tensor(..., device="cuda")``) waits until the GPU has
run everything queued before it, and one from pageable memory may wait too. Between steps that costs nothing,
but with async scheduling (docs/engine.md) the queue holds the step still running, so every per-step copy to
the GPU goes through here: into pinned memory, then queued without waiting. Torch's pinned-memory cache keeps
each pinned buffer until its copy has run. On the CPU these are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

__all__ = ["pinned", "to_device"]


def to_device(
    values: numpy.ndarray | torch.Tensor | Sequence[int] | Sequence[float],
    device: torch.device | str,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """``values`` on ``device``; a Python sequence becomes a tensor of ``dtype`` first (numpy arrays and
    tensors keep theirs)."""
    if isinstance(values, numpy.ndarray):
        tensor = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        tensor = values
    else:
        tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda" or not tensor.numel():
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pinned(array: numpy.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor to ``copy_(..., non_blocking=True)`` into a buffer on ``device``: pinned when that
    is a GPU."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if device.type == "cuda" else tensor
