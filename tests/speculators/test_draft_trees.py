"""Draft trees (``tokenmill.speculative.draft_tree``): the tree attention mask, exact verification of trees, and
the KV kept or recomputed afterwards.

A tree step must score every node exactly as the node's own path would be scored as a plain chain; greedy output
with trees must be token for token plain greedy output (batched, with preemption, stops and logprobs); sampled
tokens must keep the target's distribution, which a planted wrong rule fails; and no KV block may leak.
"""

from __future__ import annotations

import bisect
import itertools
import random
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tests.speculators.spec_util import chi_square_p, sampled_tokens, speculative_engine
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.draft_policy import DraftPolicy
from tokenmill.speculative.draft_tree import (
    accepted_nodes,
    check_parents,
    depths,
    num_in_place,
    parse_token_tree,
    path,
    tree_parents,
)
from tokenmill.speculative.rejection_sampler import Verified, _sample_tree, rejection_sample, verify_greedy
from tokenmill.speculative.speculator import Proposal, SpeculationInput, Speculator
from tokenmill.step_batch import SequenceChunk
from tokenmill.testing import make_engine, run_to_completion

BACKENDS = ("torch", "cpu")


# ------------------------------------------------------------------------------------------- the tree itself


def test_token_tree_parses_vllms_format_and_rejects_bad_trees() -> None:
    tree = parse_token_tree("[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]")
    assert tree_parents(tree) == [-1, -1, 0, 0, 2]
    assert depths(tree_parents(tree)) == [1, 1, 2, 2, 3]
    assert path(tree_parents(tree), 4) == [0, 2, 4]
    for bad, message in [
        ("[(0, 0), (0,)]", "before its parent"),
        ("[(0,), (0,)]", "twice"),
        ("[()]", "non-empty tuple"),
        ("[(0,), (-1,)]", "non-empty tuple"),
        ("(0,", "list of tuples"),
        ("[]", "non-empty list"),
        (str([(i,) for i in range(65)]), "at most 64"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_token_tree(bad)


def test_parents_are_checked_and_accepted_paths_recovered() -> None:
    parents, tokens = [-1, -1, 0, 0, 2], [5, 6, 7, 8, 9]
    check_parents(parents, tokens)
    for bad_parents, bad_tokens, message in [
        ([-1, 1], [5, 6], "earlier draft"),
        ([-1, -1], [5, 5], "repeats token"),
        ([-1], [5, 6], "parents for"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_parents(bad_parents, bad_tokens)
    assert accepted_nodes(parents, tokens, [5, 8]) == [0, 3]
    assert accepted_nodes(parents, tokens, [6]) == [1]
    # Node j sits j + 1 slots after the root: a path keeps its KV while it runs along nodes 0, 1, 2, ...
    assert num_in_place([0, 2, 4]) == 1 and num_in_place([0, 1, 2]) == 3 and num_in_place([1]) == 0


# ------------------------------------------------------------------------------------------- the attention mask


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tree_step_scores_each_node_as_its_own_path_would(model_dir: Path, backend: str) -> None:
    """One step over a 20-token context plus a root and a 6-node tree, against each node's path run as plain
    tokens on a fresh cache: the same logits (the mask hides other branches, rotary positions follow depth)."""
    engine = make_engine(model_dir, attention={"backend": backend})
    loaded = engine.loaded
    context = list(range(40, 60))
    root = 77
    tree = parse_token_tree("[(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (2,)]")
    parents = tree_parents(tree)
    nodes = [101, 102, 103, 104, 105, 106]

    runner = ModelRunner(loaded, 32, 4)
    runner.execute([SequenceChunk(context, 0, list(range(10)))])
    chunk = SequenceChunk([root, *nodes], len(context), list(range(10)), tuple(parents))
    got = runner.execute([chunk], logits_indices=list(range(len(nodes) + 1)))  # [7, vocab]

    for node in range(-1, len(nodes)):
        chain = [root, *(nodes[j] for j in path(parents, node))]
        reference = ModelRunner(loaded, 32, 4)
        expected = reference.execute([SequenceChunk(context + chain, 0, list(range(10)))])[0]
        assert torch.allclose(got[node + 1], expected, atol=2e-4, rtol=1e-4), f"{backend}: node {node}"


# ------------------------------------------------------------------------------------------- through the engine


class TreeOracle(Speculator):
    """Drafts a tree around each request's known greedy continuation: at each level the true token sits at a
    random rank among wrong candidates, or is missing, so acceptance stops at every depth and in every branch."""

    name: ClassVar[str] = "tree-oracle"
    supports_draft_trees: ClassVar[bool] = True

    def __init__(self, answers: dict[str, list[int]], tree: str, vocab: int = 512, miss_rate: float = 0.3) -> None:
        self.tree = parse_token_tree(tree)
        super().__init__(len(self.tree))
        self.parents = tree_parents(self.tree)
        self.answers, self.vocab, self.miss_rate = answers, vocab, miss_rate
        self.rng = random.Random(0)
        self.finished: list[str] = []

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        token_ids, parents = [], []
        for item in requests:
            done = len(item.token_ids) - item.num_prompt_tokens
            truth = self.answers[item.request_id][done:]
            # Per depth: candidates by rank, the true token at a random rank (or nowhere).
            ranks = []
            for depth in range(max(map(len, self.tree))):
                candidates = self.rng.sample(range(self.vocab), 4)
                true = truth[depth] if depth < len(truth) else 0
                candidates = [c for c in candidates if c != true][:3]
                if self.rng.random() > self.miss_rate:  # mostly at rank 0, as a good speculator would have it
                    candidates.insert(self.rng.choices(range(3), weights=(6, 2, 1))[0], true)
                ranks.append(candidates)
            count = min(len(self.tree), item.max_num_tokens)
            token_ids.append([ranks[len(node) - 1][node[-1]] for node in self.tree[:count]])
            parents.append(self.parents[:count])
        return Proposal(token_ids, parents=parents)  # type: ignore[arg-type]

    def on_requests_finished(self, request_ids: list[str]) -> None:
        self.finished += request_ids


def _requests(count: int, seed: int = 0, **params: Any) -> list[EngineCoreRequest]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(3, 30))]
        fields = {"temperature": 0.0, "max_tokens": rng.randrange(4, 24), "ignore_eos": True, **params}
        requests.append(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, params=SamplingParams(**fields),
                                          eos_token_ids=[], arrival_time=float(i)))  # fmt: skip
    return requests


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_output_is_identical_with_trees_batched_preempted_and_stopped(model_dir: Path, backend: str) -> None:
    requests = _requests(10, seed=1, stop_token_ids=[7, 11], logprobs=2)
    sections: dict[str, Any] = {"cache": {"num_kv_blocks": 28}, "attention": {"backend": backend}}
    plain = speculative_engine(model_dir, **sections)
    expected: dict[str, list[int]] = {}
    plain_logprobs: dict[str, list[Any]] = {}
    for request in requests:
        plain.add_request(request)
    while plain.has_unfinished_requests():
        for output in plain.step():
            expected.setdefault(output.request_id, []).extend(output.new_token_ids)
            plain_logprobs.setdefault(output.request_id, []).extend(output.new_logprobs or [])

    oracle = TreeOracle(expected, "[(0,), (1,), (2,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (2, 0), (1, 0, 0)]")
    engine = speculative_engine(model_dir, oracle, **sections)
    for request in requests:
        engine.add_request(request)
    got: dict[str, list[int]] = {}
    logprobs: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.new_token_ids)
            logprobs.setdefault(output.request_id, []).extend(output.new_logprobs or [])
    assert got == expected
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the small cache must force preemption"
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert all(per_pos[:3]), per_pos  # accepted at every depth
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert set(oracle.finished) >= {r.request_id for r in requests}
    for request_id, entries in logprobs.items():  # the target's logprobs, token by token
        assert [e.token_id for e in entries] == expected[request_id]
        for mine, theirs in zip(entries, plain_logprobs[request_id], strict=True):
            assert mine.top_token_ids == theirs.top_token_ids
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert engine.kv_cache.usage == 0.0


