"""The core's verification of drafts: greedy identity, the exact target distribution, no leaked blocks.

The speculators here are the real ``ngram`` plus test-only ones that draft a
request's known greedy continuation with planted errors (so every position is
both accepted and rejected) or random tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tests.speculators.spec_util import chi_square_p, sampled_tokens, speculative_engine
from tokenmill.messages import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.proposer import DISABLE_SPECULATION
from tokenmill.speculative.rejection_sampler import Verified, rejection_sample
from tokenmill.speculative.speculator import Proposal, SpeculationInput, Speculator
from tokenmill.testing import make_engine, run_to_completion


class NoisyOracle(Speculator):
    """Drafts each request's known greedy continuation, replacing each draft with a wrong token at rate
    ``error_rate``: every draft position sees acceptances and rejections."""

    name: ClassVar[str] = "noisy-oracle"

    def __init__(self, k: int, answers: dict[str, list[int]], error_rate: float = 0.3, seed: int = 0) -> None:
        super().__init__(k)
        self.answers = answers
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.finished: list[str] = []

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        drafts = []
        for item in requests:
            done = len(item.token_ids) - item.num_prompt_tokens
            truth = self.answers[item.request_id][done : done + min(self.num_speculative_tokens, item.max_num_tokens)]
            drafts.append([t if self.rng.random() > self.error_rate else (t + 1) % 512 for t in truth])
        return Proposal(drafts)

    def on_requests_finished(self, request_ids: list[str]) -> None:
        self.finished += request_ids


class FixedDrafts(Speculator):
    """Always drafts the same tokens, optionally with a draft distribution for them."""

    name: ClassVar[str] = "fixed"

    def __init__(self, drafts: list[int], draft_probs: torch.Tensor | None = None) -> None:
        super().__init__(len(drafts))
        self.drafts = drafts
        self.draft_probs = draft_probs

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        token_ids = [self.drafts[: item.max_num_tokens] for item in requests]
        probs = [self.draft_probs[: len(t)] if self.draft_probs is not None else None for t in token_ids]
        return Proposal(token_ids, probs)


def _requests(count: int, seed: int = 0, **params: Any) -> list[EngineCoreRequest]:
    """Prompts of mixed lengths that repeat themselves (so prompt lookup finds matches)."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        motif = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 7))]
        prompt = (motif * 8)[: rng.randrange(5, 30)]
        fields = {"temperature": 0.0, "max_tokens": rng.randrange(4, 24), "ignore_eos": True, **params}
        params_i = SamplingParams(**fields)
        requests.append(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=params_i,
                                          eos_token_ids=[], arrival_time=float(i)))  # fmt: skip
    return requests


# ------------------------------------------------------------------------------------------- greedy identity


def test_ngram_greedy_output_is_identical_batched_with_chunked_prefill_and_prefix_caching(model_dir: Path) -> None:
    requests = _requests(12) + _requests(4, seed=0)[:2]  # the repeats hit the prefix cache
    requests[-2:] = [EngineCoreRequest(request_id=f"again{i}", prompt_token_ids=r.prompt_token_ids, params=r.params,
                                       eos_token_ids=[], arrival_time=100.0 + i)
                     for i, r in enumerate(requests[-2:])]  # fmt: skip
    limits = {"max_num_batched_tokens": 24}
    expected = run_to_completion(speculative_engine(model_dir, scheduler=limits), requests)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "draft_policy": "constant"}
    engine = make_engine(model_dir, scheduler=limits, speculative_config=spec)
    assert run_to_completion(engine, requests) == expected
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.prefix_cache_hits > 0
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens


def test_greedy_identity_under_preemption_stops_and_rejections_at_every_position(model_dir: Path) -> None:
    requests = _requests(10, seed=1, stop_token_ids=[7, 11], logprobs=2)
    small = {"cache": {"num_kv_blocks": 24}}  # 96 token slots for 10 requests: preemption
    plain = speculative_engine(model_dir, **small)
    expected = run_to_completion(plain, requests)
    oracle = NoisyOracle(4, expected)
    engine = speculative_engine(model_dir, oracle, **small)
    logprobs: dict[str, list[Any]] = {}
    for request in requests:
        engine.add_request(request)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id] += output.new_token_ids
            logprobs.setdefault(output.request_id, []).extend(output.new_logprobs or [])
    assert got == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the small cache must force preemption"
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == 4 and all(per_pos), per_pos
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # rejections happened
    assert set(oracle.finished) >= {r.request_id for r in requests}
    # The logprobs are the target's: the same as plain decoding's, token by token.
    plain_logprobs = _logprobs(model_dir, requests)
    for request_id, entries in logprobs.items():
        assert [e.token_id for e in entries] == expected[request_id]
        for mine, theirs in zip(entries, plain_logprobs[request_id], strict=True):
            assert mine.top_token_ids == theirs.top_token_ids
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def _logprobs(model_dir: Path, requests: list[EngineCoreRequest]) -> dict[str, list[Any]]:
    engine = speculative_engine(model_dir)
    for request in requests:
        engine.add_request(request)
    logprobs: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            logprobs.setdefault(output.request_id, []).extend(output.new_logprobs or [])
    return logprobs


