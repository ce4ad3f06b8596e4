"""``check_sampler`` and ``check_logits_processor``: the sampler slot against ``TorchSampler``, and a
logits processor against the ``LogitsProcessor`` contract."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow
from tokenmill.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata, TorchSampler
from tokenmill.sampling_params import SamplingParams
from tokenmill.testing.conformance._util import conformance_check, fail, instantiate

_GREEDY = SamplingParams(temperature=0)
_DEFAULTS = SamplingParams()


class _BanTokens(LogitsProcessor):
    """Bans fixed token ids for every row it is active on: shows whether a sampler runs processors."""

    name = "conformance-ban"

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def is_active(self, row: SamplingRow) -> bool:
        return True

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        for row in rows:
            logits[row, self.token_ids] = float("-inf")
        return logits


def _rows(params: Sequence[SamplingParams], histories: Sequence[list[int]]) -> list[SamplingRow]:
    return [
        SamplingRow(f"row{i}", p, prompt_token_ids=[1, 2, 3], output_token_ids=history, eos_token_ids=(0,))
        for i, (p, history) in enumerate(zip(params, histories, strict=True))
    ]


def _metadata(
    params: Sequence[SamplingParams],
    vocab_size: int,
    device: str,
    histories: Sequence[list[int]] | None = None,
    processors: Sequence[LogitsProcessor] = (),
) -> SamplingMetadata:
    """What the engine would build for these rows: each seeded row gets a generator seeded with its seed."""
    histories = histories or [[] for _ in params]
    generators = [None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed) for p in params]
    return SamplingMetadata.from_requests(
        _rows(params, histories), generators, vocab_size, torch.device(device), logits_processors=processors
    )


def _sample(
    sampler: Sampler,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    device: str,
    what: str,
    histories: Sequence[list[int]] | None = None,
    processors: Sequence[LogitsProcessor] = (),
) -> SamplerOutput:
    original = logits.clone()
    output = sampler(logits, _metadata(params, logits.shape[1], device, histories, processors))
    name = type(sampler).__name__
    if not torch.equal(logits, original):
        fail(f"{name} changed the logits it was given ({what})")
    token_ids = output.token_ids
    if tuple(token_ids.shape) != (len(params),) or token_ids.dtype != torch.int64:
        fail(f"{name} returned token_ids {tuple(token_ids.shape)} {token_ids.dtype}, expected ({len(params)},) "
             f"int64 ({what})")  # fmt: skip
    if bool(((token_ids < 0) | (token_ids >= logits.shape[1])).any()):
        fail(f"{name} returned a token id outside the vocabulary: {token_ids.tolist()} ({what})")
    return output


@conformance_check
def check_sampler(
    sampler: type[Sampler] | Sampler, *, vocab_size: int = 32, device: str = "cpu", seed: int = 0
) -> None:
    """Check a sampler against ``TorchSampler`` and the ``Sampler`` contract.

    Greedy rows, and sampled rows narrowed to one token (``top_k=1``, ``min_p=1``, tiny ``top_p``), give
    the argmax of the processed logits, equal to ``TorchSampler``'s, with penalties and with a logits
    processor in the metadata. A seeded row draws the same token twice and whatever else is in the batch;
    a token with logit -inf is never drawn; sampling with a temperature follows ``softmax(logits / T)``
    (total variation below 0.06 over 4,000 draws); logprobs, when asked, are those of the raw logits, equal
    to ``TorchSampler``'s. The logits given are never changed. A sampler that sets ``verifies_drafts`` gives
    distributions from ``target_probs``, one-hot on its own token for greedy rows.

    :param sampler: the class (built with no arguments, as the engine builds it) or an instance.
    :raises AssertionError: naming the case and what differs.
    """
    candidate = instantiate(sampler)
    reference = TorchSampler()
    name = type(candidate).__name__
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(6, vocab_size, generator=generator) * 3).to(device)  # [6, vocab_size]

    narrow = [_GREEDY, SamplingParams(top_k=1), SamplingParams(min_p=1.0), SamplingParams(top_p=1e-6),
              SamplingParams(temperature=0.5, top_k=1, seed=7), _GREEDY]  # fmt: skip
    penalised = [SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)]
    cases: list[tuple[str, list[SamplingParams], list[list[int]] | None, list[LogitsProcessor]]] = [
        ("greedy and one-token rows", narrow, None, []),
        ("penalties", penalised * 6, [[int(t)] * 2 for t in logits.argmax(-1).tolist()], []),
        ("a logits processor", narrow, None, [_BanTokens(sorted(set(logits.argmax(-1).tolist())))]),
    ]
    for what, params, histories, processors in cases:
        got = _sample(candidate, logits, params, device, what, histories, processors).token_ids
        expected = reference(logits, _metadata(params, vocab_size, device, histories, processors)).token_ids
        if not torch.equal(got.cpu(), expected.cpu()):
            fail(f"{name} picked {got.tolist()} where TorchSampler picks {expected.tolist()} ({what}; these rows "
                 "must take the argmax of the logits after processors and penalties)")  # fmt: skip

    # Nearly flat rows, so that draws from anything but each row's own generator differ almost surely.
    flat = (torch.randn(8, vocab_size, generator=generator) * 0.1).to(device)  # [8, vocab_size]
    seeded = [SamplingParams(temperature=1.0, seed=11 + row) for row in range(8)]
    first = _sample(candidate, flat, seeded, device, "seeded rows").token_ids
    again = _sample(candidate, flat, seeded, device, "seeded rows").token_ids
    # The same rows, in another order, between a greedy and an unseeded row.
    order = [3, 0, 7, 1, 6, 2, 5, 4]
    batch = torch.cat([logits[:1], flat[order], logits[1:2]])
    params = [_GREEDY, *(seeded[row] for row in order), SamplingParams()]
    in_batch = _sample(candidate, batch, params, device, "seeded rows in another batch").token_ids[1:-1]
    reordered = [0] * 8
    for position, row in enumerate(order):
        reordered[row] = int(in_batch[position])
    if not torch.equal(first, again) or reordered != first.tolist():
        fail(f"{name}: seeded rows drew {first.tolist()}, then {again.tolist()}, then {reordered} in another "
             "batch; a request's seed must give the same tokens whatever else is in the batch")  # fmt: skip

    masked = logits.clone()
    masked[:, ::2] = float("-inf")
    drawn = _sample(candidate, masked, [SamplingParams(temperature=2.0)] * 6, device, "masked tokens").token_ids
    if bool((drawn % 2 == 0).any()):
        fail(f"{name} drew a token whose logit is -inf: {drawn.tolist()}")

    _check_distribution(candidate, logits[0], device)
    if type(candidate).verifies_drafts:
        _check_target_probs(candidate, logits, device)

    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(logprobs=0, seed=3), _GREEDY]
    processors = [_BanTokens([int(logits[0].argmax())])]  # logprobs must come from the raw logits
    got_output = _sample(candidate, logits[:3], params, device, "logprobs", processors=processors)
    expected_output = reference(logits[:3], _metadata(params, vocab_size, device, processors=processors))
    for field in ("logprobs", "top_token_ids", "top_logprobs"):
        got_value, expected_value = getattr(got_output, field), getattr(expected_output, field)
        if got_value is None or tuple(got_value.shape) != tuple(expected_value.shape):
            fail(f"{name} returned {field}={None if got_value is None else tuple(got_value.shape)}, expected "
                 f"shape {tuple(expected_value.shape)} when a row asks for logprobs")  # fmt: skip
    raw = logits[:3].float().log_softmax(-1)
    chosen = raw.gather(-1, got_output.token_ids[:, None]).squeeze(-1)
    if not torch.allclose(got_output.logprobs.cpu(), chosen.cpu(), atol=1e-5):  # type: ignore[union-attr]
        fail(f"{name}: logprobs are not the raw log-softmax of the sampled tokens (before processors)")
    if not torch.equal(got_output.top_token_ids[0].cpu(), expected_output.top_token_ids[0].cpu()):  # type: ignore[index]
        fail(f"{name}: top_token_ids are not the most likely raw tokens, most likely first")


def _check_target_probs(candidate: Sampler, logits: torch.Tensor, device: str) -> None:
    """A sampler that verifies drafts gives distributions: rows of non-negative numbers summing to 1, one-hot on
    the token ``__call__`` picks for a greedy row."""
    params = [_GREEDY, SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=4), _GREEDY]
    metadata = _metadata(params, logits.shape[-1], device)
    name = type(candidate).__name__
    try:
        probs = candidate.target_probs(logits[:4], metadata).cpu()  # [4, vocab_size]
    except NotImplementedError:
        fail(f"{name} sets verifies_drafts but does not implement target_probs")
    greedy = candidate(logits[:4], _metadata(params, logits.shape[-1], device)).token_ids.cpu()
    if bool((probs < 0).any()) or not torch.allclose(probs.sum(-1), torch.ones(4), atol=1e-4):
        fail(f"{name}.target_probs rows are not distributions (sums {probs.sum(-1).tolist()})")
    for row in (0, 3):
        if probs[row, greedy[row]] != 1.0:
            fail(f"{name}.target_probs is not one-hot on the greedy token {int(greedy[row])} for a greedy row")


def _check_distribution(candidate: Sampler, row_logits: torch.Tensor, device: str) -> None:
    num_draws, temperature = 4000, 0.7
    logits = row_logits[:8].repeat(num_draws, 1)  # [num_draws, 8]
    # Each draw seeded by its own row, so a correct sampler gives the same frequencies on every run.
    params = [SamplingParams(temperature=temperature, seed=seed) for seed in range(num_draws)]
    drawn = _sample(candidate, logits, params, device, "temperature")
    counts = torch.bincount(drawn.token_ids.cpu(), minlength=8).double() / num_draws
    expected = (row_logits[:8].double().cpu() / temperature).softmax(-1)
    distance = 0.5 * (counts - expected).abs().sum().item()
    if distance > 0.06:
        observed, wanted = [round(p, 3) for p in counts.tolist()], [round(p, 3) for p in expected.tolist()]
        fail(f"{type(candidate).__name__} does not sample from softmax(logits / temperature): total variation "
             f"{distance:.3f} over {num_draws} draws (frequencies {observed}, expected {wanted})")  # fmt: skip


@conformance_check
def check_logits_processor(
    processor: type[LogitsProcessor] | LogitsProcessor,
    params_that_activate: SamplingParams,
    *,
    inactive_params: SamplingParams | None = _DEFAULTS,
    vocab_size: int = 64,
    eos_token_ids: tuple[int, ...] = (0,),
    device: str = "cpu",
    seed: int = 0,
) -> None:
    """Check a logits processor against the ``LogitsProcessor`` contract.

    ``is_active`` is true for a row with ``params_that_activate`` and false for one with
    ``inactive_params`` (None: the processor applies to every row, e.g. from its options). ``apply``, given
    some rows of a [6, vocab_size] float32 batch, returns a [6, vocab_size] float32 tensor where every other
    row is untouched, changes at least one of its rows, leaves a finite logit in each, gives the same result
    twice, and changes none of the token lists it reads.

    :param processor: the class (built with no arguments) or an instance (a plugin's, with its options).
    :raises AssertionError: naming the case and what differs.
    """
    candidate = instantiate(processor)
    name = type(candidate).__name__
    prompt, output = [5, 6, 7, 8], [9, 10]
    active = SamplingRow("active", params_that_activate, prompt, output, eos_token_ids)
    if not candidate.is_active(active):
        fail(f"{name}.is_active is false for a row with {params_that_activate!r}")
    if inactive_params is not None:
        inactive = SamplingRow("inactive", inactive_params, prompt, output, eos_token_ids)
        if candidate.is_active(inactive):
            fail(f"{name}.is_active is true for a row with {inactive_params!r}; pass inactive_params=None if the "
                 "processor applies to every request")  # fmt: skip

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab_size, generator=generator).to(device)  # [6, vocab_size]
    rows = [1, 3, 4]  # not the first, not contiguous, not the last
    states = [SamplingRow(f"r{row}", params_that_activate, list(prompt), list(output), eos_token_ids) for row in rows]
    snapshot = [(list(s.prompt_token_ids), list(s.output_token_ids)) for s in states]
    results = [candidate.apply(logits.clone(), list(rows), list(states)) for _ in range(2)]
    got = results[0]
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(logits.shape) or got.dtype != torch.float32:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        fail(f"{name}.apply returned {shape}, expected a {tuple(logits.shape)} float32 tensor")
    if snapshot != [(list(s.prompt_token_ids), list(s.output_token_ids)) for s in states]:
        fail(f"{name}.apply changed a row's prompt_token_ids or output_token_ids; they are read-only")
    untouched = [row for row in range(logits.shape[0]) if row not in rows]
    changed = [row for row in untouched if not torch.equal(got[row], logits[row])]
    if changed:
        fail(f"{name}.apply changed rows {changed}, which were not in rows={rows}")
    if all(torch.equal(got[row], logits[row]) for row in rows):
        fail(f"{name}.apply changed none of rows {rows} with {params_that_activate!r}; give params that activate it")
    if not all(bool(torch.isfinite(got[row]).any()) for row in rows):
        fail(f"{name}.apply left a row without any finite logit: nothing could be sampled")
    if not torch.equal(results[1], got):
        fail(f"{name}.apply is not deterministic: the same inputs gave different logits")
