"""Per-dtype tolerances for comparing a kernel's output with its float32 reference.

Used as ``torch.testing.assert_close(actual, expected, **tolerance(dtype))``.
Attention outputs are weighted means of value rows drawn from N(0, 1), so they
lie within a few units of 0 and an absolute term dominates near 0.
"""

from __future__ import annotations

from typing import TypedDict

import torch


class Tolerance(TypedDict):
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    # Products are exact float32 (no TF32); only the summation order and exp2-vs-exp differ from the
    # reference: about 1e-6 observed, 20x headroom.
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    # Two roundings to float16 (unit roundoff 4.9e-4): the probabilities before P·V, as flash attention
    # does, and the output. Two ulps near 1 leave room for both.
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    # The same two roundings with bfloat16's 8-bit mantissa (unit roundoff 3.9e-3): 0.0156 observed for
    # outputs near 2, one ulp there; 2e-2 plus the relative term covers outputs up to ~4.
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def tolerance(dtype: torch.dtype) -> Tolerance:
    """``atol``/``rtol`` for ``torch.testing.assert_close`` of a kernel's ``dtype`` output against a reference."""
    return TOLERANCES[dtype]
