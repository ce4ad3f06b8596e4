"""A GGUF file's rope scaling, as a Hugging Face ``rope_scaling`` dict.

GGUF keeps it in one of two places:

- ``{arch}.rope.scaling.*`` metadata (``linear``, ``yarn``, ...), mapped key by key;
- for Llama 3.x, a ``rope_freqs.weight`` tensor instead: the per-frequency
  divisors that llama.cpp's converter computes from the ``llama3`` rope scaling
  (``inv_freq[i] / rope_freqs[i]`` is Hugging Face's scaled ``inv_freq[i]``).
  The converter always uses ``low_freq_factor=1``, ``high_freq_factor=4`` and an
  original context of 8192 (what every Llama 3.x release uses), so the factor is
  the tensor's largest value; the rest of the tensor is checked against the
  curve those parameters give, and a tensor that does not fit is an error
  rather than a silently wrong rope;
- for Phi-3's LongRoPE, ``rope_factors_long.weight`` and ``rope_factors_short.weight``
  tensors (the config's ``long_factor`` and ``short_factor``) beside
  ``rope.scaling.original_context_length``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

ROPE_FREQS_TENSOR = "rope_freqs.weight"
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

#: What llama.cpp's converter assumes for ``llama3`` rope scaling besides the factor.
LLAMA3_FIXED_PARAMETERS: dict[str, Any] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# GGUF rope.scaling.* keys -> Hugging Face rope_scaling keys.
_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def rope_scaling_from_metadata(get: Callable[[str], Any], arch: str) -> dict[str, Any] | None:
    """``rope_scaling`` from ``{arch}.rope.scaling.*`` keys; ``get(key)`` returns None when absent."""
    prefix = f"{arch}.rope.scaling."
    rope_type = get(prefix + "type")
    if rope_type is None:
        linear = get(f"{arch}.rope.scale_linear")  # the key older converters wrote
        return {"rope_type": "linear", "factor": float(linear)} if linear and linear != 1.0 else None
    if rope_type == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": str(rope_type)}
    for gguf_key, hf_key in _SCALING_KEYS.items():
        value = get(prefix + gguf_key)
        if value is not None:
            scaling[hf_key] = value
    return scaling


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> list[float]:
    """The ``rope_freqs`` values llama.cpp's converter writes for ``llama3`` rope scaling."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def rope_scaling_from_freqs(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """``rope_scaling`` equivalent to a ``rope_freqs`` tensor; None when it scales nothing.

    Raises ``ValueError`` (a one-line reason) when no supported scaling produces it.
    """
    import numpy as np

    values = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if values.shape[0] != head_dim // 2:
        raise ValueError(f"has {values.shape[0]} values, expected head_dim/2 = {head_dim // 2}")
    if np.allclose(values, 1.0):
        return None
    factor = float(str(np.float32(values.max())))  # the low-frequency plateau; 8.0, not 8.000000x
    expected = llama3_rope_factors(head_dim, theta, factor, **LLAMA3_FIXED_PARAMETERS)
    if not np.allclose(values, expected, rtol=1e-4, atol=1e-6):
        raise ValueError(
            "per-frequency rope factors that match no supported rope scaling "
            "(llama3 with low_freq_factor 1, high_freq_factor 4, original context 8192)"
        )
    return {"rope_type": "llama3", "factor": factor, **LLAMA3_FIXED_PARAMETERS}


def longrope_scaling(
    long_factor: np.ndarray, short_factor: np.ndarray, get: Callable[[str], Any], arch: str
) -> dict[str, Any]:
    """Phi-3's ``longrope`` ``rope_scaling`` from its factor tensors and ``{arch}.rope.scaling.*`` keys.

    Raises ``ValueError`` when the original context length the factors switch at is missing.
    """
    import numpy as np

    original = get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"LongRoPE factors without metadata key {arch}.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        # float32 values as their shortest decimals (1.3, not 1.2999999523), as the config wrote them
        "long_factor": [float(str(value)) for value in np.asarray(long_factor, dtype=np.float32).reshape(-1)],
        "short_factor": [float(str(value)) for value in np.asarray(short_factor, dtype=np.float32).reshape(-1)],
        "original_max_position_embeddings": int(original),
    }
    # rope.scaling.attn_factor is left out: the converter writes transformers' default, sqrt(1 + ln(factor) /
    # ln(original)), which RopeConfig computes itself when the config has none.
    return scaling
