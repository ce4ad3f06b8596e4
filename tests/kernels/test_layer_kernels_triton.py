"""The Triton layer kernels (RMSNorm with the residual add, SiLU times up, rope) against the torch reference.

They round where ``TorchLayerKernels`` rounds, so in float16 and bfloat16 almost every element must be
bitwise equal besides the tolerance: a kernel that skipped a rounding step (the residual sum, the normalised
row, the activation) would still pass a tolerance but not that. In float32 a different order of the sum of
squares moves every element of a row by an ulp, so there only the tolerance holds; so in bfloat16 under the
interpreter, whose conversion to bfloat16 truncates where a GPU's (and torch's) rounds to nearest. On CPU
they run under the Triton interpreter (``conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from tokenmill_kernels.layer_kernels import triton as kernels

from tests.kernels.tolerances import tolerance
from tokenmill.layers.kernels import TorchLayerKernels

assert torch.cuda.is_available() or kernels.is_interpreted(), "imported before TRITON_INTERPRET=1 was set"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REFERENCE = TorchLayerKernels()


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, min_equal: float = 0.98) -> None:
    """Close within the dtype's tolerance; in half precision also bitwise equal in ``min_equal`` of the elements."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, **tolerance(actual.dtype))
    if actual.dtype == torch.float32 or (actual.dtype == torch.bfloat16 and kernels.is_interpreted()):
        return
    equal = (actual == expected).float().mean().item()
    assert equal >= min_equal, f"only {equal:.1%} of the elements are bitwise equal"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 960])  # a power of two, SmolLM2's and a larger non-power
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    x = _randn(7, hidden, dtype=dtype, seed=0, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=1)
    assert_matches(kernels.rms_norm(x, weight, 1e-5)[0], REFERENCE.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_rounded_sum_and_its_norm(dtype: torch.dtype) -> None:
    x, residual = _randn(9, 576, dtype=dtype, seed=2), _randn(9, 576, dtype=dtype, seed=3, scale=4.0)
    weight = _randn(576, dtype=dtype, seed=4)
    normed, total = kernels.rms_norm(x, weight, 1e-6, residual)
    expected_normed, expected_total = REFERENCE.add_rms_norm(x, residual, weight, 1e-6)
    assert total is not None
    assert_matches(total, expected_total, min_equal=1.0)  # one rounding of the same sum
    assert_matches(normed, expected_normed)


def test_rms_norm_of_a_strided_view_of_heads() -> None:
    """Qwen3's q/k norms normalise each head of a [tokens, heads, head_dim] slice of the projection."""
    qkv = _randn(5, 6, 32, dtype=torch.float16, seed=5)
    query = qkv[:, :4]  # not contiguous
    weight = _randn(32, dtype=torch.float16, seed=6)
    assert_matches(kernels.rms_norm(query, weight, 1e-6)[0], REFERENCE.rms_norm(query, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [64, 1536, 1100])  # one block, several, a partial last block
def test_silu_and_mul(dtype: torch.dtype, inner: int) -> None:
    gate_up = _randn(6, 2 * inner, dtype=dtype, seed=7, scale=3.0)
    assert_matches(kernels.silu_and_mul(gate_up), REFERENCE.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96])  # a half of 48 is not a power of two
def test_rotary_rotates_the_heads_of_a_view_in_place(dtype: torch.dtype, head_dim: int) -> None:
    """Queries and keys are a strided view of the merged projection: rotated in place, values untouched."""
    heads, kv_heads, tokens = 5, 2, 4
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=8)
    value_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    query_and_key = qkv[:, : (heads + kv_heads) * head_dim].unflatten(-1, (heads + kv_heads, head_dim))
    angles = torch.rand(tokens, 1, head_dim // 2, generator=torch.Generator().manual_seed(9)) * 100
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)  # the layout RotaryEmbedding keeps
    cos, sin = cos_sin.chunk(2, dim=-1)
    expected = REFERENCE.rotary(query_and_key, cos, sin)
    rotated = kernels.rotary(query_and_key, cos, sin)
    assert rotated.data_ptr() == query_and_key.data_ptr()
    assert_matches(rotated, expected, min_equal=0.95)
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], value_before, atol=0, rtol=0)


def test_empty_batches() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    assert kernels.rms_norm(empty, weight, 1e-5, empty)[0].shape == (0, 64)
    assert kernels.silu_and_mul(empty).shape == (0, 32)
    cos = sin = empty[:, :32].view(0, 1, 32)
    assert kernels.rotary(empty.view(0, 1, 64), cos, sin).shape == (0, 1, 64)