def test_drafts_never_pass_max_tokens_or_the_context_window(model_dir: Path) -> None:
    requests = _requests(6, seed=2)
    expected = run_to_completion(speculative_engine(model_dir, model={"max_model_len": 40}), requests)
    engine = speculative_engine(model_dir, NoisyOracle(6, expected, error_rate=0.0), model={"max_model_len": 40})
    got = run_to_completion(engine, requests)
    assert got == expected
    for request in requests:
        assert len(got[request.request_id]) <= request.params.max_tokens  # type: ignore[operator]


# ------------------------------------------------------------------------------------------- distribution


def _wrong_rejection_sample(
    probs: torch.Tensor, drafts: Any, draft_probs: Any, greedy: Any, gens: Any, parents: Any = ()
) -> list[Any]:
    """A planted mistake: on rejection, draw from p instead of the residual max(0, p - q)."""
    results = []
    start = 0
    for own in drafts:
        kept = 0
        while kept < len(own) and float(torch.rand(())) < float(probs[start + kept, own[kept]]):
            kept += 1
        results.append(Verified([*own[:kept], int(torch.multinomial(probs[start + kept], 1))]))
        start += len(own) + 1
    return results


@pytest.mark.slow
def test_sampled_tokens_have_the_target_distribution_and_a_wrong_rule_is_caught(
    small_vocab_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = 10_000
    drafts = [4, 4]  # a fixed guess: accepted at p(4), so both acceptance and rejection are frequent
    plain = sampled_tokens(small_vocab_model, None, count, seed=1)
    speculative = sampled_tokens(small_vocab_model, FixedDrafts(drafts), count, seed=2)
    for position in (1, 2):  # the tokens that went through verification
        p = chi_square_p([t[position] for t in plain], [t[position] for t in speculative], 16)
        assert p > 0.01, f"position {position}: speculative sampling changed the distribution (p={p:.2g})"
    monkeypatch.setattr("tokenmill.speculative.verification.rejection_sample", _wrong_rejection_sample)
    wrong = sampled_tokens(small_vocab_model, FixedDrafts(drafts), count, seed=2)
    p = chi_square_p([t[1] for t in plain], [t[1] for t in wrong], 16)
    assert p < 0.01, f"the chi-square test cannot tell a wrong acceptance rule apart (p={p:.2g})"


def test_rejection_sampler_with_draft_distributions_matches_the_target() -> None:
    """Unit level, with a non-trivial q: 20,000 first tokens against p exactly; the planted rule fails."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 8, 20_000
    p = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, -1)
    drafts = [[d] for d in torch.multinomial(q, rows, replacement=True, generator=generator).tolist()]
    probs = p.repeat(2 * rows, 1)  # two rows per request: the draft's, then the bonus

    def p_value(sample: Any) -> float:
        torch.manual_seed(0)
        results = sample(probs, drafts, [q[None]] * rows, [False] * rows, [None] * rows)
        counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=vocab).double()
        statistic = ((counts - rows * p.double()) ** 2 / (rows * p.double())).sum()
        return float(torch.special.gammaincc(torch.tensor((vocab - 1) / 2.0), statistic / 2))

    assert p_value(rejection_sample) > 0.01
    assert p_value(_wrong_rejection_sample) < 0.01


def test_greedy_rows_keep_drafts_equal_to_the_argmax_and_draw_nothing() -> None:
    probs = torch.zeros(4, 5)
    probs[0, 2] = probs[1, 3] = probs[2, 1] = probs[3, 4] = 1.0  # one-hot argmaxes 2, 3, 1, 4
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    (result,) = rejection_sample(probs, [[2, 3, 0]], [None], [True], [generator])
    assert result.token_ids == [2, 3, 1] and result.num_accepted == 2
    assert torch.equal(generator.get_state(), state)


# ------------------------------------------------------------------------------------------- blocks and policy


@pytest.mark.slow
def test_no_blocks_leak_after_1000_random_speculative_requests_with_aborts(model_dir: Path) -> None:
    class RandomDrafts(Speculator):
        name: ClassVar[str] = "random"

        def propose(self, requests: list[SpeculationInput]) -> Proposal:
            return Proposal([[rng.randrange(512) for _ in range(rng.randrange(0, 1 + min(5, item.max_num_tokens)))]
                             for item in requests])  # fmt: skip

    rng = random.Random(7)
    engine = speculative_engine(model_dir, RandomDrafts(5), cache={"num_kv_blocks": 96}, scheduler={"max_num_seqs": 64})
    pool = engine.kv_cache._pool  # type: ignore[attr-defined]
    idle = pool.num_free_blocks
    requests = _requests(1000, seed=3)
    for request in requests[:200]:
        engine.add_request(request)
    pending = requests[200:]
    live = [r.request_id for r in requests[:200]]
    while engine.has_unfinished_requests() or pending:
        engine.step()
        if pending:
            engine.add_request(pending.pop())
        if live and rng.random() < 0.3:
            engine.abort_requests([live.pop(rng.randrange(len(live)))])
        if rng.random() < 0.05:
            engine.kv_cache.check_invariants()  # type: ignore[attr-defined]
    engine.kv_cache.check_invariants()  # type: ignore[attr-defined]
    assert engine.kv_cache.usage == 0.0
    assert pool.num_free_blocks == idle
    assert engine.stats().spec_decode_num_drafts > 1000


def test_speculation_is_off_at_large_batches_and_for_requests_that_opt_out(model_dir: Path) -> None:
    requests = _requests(4, seed=4, max_tokens=12)  # all four run to the end together
    answers = run_to_completion(speculative_engine(model_dir), requests)
    engine = make_engine(model_dir, speculative_config={"method": "ngram", "disable_by_batch_size": 4})
    engine.executor.proposer.speculator = NoisyOracle(3, answers, error_rate=0.0)
    assert run_to_completion(engine, requests) == answers
    assert engine.stats().spec_decode_num_drafts == 0  # four running: never drafted
    engine = speculative_engine(model_dir, NoisyOracle(3, answers, error_rate=0.0))
    opted_out = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, extra_args={DISABLE_SPECULATION: True})
    first = requests[0]
    request = EngineCoreRequest(request_id=first.request_id, prompt_token_ids=first.prompt_token_ids,
                                params=opted_out, eos_token_ids=[], arrival_time=0.0)  # fmt: skip
    run_to_completion(engine, [request])
    assert engine.stats().spec_decode_num_drafts == 0
    assert run_to_completion(engine, requests[1:2]) == {requests[1].request_id: answers[requests[1].request_id]}
    assert engine.stats().spec_decode_num_drafts > 0


def test_a_speculator_that_raises_costs_drafts_not_requests(model_dir: Path) -> None:
    class Broken(Speculator):
        name: ClassVar[str] = "broken"

        def propose(self, requests: list[SpeculationInput]) -> Proposal:
            raise RuntimeError("boom")

    requests = _requests(3, seed=5)
    expected = run_to_completion(speculative_engine(model_dir), requests)
    assert run_to_completion(speculative_engine(model_dir, Broken(3)), requests) == expected


def test_draft_model_greedy_output_is_identical_with_rejections_and_preemption(model_dir: Path) -> None:
    """The target's own int4 version drafts: mostly accepted, sometimes rejected, repaired by the target."""
    requests = _requests(8, seed=6, stop_token_ids=[9])
    small = {"cache": {"num_kv_blocks": 28}}
    expected = run_to_completion(speculative_engine(model_dir, **small), requests)
    spec = {"method": "draft_model", "model": str(model_dir), "quantization": "int4", "num_speculative_tokens": 3,
            "draft_policy": "constant"}  # fmt: skip
    engine = make_engine(model_dir, speculative_config=spec, **small)
    assert run_to_completion(engine, requests) == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_stop_strings_and_n_gt_1_through_the_offline_api(model_dir: Path) -> None:
    """Stop strings end a multi-token step at the string; n > 1 completions each speculate on their own."""
    from tokenmill.llm import LLM

    prompts = ["ab ab ab ab ab ab", "hello hello hello hello", "xyz xyz xyz"]
    plain = LLM(str(model_dir), device="cpu", num_kv_blocks=512, block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in plain.generate(prompts, greedy, use_tqdm=False)]
    stops = [text[len(text) // 3 : len(text) // 3 + 2] for text in texts]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], n=2) for stop in stops]
    expected = [[c.text for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "ngram", "prompt_lookup_min": 1, "draft_policy": "constant"}
    speculative = LLM(str(model_dir), device="cpu", num_kv_blocks=512, block_size=4, speculative_config=spec)
    got = [[c.text for c in o.outputs] for o in speculative.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert all(len(t[0]) < len(full) for t, full in zip(expected, texts, strict=True))  # the stops did stop them
    assert speculative.engine.stats().spec_decode_num_drafts > 0
