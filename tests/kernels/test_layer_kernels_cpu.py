"""The CPU layer kernels (C++, AVX2: RMSNorm with the residual add, rope) against the torch reference, float32."""

from __future__ import annotations

import pytest
import torch
from tokenmill_kernels.layer_kernels import cpu as kernels

from tests.cpu_machine import needs_cpu_kernels
from tokenmill.layers.kernels import TorchLayerKernels

pytestmark = needs_cpu_kernels
REFERENCE = TorchLayerKernels()


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows", [0, 1, 7, 100])  # 100 rows run on several threads
@pytest.mark.parametrize("hidden", [64, 576, 1000])  # 1000: a tail after the 16-wide loop
def test_rms_norm_with_and_without_the_residual(rows: int, hidden: int) -> None:
    x, residual, weight = _randn(rows, hidden, seed=0, scale=3.0), _randn(rows, hidden, seed=1), _randn(hidden, seed=2)
    x_before = x.clone()
    out, total = kernels.rms_norm(x, weight, 1e-5)
    assert total is None
    torch.testing.assert_close(out, REFERENCE.rms_norm(x, weight, 1e-5), atol=1e-5, rtol=1e-5)
    out, total = kernels.rms_norm(x, weight, 1e-6, residual)
    expected_out, expected_total = REFERENCE.add_rms_norm(x, residual, weight, 1e-6)
    assert total is not None
    torch.testing.assert_close(total, expected_total, atol=0, rtol=0)  # one float32 add, as torch's
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x, x_before, atol=0, rtol=0)


@pytest.mark.parametrize("rows", [0, 1, 7, 100])
@pytest.mark.parametrize("inner", [8, 1536, 1100])  # 1100: a tail after the 8-wide loop
def test_silu_and_mul_matches_torch(rows: int, inner: int) -> None:
    gate_up = _randn(rows, 2 * inner, seed=6, scale=4.0)
    gate_up[:, :4] = torch.tensor([-100.0, -20.0, 0.0, 100.0])[: min(4, inner)]  # saturated and exact cases
    before = gate_up.clone()
    out = kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(out, REFERENCE.silu_and_mul(gate_up), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gate_up, before, atol=0, rtol=0)


def test_silu_and_mul_of_a_row_view() -> None:
    """A slice of wider rows (stride beyond the width) is read in place; an odd width is a ValueError."""
    wide = _randn(3, 40, seed=7)
    view = wide[:, :16]
    torch.testing.assert_close(kernels.silu_and_mul(view), REFERENCE.silu_and_mul(view), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="even"):
        kernels.silu_and_mul(wide[:, :15])


def test_rms_norm_of_strided_heads_and_of_row_views() -> None:
    projection = _randn(5, 6, 32, seed=3)
    heads, weight = projection[:, :4], _randn(32, seed=4)  # q/k norms: a strided slice of the heads
    torch.testing.assert_close(kernels.rms_norm(heads, weight, 1e-6)[0], REFERENCE.rms_norm(heads, weight, 1e-6))
    wide = _randn(3, 2 * 576, seed=5)
    rows = wide[:, :576]  # rows with a stride of their own
    torch.testing.assert_close(
        kernels.rms_norm(rows, wide[0, 576:], 1e-5)[0], REFERENCE.rms_norm(rows, wide[0, 576:], 1e-5)
    )


@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("tokens", [1, 40])
def test_rotary_rotates_a_view_of_the_projection_in_place(head_dim: int, tokens: int) -> None:
    heads, kv_heads = 9, 3
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=6)
    values_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    query_and_key = qkv[:, : (heads + kv_heads) * head_dim].unflatten(-1, (heads + kv_heads, head_dim))
    angles = torch.rand(tokens, 1, head_dim // 2, generator=torch.Generator().manual_seed(7)) * 1000
    cos, sin = torch.cat([angles.cos(), angles.sin()], dim=-1).chunk(2, dim=-1)
    expected = REFERENCE.rotary(query_and_key, cos, sin)
    assert kernels.rotary(query_and_key, cos, sin) is query_and_key
    torch.testing.assert_close(query_and_key, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], values_before, atol=0, rtol=0)


def test_bad_inputs_are_value_errors() -> None:
    with pytest.raises(ValueError, match="float32 CPU matrix"):
        kernels.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="weight must be a contiguous float32 CPU vector of 8"):
        kernels.rms_norm(torch.zeros(2, 8), torch.zeros(9), 1e-5)
    with pytest.raises(ValueError, match="cos and sin must be float32"):
        kernels.rotary(torch.zeros(2, 3, 8), torch.zeros(2, 1, 3), torch.zeros(2, 1, 4))


def test_inputs_that_need_gradients_go_to_the_reference() -> None:
    """The C++ has no backward: a norm over an input that needs gradients still differentiates."""
    from tokenmill_plugins.layer_kernels.cpu_kernels import CpuLayerKernels

    x = _randn(3, 64, seed=8).requires_grad_()
    CpuLayerKernels().rms_norm(x, torch.ones(64), 1e-5).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
