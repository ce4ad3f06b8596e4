"""The weight-format interface: reading a model's config and tensors from files."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:  # torch is imported by the formats when they read tensors, not by plugin discovery
    import torch

from tokenmill.errors import TokenmillError


class WeightsError(TokenmillError, ValueError):
    """A weight file is unusable. The message is one line naming the file and, if any, the tensor."""


@dataclass(frozen=True)
class LoadedTensor:
    """One tensor read from a weight file, under its Hugging Face name."""

    name: str  # e.g. "model.layers.0.self_attn.q_proj.weight"
    tensor: torch.Tensor  # floating point; quantized storage is dequantized for now
    file: Path  # the file it came from, for error messages


@runtime_checkable
class WeightFormat(Protocol):
    """Reads one on-disk model format.

    Built once per process by the model loader; every method is called from the
    process that loads the model (the engine), once per model load.
    """

    #: Registered name, e.g. ``"safetensors"`` or ``"gguf"``.
    name: ClassVar[str]

    def can_load(self, path: Path) -> bool:
        """Whether ``path`` (a file or directory) is in this format. Cheap: no tensor data is read."""
        ...

    def read_config(self, path: Path) -> dict[str, Any]:
        """The model's config as a Hugging Face ``config.json`` dict.

        Must contain at least ``architectures``, ``model_type`` and the
        architecture's size fields. Raises ``WeightsError`` on unreadable input.
        """
        ...

    def iter_tensors(self, path: Path) -> Iterator[LoadedTensor]:
        """Yield the model's tensors one at a time, under Hugging Face names.

        Streams: at most one tensor (plus the format's memory map) is held at a
        time, so peak memory stays near the model's size. Raises
        ``WeightsError`` for a missing shard, a truncated or corrupt file, or
        an unsupported tensor type.
        """
        ...
