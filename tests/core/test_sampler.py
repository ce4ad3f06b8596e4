"""Sampler: greedy, seeded reproducibility across batches, truncation sets, distribution, penalties, bans, logprobs."""

from __future__ import annotations

import dataclasses
from collections import Counter

import msgspec
import pytest
import torch

from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow
from tokenmill.sampling.sampler import SamplingMetadata, TorchSampler
from tokenmill.sampling_params import SamplingParams

VOCAB = 32
CPU = torch.device("cpu")


class _BanProcessor(LogitsProcessor):
    """Bans, per row, the ids given as that row's ``eos_token_ids``: how these tests ban tokens."""

    name = "ban"

    def is_active(self, row: SamplingRow) -> bool:
        return bool(row.eos_token_ids)

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        for row, state in zip(rows, states, strict=True):
            logits[row, list(state.eos_token_ids)] = float("-inf")
        return logits


def _metadata(
    params: list[SamplingParams],
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    banned: list[list[int]] | None = None,
    vocab_size: int = VOCAB,
) -> SamplingMetadata:
    empty: list[list[int]] = [[] for _ in params]
    rows = [
        SamplingRow(str(i), p, (prompts or empty)[i], (outputs or empty)[i], tuple((banned or empty)[i]))
        for i, p in enumerate(params)
    ]
    return SamplingMetadata.from_requests(
        rows, generators or [None] * len(params), vocab_size, CPU, logits_processors=[_BanProcessor()]
    )


def _reference_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """HF/vLLM penalties, one row and one token at a time."""
    result = logits.clone()
    for row, p in enumerate(params):
        for token_id in set(prompts[row]) | set(outputs[row]):
            value = result[row, token_id]
            result[row, token_id] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token_id, count in Counter(outputs[row]).items():
            result[row, token_id] -= p.frequency_penalty * count
            result[row, token_id] -= p.presence_penalty
    return result


def _random_histories(num_reqs: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts over the whole vocab, outputs over ids 0..9 so they repeat; some empty."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, VOCAB, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_reqs)
    ]
    outputs = [
        torch.randint(0, 10, (int(torch.randint(0, 16, (1,), generator=g)),), generator=g).tolist()
        for _ in range(num_reqs)
    ]
    return prompts, outputs


def test_greedy_rows_are_the_argmax_of_penalised_logits() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, VOCAB, generator=g) * 3
    prompts, outputs = _random_histories(8, seed=1)
    # Put each row's raw favourite in its output, so penalties change some greedy answers.
    outputs = [history + [int(logits[row].argmax())] * 3 for row, history in enumerate(outputs)]
    params = [
        SamplingParams(
            temperature=0.0 if row % 2 == 0 else 1.0,
            top_k=3,
            repetition_penalty=1.0 + 0.2 * row,
            presence_penalty=0.5,
            frequency_penalty=0.3 * (row % 3),
        )
        for row in range(8)
    ]
    metadata = _metadata(params, prompts=prompts, outputs=outputs)
    expected = _reference_penalties(logits, params, prompts, outputs).argmax(dim=-1)
    assert not torch.equal(expected[0::2], logits[0::2].argmax(dim=-1))  # the penalties matter here
    for seed in range(5):
        token_ids = TorchSampler(torch.Generator().manual_seed(seed))(logits, metadata).token_ids
        assert torch.equal(token_ids[0::2], expected[0::2])


def test_greedy_rows_take_the_first_of_tied_logits_as_argmax_does() -> None:
    # Whole-number logits tie often; a NaN counts as the largest value, and a row of -inf takes index 0.
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-2, 3, (64, 4096), generator=g).float()
    logits[3, 100] = logits[3, 7] = float("nan")
    logits[4] = float("-inf")
    logits[5, [9, 4000]] = float("inf")
    metadata = _metadata([SamplingParams(temperature=0.0)] * 64, vocab_size=4096)
    token_ids = TorchSampler()(logits, metadata).token_ids
    assert token_ids[3] == 7 and token_ids[4] == 0 and token_ids[5] == 9
    assert torch.equal(token_ids, logits.argmax(dim=-1))


