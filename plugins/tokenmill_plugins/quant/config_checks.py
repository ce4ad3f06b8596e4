"""Checks shared by the checkpoint format readers: one-line errors naming the setting or tensor and what is
supported."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def check_choice(method: str, key: str, value: Any, supported: Sequence[T]) -> T:
    """``value`` if it is one of ``supported``, else ``ValueError`` naming both."""
    if value not in supported:
        choices = ", ".join(str(s) for s in supported)
        raise ValueError(f"{method}: {key} {value!r} is not supported; supported: {choices}")
    return value


def check_group_size(method: str, value: Any) -> int:
    """A group size the kernels take: -1 (one group per output channel) or a positive multiple of 32."""
    if not isinstance(value, int) or not (value == -1 or (value > 0 and value % 32 == 0)):
        raise ValueError(
            f"{method}: group_size {value!r} is not supported; supported: -1 (per channel) or a multiple of 32"
        )
    return value


def expect_shape(tensors: Mapping[str, Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> Tensor:
    """``tensors[name]``, checked against ``shape`` (and ``dtype`` unless None)."""
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"belongs to a module whose {name!r} has shape {list(tensor.shape)}, expected {list(shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"belongs to a module whose {name!r} is {tensor.dtype}, expected {dtype}")
    return tensor


def num_groups(in_features: int, group_size: int) -> tuple[int, int]:
    """``(group_size, number of groups)`` of a linear with ``in_features`` inputs; -1 is one group."""
    size = in_features if group_size == -1 else group_size
    if in_features % size:
        raise ValueError(f"belongs to a module with {in_features} inputs, not a multiple of the group size {size}")
    return size, in_features // size
