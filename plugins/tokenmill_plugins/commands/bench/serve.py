"""A load generator for any OpenAI-compatible server: ``tokenmill bench serve``.

Requests stream from ``/v1/completions`` (token-id prompts of exact lengths) or
``/v1/chat/completions`` (random-word prompts of about that many tokens). They
are sent at seeded Poisson arrival times, at most ``concurrency`` at once, and
each one's TTFT, inter-token latencies and end-to-end latency are recorded from
the arrival times of its content chunks. A failed request is recorded with its
error and never stops the run. This module must not import torch: it runs on
machines that only have the client.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import httpx
from tqdm import tqdm

from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.metrics import RequestRecord, build_report, inter_token_latencies, summarize_serve
from tokenmill_plugins.commands.bench.workload import arrival_times, random_texts, random_token_ids, sample_lengths

logger = logging.getLogger(__name__)

Endpoint = Literal["completions", "chat"]
_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_MAX_ERROR_CHARS = 200


class BenchmarkError(TokenmillError):
    """The benchmark cannot start (server unreachable, no model to name); the message says what to pass."""


def check_parts(parts: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    """Raise ``BenchmarkError`` unless ``parts`` is a non-empty choice among ``allowed`` (a command's ``--parts``)."""
    if not parts or not set(parts) <= set(allowed):
        raise BenchmarkError(f"parts={','.join(parts)!r} is invalid: choose from {', '.join(allowed)}")


def base_url(url: str) -> str:
    """``url`` as http://host:port: a trailing / or /v1 dropped."""
    return url.rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class ServeOptions:
    """The parameters of one ``bench serve`` run; all but ``api_key`` go into the report."""

    url: str
    num_requests: int
    input_len: int
    output_len: int
    concurrency: int = 1
    model: str | None = None
    request_rate: float = math.inf  # requests/s; inf sends them all at once
    mixed: bool = False
    seed: int = 0
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    timeout_s: float = 600.0  # per request
    show_progress: bool = True
    #: Explicit token-id prompts, one per request (completions only), instead of random ones of
    #: ``input_len``; the comparison suite's shared-prefix scenario sends them. Not written to the report.
    prompts: list[list[int]] | None = None
    #: Fields added to every request's body (``bench structured`` sends a ``response_format``), in the report.
    extra_body: dict[str, Any] | None = None
    #: Model names the requests cycle through (request ``i`` names ``models[i % len(models)]``: ``bench lora``
    #: spreads them over adapters) instead of ``model`` for all.
    models: tuple[str, ...] | None = None
    #: The model's vocabulary, when the caller knows it: random token-id prompts stay below it (a model with a
    #: small vocabulary refuses ids beyond). Unset: below ``workload.MAX_TOKEN_ID``.
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, Any, str]] = [
            (self.num_requests >= 1, "num_requests", self.num_requests, "at least 1"),
            (self.input_len >= 1, "input_len", self.input_len, "at least 1"),
            (self.output_len >= 1, "output_len", self.output_len, "at least 1"),
            (self.concurrency >= 1, "concurrency", self.concurrency, "at least 1"),
            (self.request_rate > 0, "request_rate", self.request_rate, "positive, or inf"),
            (self.endpoint in _PATHS, "endpoint", self.endpoint, "'completions' or 'chat'"),
        ]
        if self.prompts is not None:
            checks += [
                (len(self.prompts) == self.num_requests, "prompts", len(self.prompts), "one per request"),
                (self.endpoint == "completions", "endpoint", self.endpoint, "'completions' with explicit prompts"),
                (all(len(p) >= 1 for p in self.prompts), "prompts", "an empty prompt", "at least 1 token each"),
            ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise BenchmarkError(f"{name}={value!r} is invalid: must be {allowed}")

    @property
    def base_url(self) -> str:
        return base_url(self.url)

    def parameters(self, model: str) -> dict[str, Any]:
        hidden = ("api_key", "show_progress", "prompts")
        return {**{k: v for k, v in asdict(self).items() if k not in hidden}, "model": model}


@dataclass(frozen=True)
class BenchRequest:
    payload: dict[str, Any]  # the JSON body, less "model"
    num_prompt_tokens: int
    max_tokens: int


def make_requests(options: ServeOptions) -> list[BenchRequest]:
    """The run's requests, the same for the same options and seed."""
    n, seed = options.num_requests, options.seed
    input_lens = sample_lengths(n, options.input_len, seed=seed, mixed=options.mixed, stream=0)
    output_lens = sample_lengths(n, options.output_len, seed=seed, mixed=options.mixed, stream=1)
    if options.prompts is not None:
        prompts: list[Any] = options.prompts
        input_lens, key = [len(p) for p in options.prompts], "prompt"
    elif options.endpoint == "chat":
        # Chat takes no token ids; the usage chunk tells the true prompt length.
        prompts = [[{"role": "user", "content": text}] for text in random_texts(input_lens, seed=seed)]
        key = "messages"
    else:
        prompts, key = random_token_ids(input_lens, seed=seed, vocab_size=options.vocab_size), "prompt"
    common = {
        "temperature": 0,
        "ignore_eos": True,  # every request generates exactly max_tokens
        "stream": True,
        "stream_options": {"include_usage": True},
        **(options.extra_body or {}),
    }
    return [
        BenchRequest({key: prompt, "max_tokens": m, **common}, input_len, m)
        for prompt, input_len, m in zip(prompts, input_lens, output_lens, strict=True)
    ]


def alternate(
    base: ServeOptions, sides: dict[str, dict[str, Any]], concurrencies: Sequence[int], rounds: int
) -> dict[str, Any]:
    """``run_serve`` of each side (``base`` with that side's changes) at each concurrency, the sides alternated
    ``rounds`` times (the machine's drift meets both). Per concurrency: each run's output tok/s and ITL p50,
    and the second side over the first: best tok/s (``throughput_ratio``), median ITL p50 (``itl_p50_ratio``).
    A failed request raises ``BenchmarkError``: a ratio over fewer requests would mislead."""
    first, second = sides
    results: dict[str, Any] = {}
    for concurrency in concurrencies:
        runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for _ in range(rounds):
            for side, changes in sides.items():
                options = replace(base, concurrency=concurrency, num_requests=max(2 * concurrency, 8), **changes)
                summary = run_serve(options)["results"]
                if summary["num_failed"]:
                    raise BenchmarkError(f"{summary['num_failed']} {side} requests failed at concurrency "
                                         f"{concurrency}: {summary['errors']}")  # fmt: skip
                runs[side].append({"output_throughput": summary["output_throughput"],
                                   "itl_p50_ms": summary["itl_ms"]["p50"]})  # fmt: skip
        best = {side: max(r["output_throughput"] for r in rs) for side, rs in runs.items()}
        itl = {side: statistics.median(r["itl_p50_ms"] for r in rs) for side, rs in runs.items()}
        results[str(concurrency)] = {
            "runs": runs,
            "throughput_ratio": best[second] / best[first],
            "itl_p50_ratio": itl[second] / itl[first],
        }
    return results


def run_serve(options: ServeOptions) -> dict[str, Any]:
    """Run the benchmark to the end and return its report (see ``metrics.build_report``)."""
    return asyncio.run(_run(options))


async def _run(options: ServeOptions) -> dict[str, Any]:
    requests = make_requests(options)
    offsets = arrival_times(options.num_requests, options.request_rate, seed=options.seed)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    # The pool must allow `concurrency` streams at once; httpx's default is 100.
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=options.timeout_s, limits=limits) as client:
        model = options.model or await _first_model(client, options.base_url)
        url = options.base_url + _PATHS[options.endpoint]
        logger.info("benchmarking %s (model %s) with %d requests", url, model, options.num_requests)
        semaphore = asyncio.Semaphore(options.concurrency)
        records = [RequestRecord(r.num_prompt_tokens, r.max_tokens) for r in requests]
        with tqdm(total=len(requests), desc="requests", unit="req", disable=not options.show_progress) as progress:
            start = time.perf_counter()

            async def one(i: int) -> None:
                delay = start + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                name = options.models[i % len(options.models)] if options.models else model
                async with semaphore:
                    await _send(client, url, {"model": name, **requests[i].payload}, records[i])
                progress.update(1)

            await asyncio.gather(*(one(i) for i in range(len(requests))))
            duration = time.perf_counter() - start
    _warn_about(records)
    summary = summarize_serve(records, duration)
    report = build_report("serve", options.parameters(model), summary)
    report["requests"] = [
        {
            "success": r.success,
            "error": r.error,
            "num_prompt_tokens": r.num_prompt_tokens,
            "num_output_tokens": r.num_output_tokens,
            "ttft_ms": r.ttft * 1000 if r.success else None,
            "e2e_ms": r.latency * 1000 if r.success else None,
        }
        for r in records
    ]
    return report