def test_a_chain_speculator_refuses_a_configured_tree(model_dir: Path) -> None:
    from tokenmill.config import ConfigError

    spec = {"method": "ngram", "speculative_token_tree": "[(0,), (1,)]"}
    with pytest.raises(ConfigError, match="drafts chains only"):
        make_engine(model_dir, speculative_config=spec)


@pytest.mark.slow
def test_no_blocks_leak_after_random_tree_requests_with_aborts(model_dir: Path) -> None:
    requests = _requests(300, seed=5)
    answers = run_to_completion(speculative_engine(model_dir), requests)
    oracle = TreeOracle(answers, "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]", miss_rate=0.2)
    engine = speculative_engine(model_dir, oracle, cache={"num_kv_blocks": 64}, scheduler={"max_num_seqs": 32})
    pool = engine.kv_cache._pool
    idle = pool.num_free_blocks
    rng = random.Random(9)
    for request in requests[:60]:
        engine.add_request(request)
    pending, live = requests[60:], [r.request_id for r in requests[:60]]
    while engine.has_unfinished_requests() or pending:
        engine.step()
        if pending:
            engine.add_request(pending.pop())
        if live and rng.random() < 0.3:
            engine.abort_requests([live.pop(rng.randrange(len(live)))])
        if rng.random() < 0.05:
            engine.kv_cache.check_invariants()
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0.0 and pool.num_free_blocks == idle
    assert engine.stats().spec_decode_num_accepted_tokens > 0


