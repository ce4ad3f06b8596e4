"""``check_lora_kernels``: LoRA kernels against the torch reference (``TorchLoRAKernels``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy
import torch

from tokenmill.lora.kernels import LoRABatch, LoRAKernels, TorchLoRAKernels
from tokenmill.testing.conformance._util import calling, conformance_check, fail, instantiate

#: Per dtype of the activations: (atol, rtol), ``rtol`` of the sum of the terms' magnitudes (``|y|`` plus the
#: product of ``|x|``, ``|A|`` and ``|B|``). In float32 only the order of the sums differs from the reference
#: (narrower adapters widen exactly); in float16 and bfloat16 the reference also rounds ``h``, each product and
#: the sum to the dtype, which a kernel summing in float32 does only at the end: a few units of roundoff.
LORA_KERNEL_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-5, 2e-3),
    torch.bfloat16: (1e-4, 2e-2),
}

_NUM_SLOTS = 4
#: The adapted linears of one step: (in_features, part sizes, rank). One part (o_proj, down_proj), two (gate_up)
#: with sizes that leave partial blocks, three (qkv), and four (the interface takes any number).
_LINEARS: tuple[tuple[int, tuple[int, ...], int], ...] = (
    (64, (64,), 8),
    (100, (33, 70), 4),
    (96, (96, 32, 32), 16),
    (40, (8, 24, 16, 5), 4),
)
#: Columns of ``y`` past the last part (an output that holds more than the adapted parts): never written.
_EXTRA_COLUMNS = 3


@conformance_check
def check_lora_kernels(
    kernels: type[LoRAKernels] | LoRAKernels,
    *,
    device: str = "cpu",
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    adapter_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16),
    num_tokens: tuple[int, ...] = (1, 7, 0),
    seed: int = 0,
) -> None:
    """Check ``prepare``, ``add_lora`` and ``bind`` against ``TorchLoRAKernels``, as an engine step calls them:
    one ``prepare`` per batch, then per adapted linear, with that batch, ``add_lora`` or the function ``bind``
    returned for it.

    For each dtype of the activations (``dtypes``), each dtype of the adapters' weights (``adapter_dtypes``:
    ``--lora-dtype`` may make them narrower, or wider, than the activations) and each number of tokens, batches
    of 4 slots whose tokens mix slots and -1 (no adapter), use one slot for every token, and use none; over
    linears of one, two, three and four parts (ranks 4 to 16, one slot's adapter of a lower rank zero-padded),
    ``x`` a view of wider rows for every other linear, and ``y`` 3 columns wider than its parts:

    - ``prepare`` returns a ``LoRABatch`` of the batch's number of tokens;
    - ``add_lora``, and the function ``bind`` returns for a linear's slot tensors (bound while they are still
      zeros, then filled in place, as slots are), each give ``y`` within ``LORA_KERNEL_TOLERANCES`` of the
      reference, leave the rows of tokens without an adapter and the columns past the parts bit-identical to
      what they were, and leave ``x``, ``lora_a`` and ``lora_b`` unchanged.

    :param kernels: the class (built with no arguments, as the engine builds it) or an instance.
    :param dtypes: the activations' dtypes to check (``y`` has the same); float32 is what a CPU model adds in.
    :raises AssertionError: naming the case and what differs.
    """
    candidate = instantiate(kernels)
    reference = TorchLoRAKernels()
    name = type(candidate).__name__
    generator = torch.Generator().manual_seed(seed)
    rng = numpy.random.default_rng(seed)
    on = torch.device(device)

    def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(on, dtype)

    for dtype, adapter_dtype, tokens in itertools.product(dtypes, adapter_dtypes, num_tokens):
        weights = []
        for in_features, part_sizes, rank in _LINEARS:
            lora_a = randn(
                _NUM_SLOTS, len(part_sizes) * rank, in_features, dtype=adapter_dtype, scale=in_features**-0.5
            )
            lora_b = [randn(_NUM_SLOTS, rank, size, dtype=adapter_dtype, scale=rank**-0.5) for size in part_sizes]
            for part in range(len(part_sizes)):  # slot 3 holds an adapter of half the rank, zero-padded
                lora_a[3, part * rank + rank // 2 : (part + 1) * rank] = 0
                lora_b[part][3, rank // 2 :] = 0
            weights.append((lora_a, lora_b))
        mixed = rng.integers(-1, _NUM_SLOTS, size=tokens)
        mixed[:3] = (-1, _NUM_SLOTS - 1, 0)[:tokens]  # whatever the draw: no adapter, the last slot, the first
        one, none = numpy.full(tokens, 2, dtype=numpy.int64), numpy.full(tokens, -1, dtype=numpy.int64)
        batches = {"mixed slots": mixed, "one slot": one, "no adapter": none}
        for batch_name, token_slots in batches.items():
            where = f"(x {dtype}, adapters {adapter_dtype}, {tokens} tokens, {batch_name}: {token_slots.tolist()})"
            with calling(f"{name}.prepare{where}"):
                batch = candidate.prepare(token_slots, on)
            if not isinstance(batch, LoRABatch) or batch.num_tokens != tokens:
                fail(f"{name}.prepare{where}: returned {batch!r}, expected a LoRABatch of {tokens} tokens")
            expected_batch = reference.prepare(token_slots, on)
            for index, ((in_features, part_sizes, _), (lora_a, lora_b)) in enumerate(
                zip(_LINEARS, weights, strict=True)
            ):
                x = randn(tokens, in_features + 5 * (index % 2), dtype=dtype)[:, :in_features]
                y = randn(tokens, sum(part_sizes) + _EXTRA_COLUMNS, dtype=dtype)
                offsets = [sum(part_sizes[:part]) for part in range(len(part_sizes))]
                for how in ("add_lora", "bind"):
                    case = f"{name}.{how}{where} on a linear of {in_features} -> {part_sizes}"
                    _check_linear(candidate, reference, case, (batch, expected_batch), token_slots,
                                  x, lora_a, lora_b, offsets, y.clone(), bound=how == "bind")  # fmt: skip


def _check_linear(
    candidate: LoRAKernels,
    reference: LoRAKernels,
    case: str,
    batches: tuple[LoRABatch, LoRABatch],
    token_slots: numpy.ndarray,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: Sequence[torch.Tensor],
    offsets: list[int],
    y: torch.Tensor,
    *,
    bound: bool,
) -> None:
    """``bound``: through ``candidate.bind(lora_a, lora_b, offsets)`` (bound on a copy that the call writes to in
    place first, as a slot load does), else ``candidate.add_lora``."""
    batch, expected_batch = batches  # the candidate's prepare, the reference's
    inputs = (x.clone(), lora_a.clone(), [b.clone() for b in lora_b])
    expected = y.clone()
    reference.add_lora(expected_batch, x, lora_a, lora_b, offsets, expected)
    before = y.clone()
    with calling(case):
        if bound:
            slots_a, slots_b = torch.zeros_like(lora_a), [torch.zeros_like(b) for b in lora_b]
            add = candidate.bind(slots_a, slots_b, offsets)
            slots_a.copy_(lora_a)
            for slot_b, b in zip(slots_b, lora_b, strict=True):
                slot_b.copy_(b)
            add(batch, x, y)
        else:
            candidate.add_lora(batch, x, lora_a, lora_b, offsets, y)
    without = torch.from_numpy(token_slots < 0).to(y.device)
    if not torch.equal(y[without], before[without]):
        fail(f"{case}: changed the rows of tokens without an adapter (slot -1); they must stay bit-identical")
    width = sum(b.shape[2] for b in lora_b)
    if not torch.equal(y[:, width:], before[:, width:]):
        fail(f"{case}: changed y's columns past the adapted parts ({width} onwards)")
    # The sum of the terms' magnitudes, through the reference in float32: where y and the product cancel, or the
    # terms of a dot product do, a rounding of one term is larger than the result.
    magnitude = before.abs().float()
    reference.add_lora(expected_batch, x.abs().float(), lora_a.abs().float(), [b.abs().float() for b in lora_b],
                       offsets, magnitude)  # fmt: skip
    atol, rtol = LORA_KERNEL_TOLERANCES[expected.dtype]
    error = (y.float() - expected.float()).abs()
    if not bool((error <= atol + rtol * magnitude).all()):
        worst = (error / (atol + rtol * magnitude)).amax(dim=1)
        rows = (worst > 1).nonzero().flatten().tolist()
        slots = [int(token_slots[row]) for row in rows[:8]]
        fail(f"{case}: differs from the torch reference by up to {error.max().item():.3g} (atol {atol}, rtol "
             f"{rtol} of the terms' magnitudes), in rows {rows[:8]} of slots {slots}")  # fmt: skip
    x_before, lora_a_before, lora_b_before = inputs
    if not (torch.equal(x, x_before) and torch.equal(lora_a, lora_a_before)
            and all(torch.equal(b, b0) for b, b0 in zip(lora_b, lora_b_before, strict=True))):  # fmt: skip
        fail(f"{case}: modified x, lora_a or lora_b")
