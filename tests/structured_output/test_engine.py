"""Structured outputs through the whole engine (scheduler, executor, sampler) on a tiny random model at
temperature 1.0: every output validates with ``jsonschema``, for both backends, in mixed batches, with n > 1,
preemption, prefix caching and ngram speculation; a backend that skips the mask fails the same check; a
constraint that cannot compile fails only its own request; compiles run off the engine loop, once per text."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import pytest
import torch
from tokenmill_plugins.structured_outputs.guidance import GuidanceBackend

from tests.factories import make_engine
from tests.structured_output.schemas import SCHEMAS, assert_valid
from tokenmill import hookimpl
from tokenmill.engine import EngineCore
from tokenmill.hookspecs import Register
from tokenmill.messages import EngineCoreRequest, TokenLogprobs
from tokenmill.plugin_manager import load_plugins
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputGrammar
from tokenmill.structured_output.validator import ConstraintValidator
from tokenmill.tokenizer import Tokenizer

BACKENDS = ["guidance", "xgrammar"]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_path(model_dir)


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request: pytest.FixtureRequest, model_dir: Path) -> EngineCore:
    return make_engine(model_dir, structured_outputs_config={"backend": request.param})


def _backend(engine: EngineCore) -> str:
    return engine.config.structured_outputs_config.backend


def _json(schema: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _params(constraint: StructuredOutputsParams | None, seed: int, **fields: Any) -> SamplingParams:
    fields = {"temperature": 1.0, "max_tokens": 80, **fields}
    return SamplingParams(seed=seed, structured_outputs=constraint, **fields)


class _Result:
    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.error: str | None = None
        self.finish_reason: str | None = None


def _run(
    engine: EngineCore, tokenizer: Tokenizer, params: list[SamplingParams], prompt: str = "hello"
) -> dict[str, _Result]:
    """Every request (and completion) to its end: tokens, logprobs, error, finish reason, by request id."""
    results: dict[str, _Result] = {}
    for i, p in enumerate(params):
        engine.add_request(EngineCoreRequest(f"r{i}", tokenizer.encode(prompt), p, list(tokenizer.eos_token_ids), i))
    while engine.has_unfinished_requests():
        for output in engine.step():
            result = results.setdefault(output.request_id, _Result())
            result.token_ids += output.new_token_ids
            result.logprobs += output.new_logprobs or []
            result.error = result.error or output.error
            result.finish_reason = output.finish_reason or result.finish_reason
    return results


def _texts(results: dict[str, _Result], tokenizer: Tokenizer) -> dict[str, str]:
    for request_id, result in results.items():
        assert result.error is None, (request_id, result.error)
    return {k: tokenizer.decode(r.token_ids, skip_special_tokens=True) for k, r in results.items()}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_against_its_schema(engine: EngineCore, tokenizer: Tokenizer, name: str) -> None:
    schema = SCHEMAS[name]
    texts = _texts(_run(engine, tokenizer, [_params(_json(schema), seed) for seed in range(6)]), tokenizer)
    for text in texts.values():
        assert_valid(text, schema, _backend(engine))
    assert len(set(texts.values())) > 1  # temperature 1.0 really samples


def test_regex_choice_and_grammar(engine: EngineCore, tokenizer: Tokenizer) -> None:
    constraints = {
        "regex": StructuredOutputsParams(regex=r"[a-c]{2,5}@(x|yz)"),
        "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        # GBNF: xgrammar's own syntax, which llguidance converts to Lark.
        "grammar": StructuredOutputsParams(grammar='root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'),
    }
    checks = {
        "regex": lambda text: re.fullmatch(r"[a-c]{2,5}@(x|yz)", text),
        "choice": lambda text: text in ("yes", "no", "maybe"),
        "grammar": lambda text: re.fullmatch(r"\(\d(\+\d)*\)", text),
    }
    for kind, constraint in constraints.items():
        texts = _texts(_run(engine, tokenizer, [_params(constraint, seed) for seed in range(4)]), tokenizer)
        assert all(checks[kind](text) for text in texts.values()), (kind, texts)


class _NoMaskGrammar(StructuredOutputGrammar):
    """A planted bug: allows every token and accepts whatever comes."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return True

    def validate_tokens(self, token_ids: list[int]) -> int:
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        pass  # the row stays all-allowed

    def is_terminated(self) -> bool:
        return False