def test_greedy_rows_consume_no_randomness() -> None:
    g = torch.Generator().manual_seed(1)
    random_params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=10)]
    seeded_greedy = torch.Generator().manual_seed(5)
    state_before = seeded_greedy.get_state()
    alone_generator, mixed_generator = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    alone, mixed = TorchSampler(alone_generator), TorchSampler(mixed_generator)
    mixed_params = [
        SamplingParams(temperature=0.0, seed=5),
        random_params[0],
        SamplingParams(temperature=0.0),
        random_params[1],
    ]
    alone_tokens: list[list[int]] = []
    mixed_tokens: list[list[int]] = []
    for _ in range(10):
        logits = torch.randn(2, VOCAB, generator=g)
        alone_tokens.append(alone(logits, _metadata(random_params)).token_ids.tolist())
        mixed_logits = torch.stack(
            [torch.randn(VOCAB, generator=g), logits[0], torch.randn(VOCAB, generator=g), logits[1]]
        )
        metadata = _metadata(mixed_params, generators=[seeded_greedy, None, None, None])
        mixed_tokens.append(mixed(mixed_logits, metadata).token_ids[[1, 3]].tolist())
    assert mixed_tokens == alone_tokens
    assert len({tuple(t) for t in alone_tokens}) > 1  # the rows really were random
    assert torch.equal(mixed_generator.get_state(), alone_generator.get_state())
    assert torch.equal(seeded_greedy.get_state(), state_before)


def _seeded_run(seed: int, position: int, batch_size: int, num_steps: int = 20) -> list[int]:
    """The same seeded request for num_steps steps at ``position`` of a batch of varied other rows."""
    target = SamplingParams(temperature=0.9, top_p=0.95, frequency_penalty=0.5, seed=seed)
    target_generator = torch.Generator().manual_seed(seed)
    target_logits = torch.Generator().manual_seed(7)  # the target's logits: the same in every run
    others = torch.Generator().manual_seed(1000 * batch_size + position)  # different in every run
    sampler = TorchSampler(torch.Generator().manual_seed(batch_size))
    params: list[SamplingParams] = []
    generators: list[torch.Generator | None] = []
    for row in range(batch_size):
        if row == position:
            params.append(target)
            generators.append(target_generator)
        elif row % 3 == 0:
            params.append(SamplingParams(temperature=0.0))
            generators.append(None)
        elif row % 3 == 1:
            params.append(SamplingParams(temperature=1.2, top_k=8, seed=row))
            generators.append(torch.Generator().manual_seed(row))
        else:
            params.append(SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.3))
            generators.append(None)
    token_ids: list[int] = []
    for _ in range(num_steps):
        logits = torch.randn(batch_size, VOCAB, generator=others) * 2  # [batch_size, VOCAB]
        logits[position] = torch.randn(VOCAB, generator=target_logits)
        outputs = [torch.randint(0, VOCAB, (5,), generator=others).tolist() for _ in range(batch_size)]
        outputs[position] = list(token_ids)
        metadata = _metadata(params, outputs=outputs, generators=generators)
        token_ids.append(int(sampler(logits, metadata).token_ids[position]))
    return token_ids


def test_seeded_request_gives_the_same_tokens_in_any_batch() -> None:
    alone = _seeded_run(1234, position=0, batch_size=1)
    assert _seeded_run(1234, position=0, batch_size=8) == alone
    assert _seeded_run(1234, position=5, batch_size=16) == alone
    assert len(set(alone)) >= 5  # a real random sequence, not a near-greedy one
    assert _seeded_run(4321, position=5, batch_size=16) != alone


def _geometric_logits(seed: int) -> torch.Tensor:
    """The token of rank i has logit -0.25 i; ranks are shuffled so rank order is not id order."""
    ranks = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    return -0.25 * ranks.float()  # [VOCAB]


