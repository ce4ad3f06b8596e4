"""Rotary position embedding (the "rotate half" layout used by Hugging Face checkpoints).

Scalings: ``linear``, ``llama3`` and ``longrope`` (Phi-3's, once called ``su``). longrope has two sets of
frequencies: the short ones for positions inside the original context and the long ones from it on. The table
holds both, per position, as vLLM's does, so a token's rotation depends on its own position only (transformers
switches a whole sequence to the long set once it grows past the original context). A partial rotary factor
rotates the first part of each head and leaves the rest as it is (Phi-4-mini).
"""

from __future__ import annotations

import math

import torch

from tokenmill.layers.kernels import UsesLayerKernels
from tokenmill.models.architecture import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    """How many leading dimensions of each head rope rotates."""
    return int(head_dim * rope.partial_rotary_factor)


def longrope_attention_factor(rope: RopeConfig) -> float:
    """What longrope multiplies cos and sin by: the config's, or the one the LongRoPE paper suggests."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def inverse_frequencies(rope: RopeConfig, rotary_dim: int, long: bool = False) -> torch.Tensor:
    """Per-pair rotation speeds, with the checkpoint's scaling applied (for longrope, the short frequencies or,
    with ``long``, the long ones). [rotary_dim // 2] float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"longrope needs {rotary_dim // 2} factors per set, the config has {len(factors)}")
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    elif rope.scaling_type == "linear":
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
        self.rotary_dim = rotary_dim(rope, head_dim)
        self.max_position = max_position
        # Built lazily: the model is constructed on the meta device and materialised later.
        self._cos_sin: torch.Tensor | None = None
        self._step_cos = self._step_sin = torch.empty(0)  # [num_tokens, 1, rotary_dim // 2] of the step

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            rope, dim = self.rope, self.rotary_dim
            positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
            angles = torch.outer(positions, inverse_frequencies(rope, dim).to(device))  # [max_position, dim // 2]
            scale = 1.0
            if rope.scaling_type == "longrope":
                original = rope.original_max_position_embeddings
                long_angles = torch.outer(positions[original:], inverse_frequencies(rope, dim, long=True).to(device))
                angles = torch.cat([angles[:original], long_angles])
                scale = longrope_attention_factor(rope)
            self._cos_sin = torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)  # [max_position, dim]
        return self._cos_sin

    def set_positions(self, positions: torch.Tensor) -> None:
        """Look up the step's cos/sin once, for every layer's ``rotate``. Called at the start of each
        forward (inside a captured CUDA graph too, so replays look up the new positions)."""
        cos_sin = self._table(positions.device)[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
        self._step_cos, self._step_sin = cos_sin.chunk(2, dim=-1)

    def step_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin of the last ``set_positions``, each [num_tokens, 1, rotary_dim // 2], as ``rotate``
        passes them to the layer kernels."""
        return self._step_cos, self._step_sin

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Rope at the positions of the last ``set_positions``, applied to ``x`` [num_tokens, any heads,
        head_dim]: queries and keys may come as one tensor. The layer kernels may rotate ``x`` in place."""
        if self.rotary_dim == self.head_dim:
            return self.layer_kernels.rotary(x, self._step_cos, self._step_sin)
        rotated = self.layer_kernels.rotary(x[..., : self.rotary_dim].contiguous(), self._step_cos, self._step_sin)
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)
