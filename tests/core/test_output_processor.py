"""Detokenization and stop strings on engine outputs, with the default model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.messages import EngineCoreOutput, TokenLogprobs
from tokenmill.output_processor import OutputProcessor
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer

TEXT = "Hello world, this is the END of it"


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm2_gguf)


def _stream(processor: OutputProcessor, request_id: str, token_ids: list[int], finish_reason: str = "length"):
    """Feed tokens one step at a time, as the engine would; returns every ProcessedStep."""
    steps = []
    for position, token_id in enumerate(token_ids):
        last = position == len(token_ids) - 1
        output = EngineCoreOutput(request_id, [token_id], finish_reason=finish_reason if last else None)
        steps.append(processor.process([output]))
        if steps[-1].to_abort:
            break
    return steps


def test_text_streams_to_the_full_decode(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Tea 🍵 or 咖啡? Both!")
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams())
    _stream(processor, "r", token_ids)
    assert request.outputs[0].text == "Tea 🍵 or 咖啡? Both!"
    assert request.outputs[0].token_ids == token_ids
    assert request.finished and request.outputs[0].finish_reason == "length"
    assert not processor.has_unfinished()


def test_stop_string_across_token_boundaries_is_cut_and_aborted(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(TEXT)
    assert tokenizer.convert_ids_to_tokens(token_ids)[5:8] == ["Ġthe", "ĠEND", "Ġof"]
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(stop=["never", "e END o"]))
    steps = _stream(processor, "r", token_ids)
    completion = request.outputs[0]
    assert completion.text == "Hello world, this is th"
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "e END o")
    assert steps[-1].to_abort == ["r"]
    assert len(steps) == 8  # processing stopped at the token that completed the stop string
    # The engine's abort echo does not change the finished completion.
    processor.process([EngineCoreOutput("r", [], finish_reason="abort")])
    assert completion.finish_reason == "stop" and completion.text == "Hello world, this is th"


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(stop=["of it", "this"]))
    _stream(processor, "r", tokenizer.encode(TEXT))
    assert request.outputs[0].text == "Hello world, "
    assert request.outputs[0].stop_reason == "this"


def test_stop_token_id_is_reported(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(TEXT)
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(stop_token_ids=[token_ids[3]]))
    _stream(processor, "r", token_ids[:4], finish_reason="stop")
    assert request.outputs[0].finish_reason == "stop"
    assert request.outputs[0].stop_reason == token_ids[3]


def test_n_completions_are_grouped_in_index_order(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(n=2))
    a, b = tokenizer.encode(" yes"), tokenizer.encode(" no")
    processor.process(
        [
            EngineCoreOutput("r#1", b, finish_reason="length", parent_id="r", index=1),
            EngineCoreOutput("r", a[:1]),
        ]
    )
    assert not request.finished
    processor.process([EngineCoreOutput("r", a[1:], finish_reason="length")])
    assert [(c.index, c.text) for c in request.outputs] == [(0, " yes"), (1, " no")]
    assert request.finished and not processor.has_unfinished()


def test_a_request_is_not_finished_while_a_sibling_is_on_its_way(tokenizer: Tokenizer) -> None:
    """The server feeds a request's outputs one at a time: completion 0 ending on its first token (a stop
    string) must not finish the request before completion 1's first output arrives (a soak found n=2
    answered with one choice)."""
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(n=2, stop=[" the"]))
    step = processor.process([EngineCoreOutput("r", tokenizer.encode(" the"))])
    assert step.to_abort == ["r"] and request.outputs[0].finished
    assert not request.finished and processor.has_unfinished()
    processor.process([EngineCoreOutput("r#1", tokenizer.encode(" cat"), parent_id="r", index=1)])
    assert not request.finished
    processor.process([EngineCoreOutput("r#1", [], finish_reason="length", parent_id="r", index=1)])
    assert request.finished and [c.finish_reason for c in request.outputs] == ["stop", "length"]


def test_logprobs_are_decoded(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(logprobs=2))
    hello, world = tokenizer.encode("Hello world")
    processor.process(
        [EngineCoreOutput("r", [hello], [TokenLogprobs(hello, -0.5, (hello, world), (-0.5, -1.5))], "length")]
    )
    (entry,) = request.outputs[0].logprobs
    assert {token_id: (lp.logprob, lp.decoded_token) for token_id, lp in entry.items()} == {
        hello: (-0.5, "Hello"),
        world: (-1.5, " world"),
    }


def test_deltas_are_released_once_and_add_up_to_the_text(tokenizer: Tokenizer) -> None:
    """Each delta is new text only (never taken back); together they are the completion's text."""
    token_ids = tokenizer.encode(TEXT)
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(stop=["END!", "zzz"]))
    steps = _stream(processor, "r", token_ids)
    deltas = [delta for step in steps for delta in step.deltas]
    assert "".join(d.text for d in deltas) == request.outputs[0].text == TEXT
    assert [d.text_offset for d in deltas] == [sum(len(x.text) for x in deltas[:i]) for i in range(len(deltas))]
    assert [t for d in deltas for t in d.token_ids] == token_ids
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_only_a_possible_stop_string_start_is_held_back(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], SamplingParams(stop=["END!"]))
    released = []
    for token_id in tokenizer.encode("Hello world, this is the END of it"):
        (step,) = [processor.process([EngineCoreOutput("r", [token_id])])]
        released.append("".join(d.text for d in step.deltas))
    # "END" could begin "END!": held until " of" shows it does not; everything else goes out at once.
    assert released[:5] == ["Hello", " world", ",", " this", " is"]
    assert released[5:8] == [" the", " ", "END of"]