def _allowed_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> list[int]:
    """The truncation set from sorted float64 probabilities; asserts no boundary is within rounding."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(VOCAB), key=lambda t: -probs[t])
    kept = order[:top_k] if top_k > 0 else order
    total = sum(probs[t] for t in kept)
    cumulative = 0.0
    for n, token_id in enumerate(kept, start=1):
        cumulative += probs[token_id] / total
        assert top_p == 1.0 or abs(cumulative - top_p) > 1e-3
        if cumulative >= top_p:
            kept = kept[:n]
            break
    ratios = [probs[t] / probs[kept[0]] for t in kept]
    assert min_p == 0.0 or all(abs(r - min_p) > 1e-3 for r in ratios)
    return [t for t, ratio in zip(kept, ratios, strict=True) if ratio >= min_p]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 5, 1.0, 0.0),
        (1.0, 0, 0.8, 0.0),
        (1.0, -1, 1.0, 0.1),
        (0.7, 12, 0.9, 0.05),
        (1.5, 20, 0.5, 0.0),
    ],
)
def test_truncation_samples_exactly_the_allowed_set(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    logits = _geometric_logits(seed=3)
    allowed = _allowed_tokens(logits, temperature, top_k, top_p, min_p)
    assert 1 < len(allowed) < VOCAB
    num_draws = 2000
    probs = torch.softmax(logits.double() / temperature, dim=-1)[allowed]
    # Every allowed token is expected often enough that missing it by chance is negligible (< e^-20).
    assert num_draws * float(probs.min() / probs.sum()) > 20
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * num_draws
    sampler = TorchSampler(torch.Generator().manual_seed(0))
    token_ids = sampler(logits.repeat(num_draws, 1), _metadata(params)).token_ids
    assert set(token_ids.tolist()) == set(allowed)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_follows_the_distribution(seeded: bool) -> None:
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    num_draws, temperature = 20000, 0.7
    params = [SamplingParams(temperature=temperature, seed=row if seeded else None) for row in range(num_draws)]
    generators = [torch.Generator().manual_seed(row) if seeded else None for row in range(num_draws)]
    metadata = _metadata(params, generators=generators, vocab_size=len(logits))
    token_ids = TorchSampler(torch.Generator().manual_seed(0))(logits.repeat(num_draws, 1), metadata).token_ids
    counts = torch.bincount(token_ids, minlength=len(logits)).double()
    # 7 degrees of freedom: P(chi2 > 24.32) = 0.001 when the sampler is right.
    assert _chi_square(counts, torch.softmax(logits.double() / temperature, dim=-1)) < 24.32
    # ...and the check can tell temperature 0.7 from 1.
    assert _chi_square(counts, torch.softmax(logits.double(), dim=-1)) > 200


def test_penalties_match_the_reference() -> None:
    num_reqs = 6
    logits = torch.randn(num_reqs, VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    prompts, outputs = _random_histories(num_reqs, seed=3)
    g = torch.Generator().manual_seed(4)
    params = [SamplingParams()] + [
        SamplingParams(
            repetition_penalty=float(torch.empty(1).uniform_(0.5, 2.0, generator=g)),
            presence_penalty=float(torch.empty(1).uniform_(-2.0, 2.0, generator=g)),
            frequency_penalty=float(torch.empty(1).uniform_(-2.0, 2.0, generator=g)),
        )
        for _ in range(num_reqs - 1)
    ]
    params[1] = SamplingParams(repetition_penalty=1.5)  # prompt tokens count too
    params[2] = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)  # output tokens only
    metadata = _metadata(params, prompts=prompts, outputs=outputs)
    processed = TorchSampler().process_logits(logits, metadata)
    expected = _reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(processed, expected)
    assert torch.equal(processed[0], logits[0])  # neutral row untouched
    assert (processed[1:] != logits[1:]).any(dim=-1).all()  # every penalised row changed


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.zeros(VOCAB)
    logits[3], logits[7], logits[5] = 10.0, 9.0, 5.0
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=2),
        # Would boost the banned ids if -inf did not stay -inf.
        SamplingParams(temperature=1.0, repetition_penalty=0.5, frequency_penalty=-2.0, presence_penalty=-2.0),
    ]
    num_copies = 500
    params = kinds * num_copies
    metadata = _metadata(params, outputs=[[3, 3, 3, 7]] * len(params), banned=[[3, 7]] * len(params))
    processed = TorchSampler().process_logits(logits.repeat(len(params), 1), metadata)
    assert torch.isneginf(processed[:, [3, 7]]).all()
    token_ids = TorchSampler(torch.Generator().manual_seed(0))(logits.repeat(len(params), 1), metadata).token_ids
    assert not set(token_ids.tolist()) & {3, 7}
    assert (token_ids[0::4] == 5).all()  # greedy takes the best allowed token
    assert len(set(token_ids[2::4].tolist())) == 2  # top_k=2 counts allowed tokens only


def test_logprobs_describe_the_raw_distribution() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(5)) * 2
    original = logits.clone()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(logprobs=0, repetition_penalty=1.5),
        SamplingParams(logprobs=3, temperature=0.0),
        SamplingParams(logprobs=5, temperature=1.3, top_k=4),
        SamplingParams(logprobs=2, temperature=0.5, top_p=0.5),
        SamplingParams(frequency_penalty=1.0),
    ]
    raw_favourite = int(logits[2].argmax())
    banned: list[list[int]] = [[], [], [raw_favourite], [], [], []]
    metadata = _metadata(params, prompts=[[1, 2]] * 6, outputs=[[3, 3]] * 6, banned=banned, vocab_size=50)
    out = TorchSampler(torch.Generator().manual_seed(0))(logits, metadata)
    assert torch.equal(logits, original)  # the engine's logits are not modified
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, raw.gather(-1, out.token_ids[:, None]).squeeze(-1))
    assert out.top_token_ids.shape == out.top_logprobs.shape == (6, 5)
    assert torch.equal(out.top_token_ids, raw.argsort(dim=-1, descending=True)[:, :5])
    torch.testing.assert_close(out.top_logprobs, raw.gather(-1, out.top_token_ids))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    # Row 2's raw favourite is banned: reported as most likely, never sampled.
    assert int(out.top_token_ids[2, 0]) == raw_favourite != int(out.token_ids[2])


def test_no_logprobs_unless_asked() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    out = TorchSampler()(logits, _metadata([SamplingParams()] * 3))
    assert (out.logprobs, out.top_token_ids, out.top_logprobs) == (None, None, None)
    out = TorchSampler()(logits, _metadata([SamplingParams(logprobs=0)] * 3))
    assert out.logprobs is not None and out.top_token_ids is not None
    assert out.logprobs.shape == (3,) and out.top_token_ids.shape == (3, 0)
    assert torch.isfinite(out.logprobs).all() and (out.logprobs <= 0).all()


def test_from_requests_normalises_and_flags() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=0, seed=1),
        SamplingParams(top_k=-1, logprobs=4),
        SamplingParams(top_k=5, seed=2),
        SamplingParams(top_k=100, top_p=0.9, logprobs=1),
    ]
    generators = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2), None]
    metadata = _metadata(
        params,
        prompts=[[1, 2, 3], [], [4], [5]],
        outputs=[[6], [7, 8], [], []],
        generators=generators,
        banned=[[], [2], [], []],
    )
    assert metadata.top_k.tolist() == [VOCAB, VOCAB, 5, VOCAB]
    assert list(metadata.generators) == [2]  # the greedy row's generator is left alone
    assert metadata.unseeded_rows is not None and metadata.unseeded_rows.tolist() == [1, 3]
    assert [(processor.name, rows) for processor, rows, _ in metadata.logits_processors] == [("ban", [1])]
    assert metadata.max_num_logprobs == 4
    assert (metadata.all_greedy, metadata.all_random, metadata.no_penalties) == (False, False, True)
    assert (metadata.no_top_k, metadata.no_top_p, metadata.no_min_p) == (False, False, True)
    # No penalties: no history is copied.
    assert metadata.prompt_token_ids.shape == metadata.output_token_ids.shape == (4, 0)
    penalised = [msgspec.structs.replace(p, repetition_penalty=1.2) for p in params]
    metadata = _metadata(penalised, prompts=[[1, 2, 3], [], [4], [5]], outputs=[[6], [7, 8], [], []])
    assert metadata.prompt_token_ids.tolist() == [[1, 2, 3], [VOCAB] * 3, [4, VOCAB, VOCAB], [5, VOCAB, VOCAB]]
    assert metadata.output_token_ids.tolist() == [[6, VOCAB], [7, 8], [VOCAB] * 2, [VOCAB] * 2]


def test_hand_built_metadata_derives_the_random_rows() -> None:
    params = [SamplingParams(temperature=0.0, seed=1), SamplingParams(), SamplingParams(seed=3)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8))
    built = _metadata(params, generators=[torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(3)])
    generators = {0: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(3)}
    by_hand = dataclasses.replace(built, generators=generators, unseeded_rows=None, all_random=False, no_top_k=False)
    assert list(by_hand.generators) == [2]  # the greedy row's generator is dropped
    assert by_hand.unseeded_rows is not None and by_hand.unseeded_rows.tolist() == [1]
    expected = TorchSampler(torch.Generator().manual_seed(0))(logits, built).token_ids
    assert torch.equal(TorchSampler(torch.Generator().manual_seed(0))(logits, by_hand).token_ids, expected)
