"""With a reasoning parser, a constrained request thinks freely and its grammar starts after ``</think>`` (vLLM's
behaviour): a planted logits processor makes the tiny model think a scripted ``hm...</think>`` (a mask from the
first token would forbid it: every logit would be -inf), then the output follows the regex and ends with it; a
prompt that already closed the thinking is constrained from its first token; n > 1 forks reason too."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from tests.factories import make_engine
from tokenmill import hookimpl
from tokenmill.engine import EngineCore
from tokenmill.hookspecs import Register
from tokenmill.messages import EngineCoreRequest
from tokenmill.plugin_manager import load_plugins
from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

REGEX = "[a-c]{4}"


class ScriptLogitsProcessor(LogitsProcessor):
    """Forces ``extra_args["script"][i]`` as a request's i-th output token, while the script lasts."""

    name: ClassVar[str] = "script"

    def is_active(self, row: SamplingRow) -> bool:
        script = (row.params.extra_args or {}).get("script", [])
        return len(row.output_token_ids) < len(script)

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        for row, state in zip(rows, states, strict=True):
            token_id = state.params.extra_args["script"][len(state.output_token_ids)]  # type: ignore[index]
            forced = torch.full_like(logits[row], float("-inf"))
            forced[token_id] = 0.0
            logits[row] = forced
        return logits


class _ScriptPlugin:
    @hookimpl
    def tokenmill_register_logits_processors(self, register: Register) -> None:
        register("script", f"{__name__}:ScriptLogitsProcessor")


@pytest.fixture(scope="module")
def engine(qwen_like_model: Path) -> EngineCore:
    plugins = load_plugins(extra_plugins=[("script", _ScriptPlugin())])
    return make_engine(
        qwen_like_model, plugins, sampler={"logits_processors": ["script"]}, parsers={"reasoning_parser": "qwen3"}
    )


def _run(engine: EngineCore, prompt: list[int], params: SamplingParams, eos: list[int]) -> dict[str, list[int]]:
    engine.add_request(EngineCoreRequest("r", prompt, params, eos, 0.0))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            tokens.setdefault(f"{output.request_id}/{output.index}", []).extend(output.new_token_ids)
    return tokens


def test_the_grammar_starts_after_the_thinking(engine: EngineCore, tokenizer: Tokenizer) -> None:
    script = [*tokenizer.encode("<think>hm, xyz 9"), tokenizer.token_to_id("</think>")]
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, n=2, extra_args={"script": script},
        structured_outputs=StructuredOutputsParams(regex=REGEX),
    )  # fmt: skip
    outputs = _run(engine, tokenizer.encode("hello"), params, list(tokenizer.eos_token_ids))
    assert len(outputs) == 2
    for token_ids in outputs.values():
        assert token_ids[: len(script)] == script
        text = tokenizer.decode(token_ids[len(script) :], skip_special_tokens=True)
        assert re.fullmatch(REGEX, text), text


def test_a_prompt_that_closed_the_thinking_is_constrained_at_once(engine: EngineCore, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("hello<think>\n\n</think>\n\n")
    params = SamplingParams(
        temperature=1.0, seed=5, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX)
    )
    (token_ids,) = _run(engine, prompt, params, list(tokenizer.eos_token_ids)).values()
    assert re.fullmatch(REGEX, tokenizer.decode(token_ids, skip_special_tokens=True))
