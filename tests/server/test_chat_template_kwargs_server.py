"""``chat_template_kwargs`` and ``--default-chat-template-kwargs`` through a real `tokenmill serve`, driven by the
official openai client: the template's branches (tests.tokenizer.thinking_model) show in the prompt the request
was run on (its ``usage.prompt_tokens``, and its text through /tokenize), the request's keys override the
server's default key by key, and a value that is not an object or names a variable the renderer sets itself is
a 400 naming ``chat_template_kwargs`` while the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import Server, start_server
from tests.tokenizer.thinking_model import PROMPT_START, THINKING_OFF, save_thinking_model
from tokenmill.tokenizer import Tokenizer

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

MESSAGES: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_thinking_model(tmp_path_factory.mktemp("kwargs") / "thinking")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("kwargs-server"), str(model_dir), "--served-model-name", "tiny",
        "--default-chat-template-kwargs", '{"persona": "a pirate"}', model_name="tiny",
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client


def _prompt_tokens(client: openai.OpenAI, **kwargs: Any) -> int:
    completion = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0, **kwargs)
    assert completion.usage is not None
    return completion.usage.prompt_tokens


@pytest.mark.parametrize(
    ("template_kwargs", "expected"),
    [
        (None, PROMPT_START + "As a pirate: "),  # the server's default alone
        ({"enable_thinking": False}, PROMPT_START + "As a pirate: " + THINKING_OFF),  # the default kept beside it
        ({"enable_thinking": True, "persona": "a parrot"}, PROMPT_START + "As a parrot: "),  # the request's key wins
    ],
    ids=["default", "request-and-default", "request-overrides"],
)
def test_the_template_sees_the_request_kwargs_over_the_servers_default(
    client: openai.OpenAI, server: Server, model_dir: Path, template_kwargs: dict[str, Any] | None, expected: str
) -> None:
    token_ids = Tokenizer.from_path(model_dir).encode(expected, add_special_tokens=False)
    extra_body = {} if template_kwargs is None else {"chat_template_kwargs": template_kwargs}
    assert _prompt_tokens(client, extra_body=extra_body) == len(token_ids)
    streamed = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body,
    )  # fmt: skip
    usages = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert [usage.prompt_tokens for usage in usages] == [len(token_ids)]
    # vLLM's /tokenize takes the same field: the ids the chat endpoint ran on, which read back as the branches.
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, **extra_body}, timeout=30).json()
    assert tokenized["tokens"] == token_ids
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}, timeout=30).json()["prompt"]
    assert text == expected


@pytest.mark.parametrize(
    ("template_kwargs", "message"),
    [
        ("enable_thinking", "invalid value for 'chat_template_kwargs': expected an object, got `str`"),
        ({"tools": []}, "chat_template_kwargs cannot set 'tools': messages, tools, documents and "),
        ({"add_generation_prompt": False}, "chat_template_kwargs cannot set 'add_generation_prompt'"),
    ],
    ids=["not-an-object", "tools", "add_generation_prompt"],
)
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(
    client: openai.OpenAI, template_kwargs: Any, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _prompt_tokens(client, extra_body={"chat_template_kwargs": template_kwargs})
    error = caught.value
    assert error.status_code == 400 and isinstance(error.body, dict)
    assert error.body["param"] == "chat_template_kwargs" and error.body["message"].startswith(message)
    assert _prompt_tokens(client) > 0  # the server keeps serving