def test_a_stop_string_in_one_of_n_completions_leaves_the_others_running(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(n=2, stop=[" world"]))
    hello, world, comma = tokenizer.encode("Hello world,")[:3]
    step = processor.process([EngineCoreOutput("r", [hello]), EngineCoreOutput("r#1", [hello], parent_id="r", index=1)])
    step = processor.process([EngineCoreOutput("r", [world]), EngineCoreOutput("r#1", [comma], parent_id="r", index=1)])
    assert step.to_abort == ["r"]  # completion 0 only: the caller aborts it with completions_only
    assert [c.finish_reason for c in request.outputs] == ["stop", None] and processor.has_unfinished()
    processor.process([EngineCoreOutput("r#1", [hello], finish_reason="length", parent_id="r", index=1)])
    assert [c.text for c in request.outputs] == ["Hello", "Hello,Hello"] and not processor.has_unfinished()


def test_an_n_request_aborted_before_it_forked_is_done_with_one_completion(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(n=3))
    processor.process([EngineCoreOutput("r", [], finish_reason="abort", request_finished=True)])
    assert request.finished and len(request.outputs) == 1 and not processor.has_unfinished()


# ---------------------------------------------------------------- logprobs that line up with the text


def _stream_with_logprobs(
    processor: OutputProcessor, token_ids: list[int], finish_reason: str, chunk: int = 1
) -> list[list[str]]:
    """Feed tokens ``chunk`` per step with a logprob each; returns each delta's text-token texts."""
    released = []
    for start in range(0, len(token_ids), chunk):
        ids = token_ids[start : start + chunk]
        last = start + chunk >= len(token_ids)
        logprobs = [TokenLogprobs(token_id=t, logprob=-1.0) for t in ids]
        output = EngineCoreOutput("r", ids, finish_reason=finish_reason if last else None, new_logprobs=logprobs)
        step = processor.process([output])
        for delta in step.deltas:
            assert delta.text_tokens is not None
            assert "".join(t.text for t in delta.text_tokens) == delta.text  # every delta lines up on its own
            released.append([t.text for t in delta.text_tokens])
        if step.to_abort:
            break
    return released


@pytest.mark.parametrize("chunk", [1, 3])
def test_text_tokens_concatenate_to_the_text_and_leave_out_eos(tokenizer: Tokenizer, chunk: int) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    token_ids = [*tokenizer.encode("Tea 🍵 or 咖啡?"), eos]
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(logprobs=0))
    _stream_with_logprobs(processor, token_ids, "stop", chunk)
    completion = request.outputs[0]
    assert completion.text_tokens is not None
    assert "".join(t.text for t in completion.text_tokens) == completion.text == "Tea 🍵 or 咖啡?"
    assert eos not in [t.token_id for t in completion.text_tokens]  # its text is not returned
    assert completion.token_ids == token_ids  # the engine's view keeps it (and usage counts it)
    # The emoji is several tokens: the first ones add "" and the last the whole character.
    texts = [t.text for t in completion.text_tokens]
    last = next(i for i, text in enumerate(texts) if "🍵" in text)
    assert texts[last - 1] == "" and texts[last].endswith("🍵")


def test_text_tokens_end_where_a_stop_string_cuts_the_text(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    request = processor.add_request("r", None, [1], SamplingParams(logprobs=0, stop=["e END o"]))
    _stream_with_logprobs(processor, tokenizer.encode(TEXT), "length")
    completion = request.outputs[0]
    assert completion.text == "Hello world, this is th"
    assert completion.text_tokens is not None
    # " the" is cut to " th"; " END" and " of" are not in the text, so they have no entry.
    assert [t.text for t in completion.text_tokens] == ["Hello", " world", ",", " this", " is", " th"]


def test_text_tokens_with_special_tokens_kept_include_eos(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos is not None
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(logprobs=0, skip_special_tokens=False)
    request = processor.add_request("r", None, [1], params)
    _stream_with_logprobs(processor, [*tokenizer.encode("Hi"), eos], "stop")
    completion = request.outputs[0]
    assert completion.text == "Hi<|im_end|>"
    assert completion.text_tokens is not None and [t.text for t in completion.text_tokens] == ["Hi", "<|im_end|>"]