async def _first_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        response = await client.get(base_url + "/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchmarkError(
            f"could not read the model name from {base_url}/v1/models ({type(exc).__name__}: {exc}); "
            "check --url or pass --model"
        ) from None


async def _send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], record: RequestRecord) -> None:
    """Send one streaming request and fill in ``record``. Never raises."""
    chunk_times: list[float] = []
    chunk_cumulative: list[int | None] = []  # completion_tokens so far, when a server reports it per chunk
    usage: dict[str, Any] = {}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {_error_text(body)}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter() - start
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments and keep-alives
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = f"error in stream: {_error_text(data)}"
                    return
                usage = chunk.get("usage") or usage
                if _has_content(chunk):
                    chunk_times.append(now)
                    chunk_cumulative.append(chunk["usage"]["completion_tokens"] if chunk.get("usage") else None)
        end = time.perf_counter() - start
    except Exception as exc:  # any failure is this request's, never the run's
        record.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS] if str(exc) else type(exc).__name__
        return
    if not chunk_times:
        record.error = "the response had no content"
        return
    num_tokens = int(usage.get("completion_tokens") or len(chunk_times))
    per_chunk = None
    if all(c is not None for c in chunk_cumulative):
        cumulative = [0, *(int(c) for c in chunk_cumulative if c is not None)]
        per_chunk = [b - a for a, b in itertools.pairwise(cumulative)]
    record.success = True
    record.ttft = chunk_times[0]
    record.latency = end
    record.itls = inter_token_latencies(chunk_times, num_tokens, per_chunk)
    record.num_output_tokens = num_tokens
    record.num_prompt_tokens = int(usage.get("prompt_tokens") or record.num_prompt_tokens)


def _has_content(chunk: dict[str, Any]) -> bool:
    # Completions put text in choices[i].text, chat in choices[i].delta.content.
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def _error_text(body: str) -> str:
    """The message of an OpenAI-style error body, else the body itself, cut short."""
    text = body
    try:
        error = json.loads(body)
    except ValueError:
        error = None
    if isinstance(error, dict):
        error = error.get("error", error)
        if isinstance(error, dict) and (error.get("message") or error.get("detail")):
            text = str(error.get("message") or error.get("detail"))
    text = " ".join(text.split())
    return text[:_MAX_ERROR_CHARS] if text else "(empty body)"


def _warn_about(records: list[RequestRecord]) -> None:
    if not any(r.success for r in records):
        logger.warning("every request failed; first error: %s", records[0].error)
    short = sum(1 for r in records if r.success and r.num_output_tokens < r.max_tokens)
    if short:
        # A server that ignores ignore_eos stops early, and its throughput is not comparable.
        logger.warning("%d requests returned fewer tokens than max_tokens; does the server honour ignore_eos?", short)
