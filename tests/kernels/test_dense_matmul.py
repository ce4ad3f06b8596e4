"""Dense float32 matmul kernels (``tokenmill_kernels.dense_matmul``) against ``F.linear``.

Tolerance: both sides sum K float32 products, in different orders (the kernels in blocks of 64 k with fused
multiply-adds, MKL in its own blocks), so each output may differ by a few roundings of 2**-24 of the sum of its
terms' magnitudes. The bound ``RTOL`` is applied to that sum (``|x| @ |W|.T + |bias|``): 1e-5 is 100x what K = 5000
float32 roundings could reach on average, while one wrong weight (a panel offset, a missed tail column) moves an
output by ~1/K of it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tokenmill_kernels.dense_matmul import cpu

from tests.cpu_machine import needs_cpu_kernels

RTOL = 1e-5

pytestmark = needs_cpu_kernels

# Rows: one decode step; the avx2 (3) and avx512 (12) tile sizes and one past them; a row block's worth at K=5000.
M_VALUES = (0, 1, 2, 3, 4, 5, 12, 13, 25, 60)
# (N, K): a tail panel alone; one full panel plus a tail; the default model's shapes; K over one k chunk (2048).
SHAPES = ((1, 3), (45, 96), (960, 576), (576, 1536), (33, 5000))


@pytest.fixture(params=["avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> object:
    if request.param not in cpu.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa("auto")


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = cpu.linear(x, cpu.pack(weight), weight.shape[0], bias)
    expected = F.linear(x, weight, bias)
    magnitude = F.linear(x.abs(), weight.abs(), None if bias is None else bias.abs())
    assert out.shape == expected.shape
    assert bool(((out - expected).abs() <= RTOL * magnitude + 1e-30).all()), (out - expected).abs().max()
    return out


@pytest.mark.parametrize("num_rows", M_VALUES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_f_linear(isa: str, num_rows: int, shape: tuple[int, int]) -> None:
    n, k = shape
    generator = torch.Generator().manual_seed(n * 7919 + k * 31 + num_rows)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(num_rows, k, generator=generator)
    _check(x, weight, None)
    _check(x, weight, torch.randn(n, generator=generator))


def test_variants_give_identical_outputs() -> None:
    """Both sum each output in the same order, so switching variant never changes a token."""
    if cpu.supported_isas() != ["avx2", "avx512"]:
        pytest.skip("this CPU has no avx512")
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(45, 5000, generator=generator), torch.randn(45, generator=generator)
    packed, x = cpu.pack(weight), torch.randn(25, 5000, generator=generator)
    outputs = []
    for name in ("avx2", "avx512"):
        cpu.set_isa(name)
        outputs.append(cpu.linear(x, packed, 45, bias))
    cpu.set_isa("auto")
    assert torch.equal(outputs[0], outputs[1])


def test_sums_stay_near_float64(isa: str) -> None:
    """Summing in blocks keeps rounding near MKL's: the mean error against float64, relative to the terms'
    magnitudes, measured 5.4e-9 (F.linear's 6.0e-9); one running sum over K, as the kernels did, measured 2.0e-8
    and fails."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(256, 1536, generator=generator), torch.randn(8, 1536, generator=generator)
    out = cpu.linear(x, cpu.pack(weight), 256)
    exact = F.linear(x.double(), weight.double())
    magnitude = F.linear(x.abs().double(), weight.abs().double())
    assert ((out - exact).abs() / magnitude).mean().item() < 1e-8


def test_layout_is_panels_of_32_outputs() -> None:
    weight = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    packed = cpu.pack(weight)
    assert packed.shape == (2, 3, cpu.PANEL)
    assert torch.equal(packed[0], weight[:32].T)
    assert torch.equal(packed[1, :, :8], weight[32:].T)
    assert not packed[1, :, 8:].any()  # zero past N


def test_non_contiguous_weight_packs() -> None:
    weight = torch.randn(96, 64).T  # [64, 96], a transposed view
    x = torch.randn(3, 96)
    _check(x, weight, None)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: cpu.linear(torch.randn(2, 64, dtype=torch.float64), p, 40), "x must be a contiguous 2-D float32"),
        (lambda p: cpu.linear(torch.randn(64, 2).T, p, 40), "x must be a contiguous 2-D float32"),
        (lambda p: cpu.linear(torch.randn(2, 63), p, 40), r"packed must be pack\(weight\)"),
        (lambda p: cpu.linear(torch.randn(2, 64), p, 65), r"packed must be pack\(weight\)"),
        (lambda p: cpu.linear(torch.randn(2, 64), p, 40, torch.randn(41)), "bias must be"),
        (lambda p: cpu.pack(torch.randn(4, 4, 4)), "weight must be a 2-D float32"),
    ],
)
def test_bad_inputs_are_value_errors(call: object, message: str) -> None:
    packed = cpu.pack(torch.randn(40, 64))
    with pytest.raises(ValueError, match=message):
        call(packed)  # type: ignore[operator]


def test_unknown_isa_is_a_value_error() -> None:
    with pytest.raises(ValueError, match='isa must be "auto" or one this CPU supports'):
        cpu.set_isa("sse2")