class NoMaskBackend(GuidanceBackend):
    name: ClassVar[str] = "no-mask"

    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        return _NoMaskGrammar()


class SlowBackend(GuidanceBackend):
    name: ClassVar[str] = "slow"

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        time.sleep(1.0)
        return super().compile_grammar(params)


class _PlantedPlugin:
    @hookimpl
    def tokenmill_register_structured_outputs_backends(self, register: Register) -> None:
        register("no-mask", f"{__name__}:NoMaskBackend")
        register("slow", f"{__name__}:SlowBackend")


def _planted_engine(model_dir: Path, backend: str) -> EngineCore:
    plugins = load_plugins(extra_plugins=[("planted", _PlantedPlugin())])
    return make_engine(model_dir, plugins, structured_outputs_config={"backend": backend})


def test_a_backend_that_skips_the_mask_fails_the_validity_check(model_dir: Path, tokenizer: Tokenizer) -> None:
    engine = _planted_engine(model_dir, "no-mask")
    schema = SCHEMAS["flat"]
    texts = _texts(_run(engine, tokenizer, [_params(_json(schema), seed) for seed in range(3)]), tokenizer)
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # json.JSONDecodeError is a ValueError
        for text in texts.values():
            assert_valid(text, schema)


def test_mixed_batch_leaves_free_requests_as_they_are(engine: EngineCore, tokenizer: Tokenizer) -> None:
    schema = SCHEMAS["enum_and_array"]
    free = [_params(None, seed, max_tokens=12) for seed in range(3)]
    alone = _texts(_run(engine, tokenizer, free), tokenizer)
    mixed = _texts(_run(engine, tokenizer, [*free, *(_params(_json(schema), s) for s in range(3))]), tokenizer)
    assert [mixed[f"r{i}"] for i in range(3)] == [alone[f"r{i}"] for i in range(3)]
    for i in range(3, 6):
        assert_valid(mixed[f"r{i}"], schema, _backend(engine))


def test_n4_gives_four_valid_completions(engine: EngineCore, tokenizer: Tokenizer) -> None:
    schema = SCHEMAS["nested"]
    texts = _texts(_run(engine, tokenizer, [_params(_json(schema), 5, n=4)]), tokenizer)
    assert sorted(texts) == ["r0", "r0#1", "r0#2", "r0#3"]
    for text in texts.values():
        assert_valid(text, schema, _backend(engine))
    assert len(set(texts.values())) > 1


def test_logprobs_are_those_of_the_masked_distribution(engine: EngineCore, tokenizer: Tokenizer) -> None:
    choices = ["yes", "no"]
    results = _run(engine, tokenizer, [_params(StructuredOutputsParams(choice=choices), 1, logprobs=5)])
    first = results["r0"].logprobs[0]
    allowed = {t for t in range(tokenizer.vocab_size) if any(c.startswith(tokenizer.decode([t])) for c in choices)}
    finite = [(t, lp) for t, lp in zip(first.top_token_ids, first.top_logprobs, strict=True) if lp > float("-inf")]
    assert finite and {t for t, _ in finite} <= allowed
    assert sum(torch.tensor([lp for _, lp in finite]).exp().tolist()) == pytest.approx(1.0, abs=1e-4)
    assert first.logprob > float("-inf")


def test_preemption_and_prefix_caching_keep_each_matcher_right(model_dir: Path, tokenizer: Tokenizer) -> None:
    schema = SCHEMAS["flat"]
    prompt = "the same prompt for everyone, long enough to fill a few blocks"
    params = [_params(_json(schema), seed) for seed in range(8)]
    roomy = _texts(_run(make_engine(model_dir), tokenizer, params, prompt), tokenizer)
    tight = make_engine(model_dir, cache={"num_kv_blocks": 64}, scheduler={"max_num_batched_tokens": 32})
    squeezed = _texts(_run(tight, tokenizer, params, prompt), tokenizer)
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert squeezed == roomy  # seeded: the same tokens whatever the batch, preempted or not
    for text in squeezed.values():
        assert_valid(text, schema)


