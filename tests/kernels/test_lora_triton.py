"""The Triton LoRA kernels against the torch reference: batches mixing adapters and tokens without one, merged
linears (the parts of one launch, and more parts than one launch adds), sizes that leave partial blocks, float16
and bfloat16 (summed in float32 where the reference rounds ``h`` to the dtype: within its tolerance), and adapters
narrower than the activations (``--lora-dtype``), which widen exactly as the reference widens them. On CPU they
run under the Triton interpreter (``conftest.py``): shapes are small.
"""

from __future__ import annotations

import numpy
import pytest
import torch
from tokenmill_kernels.lora import triton as kernels
from tokenmill_plugins.lora_kernels.triton_kernels import TritonLoRAKernels

from tests.kernels.tolerances import tolerance
from tokenmill.lora.kernels import TorchLoRAKernels
from tokenmill.model_loader import select_lora_kernels
from tokenmill.plugin_manager import Slot, load_plugins

assert torch.cuda.is_available() or kernels.is_interpreted(), "imported before TRITON_INTERPRET=1 was set"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REFERENCE = TorchLoRAKernels()


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def _case(
    tokens: int, in_features: int, part_sizes: tuple[int, ...], rank: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[int], torch.Tensor, numpy.ndarray]:
    """Inputs for 3 slots, scaled so that ``h`` and each product are of order 1, and slots with some -1s."""
    lora_a = _randn(3, len(part_sizes) * rank, in_features, dtype=dtype, seed=seed, scale=in_features**-0.5)
    lora_b = [_randn(3, rank, n, dtype=dtype, seed=seed + 1 + i, scale=rank**-0.5) for i, n in enumerate(part_sizes)]
    offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
    x = _randn(tokens, in_features, dtype=dtype, seed=seed + 10)
    y = _randn(tokens, sum(part_sizes), dtype=dtype, seed=seed + 11)
    token_slots = numpy.random.default_rng(seed).integers(-1, 3, size=tokens)
    token_slots[:2] = (-1, 2)  # one token without an adapter and the last slot, whatever the seed drew
    return x, lora_a, lora_b, offsets, y, token_slots


def _check(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: list[torch.Tensor],
    offsets: list[int],
    y: torch.Tensor,
    token_slots: numpy.ndarray,
) -> None:
    """Through the plugin against the reference; rows without an adapter left exactly as they were."""
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, y.device), x, lora_a, lora_b, offsets, expected)
    before = y.clone()
    triton_kernels = TritonLoRAKernels()
    triton_kernels.add_lora(triton_kernels.prepare(token_slots, y.device), x, lora_a, lora_b, offsets, y)
    torch.testing.assert_close(y, expected, **tolerance(y.dtype))
    untouched = torch.from_numpy(token_slots < 0).to(y.device)
    assert torch.equal(y[untouched], before[untouched])


@pytest.mark.parametrize(
    ("dtype", "in_features", "part_sizes", "rank"),
    [
        (torch.float32, 576, (576, 192, 192), 16),  # SmolLM2's qkv: three parts in one expand
        (torch.float32, 100, (33, 70), 5),  # partial blocks of inputs, outputs and ranks
        (torch.float32, 40, (8, 24, 16, 5), 4),  # four parts: two expand launches
        (torch.float16, 576, (576, 192, 192), 16),
        (torch.bfloat16, 576, (576, 192, 192), 16),
    ],
)
def test_matches_the_reference_over_mixed_adapters(
    dtype: torch.dtype, in_features: int, part_sizes: tuple[int, ...], rank: int
) -> None:
    _check(*_case(6, in_features, part_sizes, rank, dtype, seed=in_features + rank))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_adapters_on_a_row_view_of_x_and_a_wider_y(dtype: torch.dtype) -> None:
    """float16 and bfloat16 adapters (--lora-dtype) over float32 activations add what the reference adds in
    float32; x may be a slice of wider rows, and y may hold more columns than the parts."""
    x, lora_a, lora_b, offsets, _, token_slots = _case(5, 64, (16, 24), 4, dtype, seed=3)
    wide_x = torch.cat([x.float(), _randn(5, 7, dtype=torch.float32, seed=4)], dim=1)[:, :64]
    y = _randn(5, 50, dtype=torch.float32, seed=5)
    _check(wide_x, lora_a, lora_b, offsets, y, token_slots)
    assert torch.equal(y[:, 40:], _randn(5, 50, dtype=torch.float32, seed=5)[:, 40:])


def test_a_batch_without_adapters_and_an_empty_batch() -> None:
    x, lora_a, lora_b, offsets, y, _ = _case(4, 32, (8, 8), 4, torch.float32, seed=6)
    _check(x, lora_a, lora_b, offsets, y, numpy.full(4, -1))
    _check(x[:0], lora_a, lora_b, offsets, y[:0], numpy.full(0, -1))


def test_other_dtypes_go_to_the_reference() -> None:
    x, lora_a, lora_b, offsets, y, token_slots = _case(3, 32, (8, 8), 4, torch.float64, seed=7)
    expected = y.clone()
    REFERENCE.add_lora(REFERENCE.prepare(token_slots, y.device), x, lora_a, lora_b, offsets, expected)
    triton_kernels = TritonLoRAKernels()
    triton_kernels.add_lora(triton_kernels.prepare(token_slots, y.device), x, lora_a, lora_b, offsets, y)
    assert torch.equal(y, expected)


def test_registered_and_picked_by_auto_only_on_a_gpu() -> None:
    system = load_plugins(allowlist=["lora_kernels"])
    assert "triton" in system.registry.names(Slot.LORA_KERNEL)
    assert select_lora_kernels("auto", torch.device("cpu"), system).name != "triton"
    if torch.cuda.is_available():
        assert select_lora_kernels("auto", torch.device("cuda"), system).name == "triton"
