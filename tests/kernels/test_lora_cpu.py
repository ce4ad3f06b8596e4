"""The CPU LoRA kernel (C++, AVX2) against the torch reference, float32: batches mixing adapters, merged linears,
tokens without an adapter, and the checks that refuse bad input."""

from __future__ import annotations

import numpy
import pytest
import torch
from tokenmill_kernels.lora import cpu as kernels
from tokenmill_plugins.lora_kernels.cpu_kernels import CpuLoRAKernels

from tests.cpu_machine import needs_cpu_kernels
from tokenmill.lora.kernels import TorchLoRAKernels

pytestmark = needs_cpu_kernels
REFERENCE = TorchLoRAKernels()


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _case(tokens: int, in_features: int, part_sizes: tuple[int, ...], slots: int, rank: int, seed: int):
    lora_a = _randn(slots, len(part_sizes) * rank, in_features, seed=seed) / in_features**0.5  # h of order 1
    lora_b = [_randn(slots, rank, size, seed=seed + 1 + i) for i, size in enumerate(part_sizes)]
    offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
    x = _randn(tokens, in_features, seed=seed + 10)
    y = _randn(tokens, sum(part_sizes), seed=seed + 11)
    token_slots = numpy.random.default_rng(seed).integers(-1, slots, size=tokens)
    return x, lora_a, lora_b, offsets, y, token_slots


@pytest.mark.parametrize("tokens", [0, 1, 5, 64])  # 64: blocks of 4 tokens of one adapter, on several threads
@pytest.mark.parametrize(
    ("in_features", "part_sizes", "rank"),
    [(576, (576, 192, 192), 16), (1536, (576,), 8), (100, (33, 70), 4)],  # qkv; down; tails after the 8-wide loops
)
def test_matches_the_reference_over_mixed_adapters(
    tokens: int, in_features: int, part_sizes: tuple[int, ...], rank: int
) -> None:
    x, lora_a, lora_b, offsets, y, token_slots = _case(tokens, in_features, part_sizes, 4, rank, seed=tokens)
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, expected)
    cpu = CpuLoRAKernels()
    cpu.add_lora(cpu.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, y)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)
    untouched = torch.from_numpy(token_slots < 0)
    assert torch.equal(y[untouched], expected[untouched])  # rows without an adapter are left exactly as they were


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9])  # 9: blocks of 4, 4 and 1 tokens of one adapter
def test_narrow_weights_widen_as_the_reference_does(tokens: int, dtype: torch.dtype) -> None:
    """float16 and bfloat16 adapters (--lora-dtype) add in float32, as the reference computes them."""
    x, lora_a, lora_b, offsets, y, _ = _case(tokens, 300, (64, 200), 2, 8, seed=8)
    lora_a, lora_b = lora_a.to(dtype), [b.to(dtype) for b in lora_b]
    token_slots = numpy.ones(tokens, dtype=numpy.int64)
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, expected)
    cpu = CpuLoRAKernels()
    cpu.add_lora(cpu.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, y)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_a_row_view_of_x_and_columns_of_a_wider_y() -> None:
    """x may be a slice of wider rows; y's rows may be longer than the parts (an output that holds more)."""
    x, lora_a, lora_b, offsets, _, token_slots = _case(6, 64, (16, 24), 3, 4, seed=3)
    wide_x = torch.cat([x, _randn(6, 7, seed=4)], dim=1)[:, :64]
    y = _randn(6, 50, seed=5)
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, expected)
    kernels.add_lora(wide_x, lora_a, lora_b, offsets, torch.from_numpy(token_slots), y)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[:, 40:], expected[:, 40:])


def test_bad_input_is_a_value_error() -> None:
    x, lora_a, lora_b, offsets, y, _ = _case(2, 32, (8,), 2, 4, seed=6)
    with pytest.raises(ValueError, match="uses slot 2 of 2"):
        kernels.add_lora(x, lora_a, lora_b, offsets, torch.tensor([0, 2]), y)
    with pytest.raises(ValueError, match="reach column 9, past y's 8 columns"):
        kernels.add_lora(x, lora_a, lora_b, [1], torch.tensor([0, 1]), y)
    with pytest.raises(ValueError, match="lora_a"):
        kernels.add_lora(x, lora_a.double(), lora_b, offsets, torch.tensor([0, 1]), y)
    with pytest.raises(ValueError, match="like lora_a"):
        kernels.add_lora(x, lora_a.half(), lora_b, offsets, torch.tensor([0, 1]), y)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("part_sizes", "rank"), [((576, 192, 192), 16), ((40, 24), 5)])  # 5: unequal rank shares