# ------------------------------------------------------------------------------------------- distribution


class FixedTree(Speculator):
    """Always drafts the same tree: two candidates for the next token and one after the first."""

    name: ClassVar[str] = "fixed-tree"
    supports_draft_trees: ClassVar[bool] = True

    def __init__(self, tokens: list[int], parents: list[int]) -> None:
        super().__init__(len(tokens))
        self.tokens, self.parents = tokens, parents

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        counts = [min(len(self.tokens), item.max_num_tokens) for item in requests]
        return Proposal([self.tokens[:n] for n in counts], parents=[self.parents[:n] for n in counts])


def _wrong_tree_rule(probs: torch.Tensor, drafts: Any, draft_probs: Any, greedy: Any, gens: Any, parents: Any) -> Any:
    """A planted mistake: every child is tried against the node's full p (rejected children are not taken out
    of it), so the second candidate is accepted too often."""
    results, start = [], 0
    for own, tree in zip(drafts, parents, strict=True):
        tree = tree if tree is not None else list(range(-1, len(own) - 1))  # a chain
        current, tokens, nodes = -1, [], []
        while True:
            row = probs[start + current + 1]
            kids = [j for j, parent in enumerate(tree) if parent == current]
            chosen = next((kid for kid in kids if float(torch.rand(())) < float(row[own[kid]])), None)
            if chosen is None:
                tokens.append(int(torch.multinomial(row, 1)))
                break
            tokens.append(own[chosen])
            nodes.append(chosen)
            current = chosen
        results.append(Verified(tokens, tuple(nodes)))
        start += len(own) + 1
    return results


