"""Rotary position embedding (the "rotate half" layout used by Hugging Face checkpoints)."""

from __future__ import annotations

import math

import torch

from tokenmill.layers.kernels import UsesLayerKernels
from tokenmill.models.architecture import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Per-pair rotation speeds, with the checkpoint's scaling applied. [rotary_dim // 2] float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling_type == "llama3":
        # Llama 3.1: slow (long-wavelength) frequencies are divided by `factor`, fast ones
        # are kept, and the band between is interpolated smoothly.
        wavelength = 2 * math.pi / inv_freq
        old_len = rope.original_max_position_embeddings
        low_freq_wavelength = old_len / rope.low_freq_factor
        high_freq_wavelength = old_len / rope.high_freq_factor
        scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        interpolated = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
        inv_freq = torch.where(is_medium, interpolated, scaled)
    return inv_freq.float()


class RotaryEmbedding(UsesLayerKernels):
    """Applies rope at arbitrary positions, from a cos/sin table built on first use: the model calls
    ``set_positions`` once per forward, then each layer ``rotate``s its queries and keys."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.max_position = max_position
        # Built lazily: the model is constructed on the meta device and materialised later.
        self._cos_sin: torch.Tensor | None = None
        self._step_cos = self._step_sin = torch.empty(0)  # [num_tokens, 1, head_dim // 2] of the step

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = inverse_frequencies(self.rope, self.head_dim).to(device)
            positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
            angles = torch.outer(positions, inv_freq)  # [max_position, head_dim // 2]
            self._cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_position, head_dim]
        return self._cos_sin

    def set_positions(self, positions: torch.Tensor) -> None:
        """Look up the step's cos/sin once, for every layer's ``rotate``. Called at the start of each
        forward (inside a captured CUDA graph too, so replays look up the new positions)."""
        cos_sin = self._table(positions.device)[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        self._step_cos, self._step_sin = cos_sin.chunk(2, dim=-1)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rope at the positions of the last ``set_positions``, applied to ``x`` [num_tokens, any heads,
        head_dim]: queries and keys may come as one tensor. The layer kernels may rotate ``x`` in place."""
        return self.layer_kernels.rotary(x, self._step_cos, self._step_sin)