def test_bound_linear_at_one_token_on_any_number_of_threads(
    threads: int, part_sizes: tuple[int, ...], rank: int
) -> None:
    """What an engine step runs: the batch prepared once, each linear's ``bind`` called once, then ``add(batch, x,
    y)``. One token splits across the threads: each shrinks a share of the rank, and adds the whole rank's product
    to a share of the columns."""
    x, lora_a, lora_b, offsets, _, _ = _case(1, 96, part_sizes, 3, rank, seed=12)
    y = _randn(1, sum(part_sizes) + 3, seed=13)  # columns past the parts stay as they are
    token_slots = numpy.array([2])
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, expected)
    cpu = CpuLoRAKernels()
    add = cpu.bind(lora_a, lora_b, offsets)
    batch = cpu.prepare(token_slots, x.device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        add(batch, x, y)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[:, sum(part_sizes) :], expected[:, sum(part_sizes) :])


@pytest.mark.parametrize(("shares", "rank"), [(2, 16), (3, 5)])
def test_shares_that_run_before_the_others_compute_their_rows(shares: int, rank: int) -> None:
    """A share that finds another's rows of the rank not yet published computes them itself, by the same code: run
    one after another on one thread, the shares give what they give on as many threads, bit for bit."""
    x, lora_a, lora_b, offsets, _, _ = _case(1, 96, (576, 192, 192), 3, rank, seed=15)
    y = _randn(1, 960, seed=16)
    weights = kernels.weights(lora_a, lora_b, offsets)
    plan = kernels.plan(torch.tensor([1]))
    in_parallel, in_turn = y.clone(), y.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(shares)
    try:
        weights.add(plan, x, in_parallel)
    finally:
        torch.set_num_threads(before)
    weights.add_in_shares(plan, x, in_turn, shares)
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(numpy.array([1]), x.device), x, lora_a, lora_b, offsets, expected)
    torch.testing.assert_close(in_turn, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(in_turn, in_parallel)
    with pytest.raises(ValueError, match="one token with an adapter, and shares > 1"):
        weights.add_in_shares(plan, x, in_turn, 1)


def test_bound_linear_refuses_what_does_not_fit() -> None:
    x, lora_a, lora_b, offsets, y, _ = _case(2, 32, (8,), 2, 4, seed=14)
    weights = kernels.weights(lora_a, lora_b, offsets)
    with pytest.raises(ValueError, match="x has 2 rows, the plan 3 tokens"):
        weights.add(kernels.plan(torch.tensor([0, 1, 1])), x, y)
    with pytest.raises(ValueError, match="uses slot 2 of 2"):
        weights.add(kernels.plan(torch.tensor([0, 2])), x, y)
    with pytest.raises(ValueError, match=r"x must be a float32 CPU \[tokens, 32\]"):
        weights.add(kernels.plan(torch.tensor([0, 1])), x[:, :16], y)
    with pytest.raises(ValueError, match="uses slot -2"):
        kernels.plan(torch.tensor([0, -2]))


def test_other_dtypes_go_to_the_reference() -> None:
    x, lora_a, lora_b, offsets, y, token_slots = _case(3, 32, (8, 8), 2, 4, seed=7)
    lora_a, lora_b, x, y = lora_a.double(), [b.double() for b in lora_b], x.double(), y.double()
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, expected)
    cpu = CpuLoRAKernels()
    cpu.add_lora(cpu.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, y)
    assert torch.equal(y, expected)
    cpu.bind(lora_a, lora_b, offsets)(cpu.prepare(token_slots, x.device), x, y)  # float64 weights: the reference's
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, x.device), x, lora_a, lora_b, offsets, expected)
    assert torch.equal(y, expected)