@pytest.mark.slow
def test_sampled_tokens_through_trees_have_the_target_distribution_and_a_wrong_rule_is_caught(
    small_vocab_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = 10_000
    tree = ([4, 5, 4], [-1, -1, 0])  # 4 or 5 next, then 4 after 4
    plain = sampled_tokens(small_vocab_model, None, count, seed=1)
    speculative = sampled_tokens(small_vocab_model, FixedTree(*tree), count, seed=2)
    for position in (1, 2):
        p = chi_square_p([t[position] for t in plain], [t[position] for t in speculative], 16)
        assert p > 0.01, f"position {position}: tree verification changed the distribution (p={p:.2g})"
    monkeypatch.setattr("tokenmill.speculative.verification.rejection_sample", _wrong_tree_rule)
    wrong = sampled_tokens(small_vocab_model, FixedTree(*tree), count, seed=2)
    p = chi_square_p([t[1] for t in plain], [t[1] for t in wrong], 16)
    assert p < 0.01, f"the chi-square test cannot tell a wrong tree rule apart (p={p:.2g})"


def test_tree_sampler_unit_matches_p_and_greedy_takes_the_argmax_child() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 6, 20_000
    p = torch.softmax(torch.randn(vocab, generator=generator) * 1.5, -1)
    probs = p.repeat(3 * rows, 1)  # root, then the two children's rows
    drafts, parents = [[0, 1]] * rows, [[-1, -1]] * rows
    torch.manual_seed(0)
    results = rejection_sample(probs, drafts, [None] * rows, [False] * rows, [None] * rows, parents)
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=vocab).double()
    statistic = ((counts - rows * p.double()) ** 2 / (rows * p.double())).sum()
    assert float(torch.special.gammaincc(torch.tensor((vocab - 1) / 2.0), statistic / 2)) > 0.01
    assert all(r.nodes == ((r.token_ids[0],) if r.token_ids[0] in (0, 1) else ()) for r in results)

    one_hot = torch.zeros(4, 5)
    one_hot[0, 3] = one_hot[2, 2] = one_hot[1, 0] = one_hot[3, 4] = 1.0  # root -> 3, node 1 (token 3) -> 2
    (result,) = rejection_sample(one_hot, [[1, 3, 2]], [None], [True], [None], [[-1, -1, 1]])
    assert result.token_ids == [3, 2, 4] and result.nodes == (1, 2)


def test_goodput_policy_learns_each_tree_nodes_rate() -> None:
    policy = DraftPolicy(4)
    for _ in range(200):
        policy.observe_verification("r", 4, 1, tree_nodes=[1])  # node 1 always accepted, the others never
    assert policy._node_rate(1) > 0.9 and policy._node_rate(0) < 0.1 and policy._node_rate(3) < 0.1


def _tree_policy(rates: list[float], base_ms: float = 17.0, per_token_ms: float = 0.4) -> DraftPolicy:
    """A policy that has measured a tree whose node j is accepted at ``rates[j]``, on steps costing ``base`` plus
    ``per_token`` a token (a float32 CPU step: extra tokens nearly free)."""
    policy = DraftPolicy(len(rates))
    for tokens in (1, 2, 5, 9, 17) * 20:
        policy.observe_step(tokens, (base_ms + per_token_ms * tokens) / 1000, drafted=tokens > 1)
    rng = random.Random(0)
    for _ in range(400):
        accepted = [j for j, rate in enumerate(rates) if rng.random() < rate][:1]
        policy.observe_verification("r", len(rates), len(accepted), tree_nodes=accepted)
    return policy


def test_goodput_policy_verifies_the_nodes_that_pay_together_and_explores_the_whole_tree() -> None:
    """Nodes worth a few hundredths of a token each: every one that adds more than it costs is verified (a 3%
    bar per node would stop at two), none once the tree as a whole stops paying, and one step in 64 gives one
    request the whole tree so every node's rate stays measured (and after 64 decisions in a row that drafted, with no
    plain step measured since, one drafts nothing)."""
    rates = [0.26, 0.1, 0.06, 0.05, 0.03, 0.01, 0.005, 0.005]
    policy = _tree_policy(rates)
    counts = [policy.num_drafts(["r"], [8], 1)[0] for _ in range(128)]
    assert counts.count(8) == 2 and counts.count(0) == 1  # the explore steps: the whole tree, and nothing
    assert set(counts) - {0, 8} == {4}, counts  # nodes 0-3: each adds more than 0.5% (and its cost)
    expensive = _tree_policy(rates, per_token_ms=8.0)  # a verified token costs half a step: not even node 0 pays
    assert [expensive.num_drafts(["r"], [8], 1)[0] for _ in range(7)] == [0] * 7
    nothing_left = _tree_policy([0.02] * 8)  # the nodes together add too little for the cost of verifying
    assert [nothing_left.num_drafts(["r"], [8], 1)[0] for _ in range(7)] == [0] * 7


