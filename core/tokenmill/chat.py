"""`tokenmill chat`: a conversation in the terminal, with a served or an in-process model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import click

from tokenmill.config import EngineConfig


def _stream_from_server(url: str, messages: list[dict[str, str]], max_tokens: int, temperature: float,
                        api_key: str | None) -> Iterator[str]:  # fmt: skip
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=None) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "stream": True}  # fmt: skip
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise click.ClickException(response.json()["error"]["message"])
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event: dict[str, Any] = json.loads(line[len("data: ") :])
                if "error" in event:
                    raise click.ClickException(event["error"]["message"])
                for choice in event.get("choices", []):
                    yield choice["delta"].get("content") or ""


def run_chat(config: EngineConfig, url: str | None, system: str | None, max_tokens: int, temperature: float) -> None:
    from tokenmill.sampling_params import SamplingParams

    llm = None
    if url is None:
        from tokenmill.llm import LLM

        llm = LLM.from_config(config)
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    click.echo("tokenmill chat: /reset starts over, /exit quits.")
    while True:
        try:
            text = click.prompt(click.style("you", bold=True), prompt_suffix="> ")
        except (EOFError, click.Abort):
            click.echo()
            return
        if text.strip() == "/exit":
            return
        if text.strip() == "/reset":
            history = history[:1] if system else []
            continue
        history.append({"role": "user", "content": text})
        click.echo(click.style("model", bold=True) + "> ", nl=False)
        if url is not None:
            reply = ""
            for delta in _stream_from_server(url, history, max_tokens, temperature, config.server.api_key):
                click.echo(delta, nl=False)
                reply += delta
        else:
            assert llm is not None
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
            reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
            click.echo(reply, nl=False)
        click.echo()
        history.append({"role": "assistant", "content": reply})
