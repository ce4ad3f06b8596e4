"""The ``draft_model`` speculator: its drafts are the draft model's own greedy continuation, its KV cache stays
in step as the core accepts drafts, and a full cache or a foreign vocabulary fail safely.

The draft model here is the target itself (the same tiny random Llama), so the expected drafts are the
target's greedy continuation, computed one request at a time on a fresh ``ModelRunner``.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenmill_plugins.speculators.draft_model import DraftModelSpeculator

from tokenmill.config import ConfigError, load_config
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.plugin_manager import Slot, resolve_plugins
from tokenmill.speculative.speculator import SpeculationInput, SpeculatorContext
from tokenmill.testing import check_speculator, save_tiny_model

K = 4
BLOCK_SIZE = 4
VOCAB_SIZE = 512  # the tiny models' vocabulary

Greedy = Callable[[list[int], int], list[int]]


def _context(target_dir: Path, draft_dir: Path, num_kv_blocks: int = 64) -> SpeculatorContext:
    """What the engine gives its speculator, for ``target_dir`` drafted for by ``draft_dir``."""
    config = load_config(
        overrides={
            "model": {"model": str(target_dir)},
            "device": {"device": "cpu"},
            "cache": {"block_size": BLOCK_SIZE, "num_kv_blocks": num_kv_blocks},
            "speculative_config": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K},
        }
    )
    plugins = resolve_plugins(config)
    return SpeculatorContext(config, load_model(config, plugins), plugins, BLOCK_SIZE, num_kv_blocks)


@pytest.fixture(scope="module")
def context(tiny_model_dir: Path) -> SpeculatorContext:
    return _context(tiny_model_dir, tiny_model_dir)


@pytest.fixture
def speculator(context: SpeculatorContext) -> DraftModelSpeculator:
    return DraftModelSpeculator(K, context)


@pytest.fixture(scope="module")
def greedy(context: SpeculatorContext) -> Greedy:
    """The target's greedy continuation of ``token_ids``, ``n`` tokens, one request alone on its own cache."""
    runner = ModelRunner(context.target, num_blocks=128, block_size=BLOCK_SIZE)

    def continuation(token_ids: list[int], n: int) -> list[int]:
        block_ids = list(range(-(-(len(token_ids) + n) // BLOCK_SIZE)))
        logits = runner.execute([SequenceChunk(list(token_ids), 0, block_ids)])
        tokens: list[int] = []
        for _ in range(n):
            tokens.append(int(logits.argmax(dim=-1)))
            logits = runner.execute([SequenceChunk([tokens[-1]], len(token_ids) + len(tokens) - 1, block_ids)])
        return tokens

    return continuation


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def _inputs(tokens: dict[str, list[int]], max_num_tokens: int = 100) -> list[SpeculationInput]:
    return [SpeculationInput(rid, list(t), min(len(t), 8), max_num_tokens) for rid, t in tokens.items()]


def test_registered_as_draft_model(context: SpeculatorContext) -> None:
    assert context.plugins.load(Slot.SPECULATOR, "draft_model") is DraftModelSpeculator


def test_drafts_are_the_greedy_continuation_in_one_batch(speculator: DraftModelSpeculator, greedy: Greedy) -> None:
    rng = random.Random(0)
    tokens = {"one": _tokens(rng, 1), "five": _tokens(rng, 5), "thirteen": _tokens(rng, 13)}
    inputs = [
        *_inputs(tokens),
        SpeculationInput("two-left", _tokens(rng, 7), 7, max_num_tokens=2),
        SpeculationInput("none-left", _tokens(rng, 6), 6, max_num_tokens=0),
    ]
    proposal = speculator.propose(inputs)
    assert proposal.draft_probs == []  # greedy: deterministic drafts
    expected = [greedy(list(item.token_ids), min(K, item.max_num_tokens)) for item in inputs]
    assert proposal.token_ids == expected
    assert [len(d) for d in proposal.token_ids] == [K, K, K, 2, 0]


def test_stays_in_step_as_the_core_accepts_drafts(speculator: DraftModelSpeculator, greedy: Greedy) -> None:
    """Each round the core keeps a prefix of the drafts (none, some, all) and appends a token of its own that
    differs from the next draft; a request may also sit out a round and come back several tokens longer."""
    rng = random.Random(1)
    tokens = {"a": _tokens(rng, 3), "b": _tokens(rng, 9), "c": _tokens(rng, 6)}
    drafts = dict(zip(tokens, speculator.propose(_inputs(tokens)).token_ids, strict=True))
    for round_ in range(6):
        for i, (rid, drafted) in enumerate(drafts.items()):
            # In round 2 "c" keeps no draft and then sits out: two tokens after its cached prefix are new.
            num_accepted = 0 if (round_, rid) == (2, "c") else (round_ + i) % (K + 1)
            own = (drafted[num_accepted] + 1) % VOCAB_SIZE if num_accepted < K else rng.randrange(VOCAB_SIZE)
            tokens[rid] += [*drafted[:num_accepted], own]
        if round_ == 2:  # "c" sits this round out: the core appended one more token without asking for drafts
            tokens["c"].append(rng.randrange(VOCAB_SIZE))
            asked = {rid: t for rid, t in tokens.items() if rid != "c"}
        else:
            asked = tokens
        proposal = speculator.propose(_inputs(asked))
        assert proposal.token_ids == [greedy(t, K) for t in asked.values()], f"round {round_}"
        drafts.update(zip(asked, proposal.token_ids, strict=True))
    speculator.on_requests_finished(list(tokens))
    assert speculator.num_free_blocks == 64


def test_same_inputs_twice_give_the_same_drafts(speculator: DraftModelSpeculator, greedy: Greedy) -> None:
    """The cache then holds every input token: the last one is still recomputed, for its logits."""
    tokens = {"r": _tokens(random.Random(2), 10)}
    first = speculator.propose(_inputs(tokens)).token_ids
    assert speculator.propose(_inputs(tokens)).token_ids == first == [greedy(tokens["r"], K)]


def test_preempted_request_recomputes(speculator: DraftModelSpeculator, greedy: Greedy) -> None:
    rng = random.Random(3)
    tokens = {"r": _tokens(rng, 7), "other": _tokens(rng, 5)}
    speculator.propose(_inputs(tokens))
    speculator.on_requests_finished(["r"])  # preempted: it comes back later with the same id, more tokens
    tokens["r"] += _tokens(rng, 6)
    assert speculator.propose(_inputs(tokens)).token_ids == [greedy(t, K) for t in tokens.values()]


def test_reused_id_with_other_tokens_recomputes(speculator: DraftModelSpeculator, greedy: Greedy) -> None:
    """Without on_requests_finished in between (a misbehaving caller), a request whose earlier tokens changed
    still gets the right drafts: its tokens are compared from the start when the last known one differs."""
    rng = random.Random(4)
    speculator.propose(_inputs({"r": _tokens(rng, 9)}))
    tokens = _tokens(rng, 12)
    assert speculator.propose(_inputs({"r": tokens})).token_ids == [greedy(tokens, K)]


def test_full_cache_drafts_nothing_for_requests_that_do_not_fit(tiny_model_dir: Path, greedy: Greedy) -> None:
    # 8 blocks of 4 = 32 tokens; a request of 10 tokens needs 10 + K - 1 = 13 slots, 4 blocks.
    speculator = DraftModelSpeculator(K, _context(tiny_model_dir, tiny_model_dir, num_kv_blocks=8))
    rng = random.Random(5)
    tokens = {"a": _tokens(rng, 10), "b": _tokens(rng, 10), "c": _tokens(rng, 10), "huge": _tokens(rng, 40)}
    proposal = speculator.propose(_inputs(tokens))
    assert proposal.token_ids == [greedy(tokens["a"], K), greedy(tokens["b"], K), [], []]
    assert speculator.num_free_blocks == 0
    # "b" grows past its 4 blocks and no block is free: it drafts nothing and gives its blocks up, so "c" fits.
    tokens["b"] += _tokens(rng, 4)
    proposal = speculator.propose(_inputs({"b": tokens["b"], "c": tokens["c"]}))
    assert proposal.token_ids == [[], greedy(tokens["c"], K)]
    speculator.on_requests_finished(["a", "c"])
    assert speculator.propose(_inputs({"b": tokens["b"]})).token_ids == [greedy(tokens["b"], K)]
    speculator.on_requests_finished(list(tokens))
    assert speculator.num_free_blocks == 8


def test_vocabulary_size_mismatch_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    draft_dir = save_tiny_model(tmp_path / "draft", vocab_size=300)
    with pytest.raises(ConfigError, match="vocabulary of 300 ids, the target 512"):
        DraftModelSpeculator(K, _context(tiny_model_dir, draft_dir))


def test_other_tokenizer_of_the_same_size_is_a_clear_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    draft_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "draft"))
    tokenizer_file = draft_dir / "tokenizer.json"
    tokenizer: dict[str, Any] = json.loads(tokenizer_file.read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (token for token, token_id in vocab.items() if token_id in (10, 11))
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two byte tokens swap ids
    tokenizer_file.write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="another tokenizer than the target \\(id 10 is"):
        DraftModelSpeculator(K, _context(tiny_model_dir, draft_dir))


def test_needs_an_engine() -> None:
    with pytest.raises(ConfigError, match="needs a SpeculatorContext"):
        DraftModelSpeculator(K)


def test_passes_check_speculator(context: SpeculatorContext) -> None:
    check_speculator(
        lambda num_speculative_tokens: DraftModelSpeculator(num_speculative_tokens, context),
        num_speculative_tokens=K,
        vocab_size=VOCAB_SIZE,
    )