def test_goodput_policy_verifies_past_a_poor_early_node() -> None:
    """The stored order ranks nodes by held-out acceptance, but served text can rate them otherwise (measured: the
    second candidate for the next token at 1%, the fourth node at 10%). Every prefix is weighed, so the good
    nodes after the poor one are verified; stopping at the first node that does not pay alone verified one."""
    rates = [0.3, 0.01, 0.12, 0.1, 0.08, 0.005, 0.005, 0.005]
    policy = _tree_policy(rates)
    counts = {policy.num_drafts(["r"], [8], 1)[0] for _ in range(7)}
    assert counts == {4}, counts  # nodes 0-3 (node 1 included); 4-7 add less than they cost
    assert _tree_policy(rates).num_drafts(["a", "b"], [8, 0], 2)[1] == 0  # a request's limit caps it


def test_goodput_policy_verifies_the_nodes_a_flat_step_makes_cheap() -> None:
    """A Medusa run on the float32 default model, as the policy saw it: plain steps of 1 token at 17.5 ms, most
    verification steps of 2 tokens at 18.0 ms, some of 5 at 18.2 ms, the whole tree's 17 tokens at 27.6 ms, and
    node rates measured on served text. A line through those steps (the policy before) prices 4 nodes 2 ms above
    one and verifies two; priced as measured, the 4 nodes pay 10% more than one."""
    rates = [0.244, 0.056, 0.045, 0.042, 0.02, 0.02, 0.02, 0.02, 0.01, 0.01, 0.01, 0.01, 0.005, 0.005, 0.005, 0.005]
    policy = DraftPolicy(len(rates))
    steps = [(1, 17.5)] * 2 + [(2, 18.0)] * 10 + [(5, 18.2)] + [(17, 27.6)] * 2
    for tokens, ms in steps * 20:
        policy.observe_step(tokens, ms / 1000, drafted=tokens > 1)
    policy.observe_propose(16, 0.00075)
    bounds = list(itertools.accumulate(rates))
    for i in range(400):
        u = i * 0.618034 % 1  # spread evenly over [0, 1): each node accepted at its rate, in every stretch
        accepted = [bisect.bisect_right(bounds, u)] if u < bounds[-1] else []
        policy.observe_verification("r", len(rates), len(accepted), tree_nodes=accepted)
    assert {policy.num_drafts(["r"], [16], 1)[0] for _ in range(7)} == {4}


def test_greedy_verification_from_tokens_walks_trees_and_chains_as_the_one_hot_rows_do() -> None:
    """``verify_greedy`` (the engine's path for all-greedy steps: tokens, no distributions) against the tree walk
    over one-hot rows and the chain rule, on random trees whose drafts often are the target's tokens."""
    rng = random.Random(0)
    vocab = 6
    for _ in range(200):
        num_nodes = rng.randrange(0, 9)
        parents = [rng.randrange(-1, node) for node in range(num_nodes)]
        drafts: list[int] = []
        for node, parent in enumerate(parents):
            taken = {drafts[other] for other in range(node) if parents[other] == parent}
            drafts.append(rng.choice([t for t in range(vocab) if t not in taken]))
        targets = [rng.randrange(vocab) for _ in range(num_nodes + 1)]
        one_hot = torch.nn.functional.one_hot(torch.tensor(targets), vocab).float()
        expected = _sample_tree(one_hot, drafts, parents, True, None) if parents else Verified([targets[0]])
        (verified,) = verify_greedy(targets, [drafts], [parents])
        assert (verified.token_ids, verified.nodes) == (expected.token_ids, expected.nodes)
        chain = [-1, *range(num_nodes - 1)] if num_nodes else []
        kept = next((j for j in range(num_nodes) if drafts[j] != targets[j]), num_nodes)
        assert verify_greedy(targets, [drafts], [chain])[0].token_ids == [*drafts[:kept], targets[kept]]