def test_a_constraint_that_cannot_compile_fails_only_its_request(engine: EngineCore, tokenizer: Tokenizer) -> None:
    bad = [StructuredOutputsParams(json={"type": "strin"}), StructuredOutputsParams(regex="a(b")]
    results = _run(engine, tokenizer, [_params(bad[0], 0), _params(None, 1, max_tokens=4), _params(bad[1], 2)])
    assert results["r0"].error is not None and results["r0"].error.startswith("structured_outputs: ")
    assert results["r2"].error is not None and results["r0"].finish_reason == "abort"
    assert results["r1"].error is None and len(results["r1"].token_ids) == 4
    # And the engine keeps serving constrained requests.
    texts = _texts(_run(engine, tokenizer, [_params(_json(SCHEMAS["flat"]), 3)]), tokenizer)
    assert_valid(texts["r0"], SCHEMAS["flat"], _backend(engine))


def test_compiles_run_off_the_loop_and_once_per_constraint(model_dir: Path, tokenizer: Tokenizer) -> None:
    engine = _planted_engine(model_dir, "slow")
    schema = SCHEMAS["flat"]
    params = [_params(_json(schema), 0), _params(None, 1, max_tokens=3), _params(_json(schema), 2)]
    for i, p in enumerate(params):
        engine.add_request(EngineCoreRequest(f"r{i}", tokenizer.encode("hi"), p, list(tokenizer.eos_token_ids), i))
    started = time.monotonic()
    finished_at: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished_at[output.request_id] = time.monotonic() - started
    assert finished_at["r1"] < 0.9 < min(finished_at["r0"], finished_at["r2"])  # served while the grammar compiled
    assert engine.structured_outputs.num_compiles == 1 and engine.structured_outputs.num_cache_hits == 1


def test_ngram_speculation_keeps_greedy_output_and_validity(model_dir: Path, tokenizer: Tokenizer) -> None:
    schema = SCHEMAS["flat"]
    example = '{"age":12,"name":"abc","ok":true}'
    prompt = f"{example} {example} {example}"
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    speculative = make_engine(model_dir, speculative_config=spec)
    plain = make_engine(model_dir)
    greedy = [SamplingParams(temperature=0, max_tokens=80, structured_outputs=_json(schema))]
    assert _texts(_run(speculative, tokenizer, greedy, prompt), tokenizer) == _texts(
        _run(plain, tokenizer, greedy, prompt), tokenizer
    )
    sampled = _texts(_run(speculative, tokenizer, [_params(_json(schema), s) for s in range(6)], prompt), tokenizer)
    for text in sampled.values():
        assert_valid(text, schema)
    stats = speculative.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_prepare_builds_the_backend_once_before_any_constrained_request(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    manager = engine.structured_outputs
    built: list[object] = []
    make = manager._make_backend
    manager._make_backend = lambda: built.append(make()) or built[-1]  # type: ignore[method-assign,func-returns-value]
    manager.prepare()
    manager.prepare()  # once
    assert manager._prepared is not None and manager._prepared.result(timeout=60) is built[0]
    constraint = StructuredOutputsParams(regex="[ab]{3}")
    manager.request(constraint).is_ready()
    assert len(built) == 1 and manager.backend() is built[0]


def test_the_front_ends_validator_builds_its_backend_when_prepared(model_dir: Path, tokenizer: Tokenizer) -> None:
    validator = ConstraintValidator(load_plugins(), "guidance", tokenizer, tokenizer.vocab_size)
    assert validator._backend is None
    validator.prepare()
    deadline = time.monotonic() + 60
    while validator._backend is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert validator._backend is not None
    with pytest.raises(ValueError):
        validator.validate(StructuredOutputsParams(regex="(unclosed"))
