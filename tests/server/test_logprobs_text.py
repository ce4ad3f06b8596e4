"""Logprobs line up with the returned text, checked with the official openai client: in completions and chat,
streamed and not, whether the text ends at EOS, at a stop string or at max_tokens, the logprob entries' tokens
concatenate to exactly the text."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, Server

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

QUESTION = "What is the capital of France? Answer in one short sentence."
# (how the text ends, extra request fields): EOS within 64 tokens, a stop string, max_tokens.
ENDINGS: list[tuple[str, dict[str, Any]]] = [
    ("stop", {"max_tokens": 64}),
    ("stop", {"max_tokens": 64, "stop": [" Paris"]}),
    ("length", {"max_tokens": 5}),
]


@pytest.fixture(scope="module")
def client(default_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize(("finish_reason", "fields"), ENDINGS, ids=["eos", "stop-string", "max-tokens"])
def test_chat_logprob_tokens_concatenate_to_the_content(
    client: openai.OpenAI, default_server: Server, finish_reason: str, fields: dict[str, Any]
) -> None:
    messages: Any = [{"role": "user", "content": QUESTION}]
    common = {"model": default_server.model, "messages": messages, "temperature": 0, "logprobs": True,
              "top_logprobs": 2, **fields}  # fmt: skip
    full = client.chat.completions.create(**common)
    choice = full.choices[0]
    assert choice.finish_reason == finish_reason
    content = choice.message.content or ""
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert "".join(entry.token for entry in entries) == content
    assert bytes(b for entry in entries for b in entry.bytes or []) == content.encode()
    assert all(len(entry.top_logprobs) == 2 for entry in entries)
    assert "<|im_end|>" not in [entry.token for entry in entries]
    assert full.usage is not None and full.usage.completion_tokens >= len(entries)

    streamed_text, streamed_tokens = "", ""
    for chunk in client.chat.completions.create(**common, stream=True):
        for piece in chunk.choices:
            text = piece.delta.content or ""
            tokens = "".join(e.token for e in piece.logprobs.content or []) if piece.logprobs else ""
            assert tokens == text  # each chunk's entries are its own text's tokens
            streamed_text += text
            streamed_tokens += tokens
    assert streamed_text == streamed_tokens == content


@pytest.mark.parametrize(("finish_reason", "fields"), ENDINGS, ids=["eos", "stop-string", "max-tokens"])
def test_completion_logprob_tokens_concatenate_to_the_text(
    client: openai.OpenAI, default_server: Server, finish_reason: str, fields: dict[str, Any]
) -> None:
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    common = {"model": default_server.model, "prompt": prompt, "temperature": 0, "logprobs": 2, **fields}
    full = client.completions.create(**common)
    choice = full.choices[0]
    assert choice.finish_reason == finish_reason
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset or []
    assert "".join(tokens) == choice.text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert [len(top) for top in choice.logprobs.top_logprobs or []] == [2] * len(tokens)

    streamed_text, streamed_tokens = "", ""
    for chunk in client.completions.create(**common, stream=True):
        for piece in chunk.choices:
            streamed_text += piece.text
            streamed_tokens += "".join(piece.logprobs.tokens or []) if piece.logprobs else ""
    assert streamed_text == streamed_tokens == choice.text


def test_echo_returns_the_prompt_with_its_logprobs(client: openai.OpenAI, default_server: Server) -> None:
    prompt = "The capital of France is"
    common = {"model": default_server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**common).choices[0].text
    full = client.completions.create(**common, echo=True, logprobs=1).choices[0]
    assert full.text == prompt + plain
    assert full.logprobs is not None and full.logprobs.tokens is not None
    tokens, token_logprobs = full.logprobs.tokens, full.logprobs.token_logprobs or []
    assert "".join(tokens) == full.text
    num_prompt_tokens = len(tokens) - 4
    assert token_logprobs[0] is None and (full.logprobs.top_logprobs or [])[0] is None  # nothing precedes it
    assert all(lp is not None and lp <= 0 for lp in token_logprobs[1:])
    assert (full.logprobs.text_offset or [])[num_prompt_tokens] == len(prompt)  # the completion follows the prompt

    streamed = ""
    for chunk in client.completions.create(**common, echo=True, stream=True):
        streamed += "".join(choice.text for choice in chunk.choices)
    assert streamed == prompt + plain


def test_prompt_logprobs_as_vllm_returns_them(client: openai.OpenAI, default_server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = "One, two, three, four"
    ids = httpx.post(f"{default_server.url}/tokenize", json={"prompt": prompt}, headers=headers).json()["tokens"]
    completion = client.completions.create(
        model=default_server.model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    entries = completion.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token_id) in entry and entry[str(token_id)]["rank"] >= 1
        # The prompt token and the top 2 (one entry fewer when the prompt token is among them), ranked 1 and 2.
        assert len(entry) in (2, 3)
        assert {lp["rank"] for key, lp in entry.items() if key != str(token_id)} <= {1, 2}
    # A counting prompt is predictable: the model ranks the last prompt token (" four") first.
    assert entries[-1][str(ids[-1])]["rank"] == 1
    # The same logprobs as echo's for the prompt's tokens.
    echoed = client.completions.create(model=default_server.model, prompt=prompt, max_tokens=1, temperature=0,
                                       echo=True, logprobs=0).choices[0].logprobs  # fmt: skip
    assert echoed is not None and echoed.token_logprobs is not None
    for logprob, token_id, entry in zip(echoed.token_logprobs[1 : len(ids)], ids[1:], entries[1:], strict=True):
        assert logprob == pytest.approx(entry[str(token_id)]["logprob"], abs=1e-4)

    chat = client.chat.completions.create(
        model=default_server.model, messages=[{"role": "user", "content": prompt}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    chat_entries = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert chat.usage is not None and len(chat_entries) == chat.usage.prompt_tokens and chat_entries[0] is None
    assert all(len(entry) == 1 for entry in chat_entries[1:])  # the prompt token alone with 0 alternatives
