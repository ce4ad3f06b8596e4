"""``tokenmill bench soak``: mixed traffic for a long time, counting errors and watching memory.

``concurrency`` client loops send requests back to back until ``duration_s``
has passed. Each request is drawn from a seeded generator (the same seed
sends the same requests in the same order): chat or completions, streaming
or not, a prompt length and ``max_tokens`` drawn uniformly from their ranges
(a quarter of the prompts start with one of four shared "documents", so the
prefix cache is hit and evicted), a temperature, sometimes ``n`` > 1, stop
strings, logprobs or top_logprobs. A fraction (``abort_fraction``) is dropped
by the client at a random point: a stream after a random number of content
chunks (0: as soon as the headers arrive), a plain request after a random
part of the mean latency so far. Every answer is checked: one choice per
``n``, each with a finish reason, logprobs where asked, no stop string in the
text.

Outcomes: completed, aborted (by the client, as planned), rejected (HTTP 429,
counted apart: the server said it was full) and errors by kind: any other HTTP
status (``http-5xx``, ``http-4xx``), a connection the server dropped, a
timeout, an error event in a stream, an invalid answer.

Memory: a thread samples the RSS of every process of the server (the front
end, each engine, helpers; ``bench.process_rss``) and the engines' gauges from
``/metrics`` every ``sample_interval_s``, and at the end of the warm-up and of
the load. The warm-up is the first ``warmup_s`` seconds: the model's first
steps, the allocators' and caches' first fill, the first request of each
shape. RSS growth is measured from the sample at the end of the warm-up to the
last sample under load. After the load the soak waits for the engines to go
idle (nothing running or waiting, no KV block in use) and takes a last sample.

The report (``report.json``), the samples (``samples.csv``) and a plot of
RSS and KV cache usage over time (``rss.svg``) go to ``output_dir``.
This module imports no torch.
"""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.metrics import build_report, write_json
from tokenmill_plugins.commands.bench.process_rss import ProcessTree
from tokenmill_plugins.commands.bench.svg_chart import Panel, line_chart_svg
from tokenmill_plugins.commands.bench.workload import MAX_TOKEN_ID, MIN_TOKEN_ID, random_texts

logger = logging.getLogger(__name__)

_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_STOP_STRINGS = (" the", ".", "\n", " and", ",", " of")
_NUM_DOCUMENTS = 4  # shared prompt prefixes
_DOCUMENT_LEN = (64, 256)
_REJECTED_PAUSE_S = 0.2  # a loop whose request got 429 waits this long before its next
_IDLE_POLL_S = 0.5
_MAX_DETAIL_CHARS = 200
_MIB = 2**20

#: The engines' gauges (each summed over engines): a fraction of KV blocks in use, and request counts.
_KV_USAGE = "tokenmill:kv_cache_usage_perc"
_KV_TOUCHED = "tokenmill:kv_cache_touched_bytes"
_RUNNING = "tokenmill:num_requests_running"
_WAITING = "tokenmill:num_requests_waiting"


class SoakError(TokenmillError):
    """The soak cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class SoakOptions:
    """The parameters of one soak; all but ``api_key``, ``show_progress`` and ``server_pid`` go into the report."""

    base_url: str
    output_dir: Path
    duration_s: float = 300.0
    concurrency: int = 16
    warmup_s: float = 60.0
    sample_interval_s: float = 5.0
    input_len: tuple[int, int] = (16, 512)  # prompt tokens, drawn uniformly (inclusive)
    output_len: tuple[int, int] = (8, 256)  # max_tokens, drawn uniformly (inclusive)
    abort_fraction: float = 0.1
    seed: int = 0
    model: str | None = None  # unset: the first of GET /v1/models
    api_key: str | None = None
    timeout_s: float = 300.0  # per request
    idle_timeout_s: float = 60.0  # for the engines to go idle after the load
    max_rss_growth_pct: float = 5.0  # the check in the report
    server_pid: int | None = None  # the server's root process; None: no RSS samples
    show_progress: bool = True

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, Any, str]] = [
            (self.duration_s > 0, "duration", self.duration_s, "positive"),
            (0 <= self.warmup_s < self.duration_s, "warmup", self.warmup_s, "from 0 to less than --duration"),
            (self.sample_interval_s > 0, "sample_interval", self.sample_interval_s, "positive"),
            (self.concurrency >= 1, "concurrency", self.concurrency, "at least 1"),
            (1 <= self.input_len[0] <= self.input_len[1], "input_len", self.input_len, "1 <= MIN <= MAX"),
            (1 <= self.output_len[0] <= self.output_len[1], "output_len", self.output_len, "1 <= MIN <= MAX"),
            (0 <= self.abort_fraction <= 1, "abort_fraction", self.abort_fraction, "from 0 to 1"),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise SoakError(f"{name}={value!r} is invalid: must be {allowed}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    def parameters(self, model: str) -> dict[str, Any]:
        hidden = ("api_key", "show_progress", "server_pid")
        values = {k: v for k, v in asdict(self).items() if k not in hidden}
        return {**values, "output_dir": str(self.output_dir), "model": model}


# ------------------------------------------------------------------ the workload


@dataclass(frozen=True)
class SoakRequest:
    """One request of the soak: its body (less ``model``) and what to expect or do."""

    index: int
    endpoint: Literal["completions", "chat"]
    payload: dict[str, Any]
    abort_after_chunks: int | None = None  # a stream: drop it after this many content chunks
    abort_at: float | None = None  # a plain request: drop it after this fraction of the mean latency

    @property
    def stream(self) -> bool:
        return bool(self.payload.get("stream"))

    @property
    def n(self) -> int:
        return int(self.payload.get("n", 1))

    @property
    def stop(self) -> list[str]:
        return list(self.payload.get("stop") or [])

    @property
    def wants_logprobs(self) -> bool:
        return "logprobs" in self.payload

    @property
    def is_abort(self) -> bool:
        return self.abort_after_chunks is not None or self.abort_at is not None

    def shape(self) -> list[str]:
        """Tags for the report's count of what was sent."""
        tags = [self.endpoint, "stream" if self.stream else "non-stream"]
        tags += ["n>1"] * (self.n > 1) + ["stop"] * bool(self.stop) + ["logprobs"] * self.wants_logprobs
        return tags + ["planned-abort"] * self.is_abort


class SoakWorkload:
    """The soak's requests: ``request(i)`` is the same for the same options, whatever the timing."""

    def __init__(self, options: SoakOptions) -> None:
        self.options = options
        rng = np.random.default_rng([options.seed, 0x50AC, 0])
        self.documents: list[list[int]] = [  # shared prompt prefixes
            rng.integers(MIN_TOKEN_ID, MAX_TOKEN_ID, size=int(rng.integers(*_DOCUMENT_LEN))).tolist()
            for _ in range(_NUM_DOCUMENTS)
        ]

    def request(self, index: int) -> SoakRequest:
        """Request ``index`` of the soak."""
        options = self.options
        rng = np.random.default_rng([options.seed, 0x50AC, 1, index])
        prompt_len = int(rng.integers(options.input_len[0], options.input_len[1] + 1))
        max_tokens = int(rng.integers(options.output_len[0], options.output_len[1] + 1))
        endpoint: Literal["completions", "chat"] = "chat" if rng.random() < 0.5 else "completions"
        stream = bool(rng.random() < 0.5)
        n = int(rng.integers(2, 5)) if rng.random() < 0.25 else 1
        temperature = 0.0 if n == 1 and rng.random() < 0.3 else 0.8
        payload: dict[str, Any] = {"max_tokens": max_tokens, "temperature": temperature, "n": n, "seed": index}
        if rng.random() < 0.3:
            picks = rng.choice(len(_STOP_STRINGS), size=int(rng.integers(1, 3)), replace=False)
            payload["stop"] = [_STOP_STRINGS[i] for i in sorted(picks)]
        if rng.random() < 0.3:
            if endpoint == "chat":
                payload["logprobs"] = True
                payload["top_logprobs"] = int(rng.integers(0, 6))
            else:
                payload["logprobs"] = int(rng.integers(0, 6))
        if stream:
            payload["stream"] = True
            payload["stream_options"] = {"include_usage": True}
        document = self.documents[int(rng.integers(len(self.documents)))] if rng.random() < 0.25 else []
        text_seed = int(rng.integers(2**62))
        if endpoint == "chat":
            messages = [{"role": "user", "content": random_texts([prompt_len], seed=text_seed)[0]}]
            if document:
                messages.insert(0, {"role": "system", "content": random_texts([len(document)], seed=len(document))[0]})
            payload["messages"] = messages
        elif rng.random() < 0.5:
            payload["prompt"] = document + rng.integers(MIN_TOKEN_ID, MAX_TOKEN_ID, size=prompt_len).tolist()
        else:
            payload["prompt"] = random_texts([prompt_len], seed=text_seed)[0]
        abort_after_chunks = abort_at = None
        if rng.random() < options.abort_fraction:
            if stream:
                abort_after_chunks = int(rng.integers(0, max_tokens + 1))
            else:
                abort_at = float(rng.random())
        return SoakRequest(index, endpoint, payload, abort_after_chunks, abort_at)


# ------------------------------------------------------------------ one request


@dataclass
class Outcome:
    """What became of one request."""

    status: Literal["completed", "aborted", "rejected", "error"]
    error_kind: str | None = None
    detail: str = ""
    output_tokens: int = 0
    latency_s: float = 0.0
    abort_missed: bool = False  # an abort was planned but the answer came first


class _Invalid(Exception):
    """The answer broke the API's promises (wrong number of choices, stop string in the text, ...)."""


def _error(kind: str, detail: str) -> Outcome:
    return Outcome("error", kind, " ".join(detail.split())[:_MAX_DETAIL_CHARS])


def _status_outcome(status: int, body: bytes) -> Outcome:
    text = body.decode(errors="replace")
    if status == 429:
        return Outcome("rejected", detail=text[:_MAX_DETAIL_CHARS])
    return _error(f"http-{status // 100}xx", f"HTTP {status}: {text}")


def _check_choices(request: SoakRequest, texts: dict[int, str], finishes: dict[int, str], logprobs: set[int]) -> None:
    if sorted(finishes) != list(range(request.n)):
        raise _Invalid(f"finish reasons for choices {sorted(finishes)}, expected {request.n} choices")
    for index, reason in finishes.items():
        if reason not in ("stop", "length"):
            raise _Invalid(f"choice {index} finished with {reason!r}")
        text = texts.get(index, "")
        if found := [s for s in request.stop if s in text]:
            raise _Invalid(f"choice {index} contains the stop string {found[0]!r}: {text[-80:]!r}")
        if request.wants_logprobs and text and index not in logprobs:
            raise _Invalid(f"choice {index} has no logprobs")


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


async def _stream(client: httpx.AsyncClient, url: str, request: SoakRequest, body: dict[str, Any]) -> Outcome:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    logprobs: set[int] = set()
    usage: dict[str, Any] = {}
    chunks = 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return _status_outcome(response.status_code, await response.aread())
        if request.abort_after_chunks == 0:
            return Outcome("aborted")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                return _error("stream-error", data)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                index = int(choice["index"])
                piece = _choice_text(choice)
                texts[index] = texts.get(index, "") + piece
                chunks += bool(piece)
                if choice.get("logprobs"):
                    logprobs.add(index)
                if choice.get("finish_reason"):
                    finishes[index] = choice["finish_reason"]
            if request.abort_after_chunks is not None and chunks >= request.abort_after_chunks:
                return Outcome("aborted")  # leaving the block closes the connection mid-stream
        else:
            return _error("truncated-stream", "the stream ended without [DONE]")
    _check_choices(request, texts, finishes, logprobs)
    return Outcome("completed", output_tokens=int(usage.get("completion_tokens") or 0))


async def _plain(client: httpx.AsyncClient, url: str, request: SoakRequest, body: dict[str, Any]) -> Outcome:
    response = await client.post(url, json=body)
    if response.status_code != 200:
        return _status_outcome(response.status_code, response.content)
    answer = response.json()
    choices = answer.get("choices") or []
    texts = {int(c["index"]): _choice_text(c) for c in choices}
    finishes = {int(c["index"]): c.get("finish_reason") for c in choices}
    logprobs = {int(c["index"]) for c in choices if c.get("logprobs")}
    _check_choices(request, texts, finishes, logprobs)
    return Outcome("completed", output_tokens=int((answer.get("usage") or {}).get("completion_tokens") or 0))


async def send_soak_request(
    client: httpx.AsyncClient, url: str, model: str, request: SoakRequest, *, abort_after_s: float | None = None
) -> Outcome:
    """Send ``request`` to the server at ``url`` (its base URL), drop it as planned, and say what became of it.
    Never raises (but passes on cancellation)."""
    body = {"model": model, **request.payload}
    endpoint_url = url + _PATHS[request.endpoint]
    started = time.perf_counter()
    send = _stream if request.stream else _plain
    try:
        if abort_after_s is not None:
            try:
                outcome = await asyncio.wait_for(send(client, endpoint_url, request, body), abort_after_s)
            except TimeoutError:  # the client gave up: the connection is closed under the request
                outcome = Outcome("aborted")
        else:
            outcome = await send(client, endpoint_url, request, body)
    except _Invalid as exc:
        outcome = _error("invalid-answer", str(exc))
    except httpx.TimeoutException as exc:
        outcome = _error("timeout", f"{type(exc).__name__}: {exc}")
    except (httpx.TransportError, httpx.StreamError) as exc:
        outcome = _error("dropped-connection", f"{type(exc).__name__}: {exc}")
    except (ValueError, KeyError, TypeError) as exc:  # a body that is not the JSON the API promises
        outcome = _error("invalid-answer", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # any other failure is this request's, never the soak's
        outcome = _error(f"exception-{type(exc).__name__}", str(exc))
    outcome.latency_s = time.perf_counter() - started
    if request.is_abort and outcome.status == "completed":
        outcome.abort_missed = True
    return outcome


# ------------------------------------------------------------------ counting and sampling


@dataclass
class Tally:
    """Counts kept by the client loops (one event loop) and read by the sampling thread."""

    sent: int = 0
    completed: int = 0
    aborted: int = 0
    abort_missed: int = 0
    rejected: int = 0
    output_tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    error_examples: dict[str, str] = field(default_factory=dict)
    shapes: Counter[str] = field(default_factory=Counter)
    mean_plain_latency_s: float = 1.0  # of completed plain requests, for the time of a plain request's abort

    def add(self, request: SoakRequest, outcome: Outcome) -> None:
        self.shapes.update(request.shape())
        self.output_tokens += outcome.output_tokens
        self.abort_missed += outcome.abort_missed
        if outcome.status == "completed":
            self.completed += 1
            if not request.stream:
                self.mean_plain_latency_s += 0.05 * (outcome.latency_s - self.mean_plain_latency_s)
        elif outcome.status == "aborted":
            self.aborted += 1
        elif outcome.status == "rejected":
            self.rejected += 1
        else:
            kind = outcome.error_kind or "error"
            self.errors[kind] += 1
            if kind not in self.error_examples:
                self.error_examples[kind] = outcome.detail
                logger.warning("request %d failed (%s): %s", request.index, kind, outcome.detail)

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name: value}, summed over labels (engines, models)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


@dataclass
class Sample:
    t_s: float
    phase: str  # warmup, load, drain, idle
    rss_bytes: dict[str, int]
    kv_cache_usage: float | None
    kv_cache_touched_bytes: float | None  # over the engines: KV memory handed out at least once, resident on a CPU
    num_running: float | None
    num_waiting: float | None
    requests_sent: int
    errors: int


class _Sampler:
    """Takes a ``Sample`` every ``interval_s`` on a thread of its own, and when asked."""

    def __init__(
        self, tree: ProcessTree | None, url: str, headers: dict[str, str], interval_s: float, tally: Tally
    ) -> None:
        self.tree = tree
        self.http = httpx.Client(base_url=url, headers=headers, timeout=10)
        self.interval_s = interval_s
        self.tally = tally
        self.samples: list[Sample] = []
        self.phase = "warmup"
        self.on_sample: Callable[[Sample], None] | None = None
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.http.close()

    def gauges(self) -> dict[str, float]:
        try:
            response = self.http.get("/metrics")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("GET /metrics failed: %s", exc)
            return {}
        return parse_metrics(response.text)

    def take(self, phase: str | None = None) -> Sample:
        with self._lock:
            rss = self.tree.sample() if self.tree is not None else {}
            samples = self.gauges()
            sample = Sample(
                t_s=round(time.monotonic() - self._started, 3),
                phase=phase or self.phase,
                rss_bytes=rss,
                kv_cache_usage=samples.get(_KV_USAGE),
                kv_cache_touched_bytes=samples.get(_KV_TOUCHED),
                num_running=samples.get(_RUNNING),
                num_waiting=samples.get(_WAITING),
                requests_sent=self.tally.sent,
                errors=self.tally.num_errors,
            )
            self.samples.append(sample)
        if self.on_sample is not None:
            self.on_sample(sample)
        return sample

    def _run(self) -> None:
        self.take()
        while not self._stop.wait(self.interval_s):
            self.take()


# ------------------------------------------------------------------ the run


def run_soak(options: SoakOptions) -> dict[str, Any]:
    """Run the soak to the end, write its files to ``options.output_dir`` and return the report."""
    return asyncio.run(_run(options))


async def _first_model(client: httpx.AsyncClient, url: str) -> str:
    try:
        response = await client.get(url + "/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SoakError(f"could not read the model name from {url}/v1/models ({type(exc).__name__}: {exc})") from None


async def _run(options: SoakOptions) -> dict[str, Any]:
    options.output_dir.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)
    tally = Tally()
    workload = SoakWorkload(options)
    tree = ProcessTree(options.server_pid) if options.server_pid is not None else None
    async with httpx.AsyncClient(headers=headers, timeout=options.timeout_s, limits=limits) as client:
        model = options.model or await _first_model(client, options.url)
        sampler = _Sampler(tree, options.url, headers, options.sample_interval_s, tally)
        progress = _Progress(options) if options.show_progress else None
        sampler.on_sample = progress.update if progress else None
        baseline = sampler.gauges()
        counter = itertools.count()
        logger.info(
            "soaking %s (model %s) for %.0f s at concurrency %d; warm-up %.0f s",
            options.url, model, options.duration_s, options.concurrency, options.warmup_s,
        )  # fmt: skip
        sampler.start()
        start = time.monotonic()
        deadline = start + options.duration_s

        async def loop() -> None:
            while time.monotonic() < deadline:
                request = workload.request(next(counter))
                tally.sent += 1
                abort_after_s = None
                if request.abort_at is not None:
                    abort_after_s = max(0.001, request.abort_at * tally.mean_plain_latency_s)
                outcome = await send_soak_request(client, options.url, model, request, abort_after_s=abort_after_s)
                tally.add(request, outcome)
                if outcome.status == "rejected":
                    await asyncio.sleep(_REJECTED_PAUSE_S)

        async def phases() -> None:
            await asyncio.sleep(options.warmup_s)
            sampler.phase = "load"
            await asyncio.to_thread(sampler.take)  # the warm-up's end
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            await asyncio.to_thread(sampler.take)  # the load's end
            sampler.phase = "drain"

        await asyncio.gather(phases(), *(loop() for _ in range(options.concurrency)))
        load_s = time.monotonic() - start
        idle = await _wait_for_idle(sampler, options.idle_timeout_s)
        sampler.phase = "idle"  # the sampler's own thread may take one more sample before it stops
        final = await asyncio.to_thread(sampler.take, "idle")
        sampler.stop()
        if progress is not None:
            progress.close()
    report = build_report(
        "soak", options.parameters(model), _results(options, tally, sampler.samples, idle, final, baseline, load_s)
    )
    _write_files(options, report, sampler.samples)
    return report


async def _wait_for_idle(sampler: _Sampler, timeout_s: float) -> bool:
    """Wait until the engines report nothing running or waiting and no KV block in use (their heartbeats
    come every 0.5 s); False if that takes longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await asyncio.to_thread(sampler.gauges)
        values = [samples.get(name) for name in (_KV_USAGE, _RUNNING, _WAITING)]
        if all(value == 0 for value in values):
            return True
        if time.monotonic() > deadline or any(value is None for value in values):
            return False
        await asyncio.sleep(_IDLE_POLL_S)


class _Progress:
    """One line per sample on stderr (through tqdm, so it does not fight a terminal's other output)."""

    def __init__(self, options: SoakOptions) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=round(options.duration_s), unit="s", desc="soak", dynamic_ncols=True)

    def update(self, sample: Sample) -> None:
        self._bar.n = min(self._bar.total, round(sample.t_s))
        total = sum(sample.rss_bytes.values()) / _MIB
        usage = "-" if sample.kv_cache_usage is None else f"{100 * sample.kv_cache_usage:.0f}%"
        self._bar.set_postfix_str(
            f"{sample.phase} sent={sample.requests_sent} errors={sample.errors} rss={total:.0f}MiB kv={usage}"
        )

    def close(self) -> None:
        self._bar.close()


# ------------------------------------------------------------------ the report


def _rss_table(samples: list[Sample], *, max_growth_pct: float) -> list[dict[str, Any]]:
    """Per process (and ``total``): RSS at the end of the warm-up, at the end of the load, when idle, the peak,
    and the growth from the first to the second. A process that was not there at both points has no growth.

    Growth is net of the KV cache's first touches (``kv_cache_touched_bytes``): a CPU engine maps its cache's
    pages as blocks are first used, so the prefix cache filling up is not a leak. The engines' growth of it is
    split evenly between the engine processes (data-parallel engines serve alike loads)."""
    load = [s for s in samples if s.phase == "load"]
    if not load:
        return []
    first, last = load[0], load[-1]
    idle = next((s for s in reversed(samples) if s.phase == "idle"), None)
    keys = list(dict.fromkeys(key for s in samples for key in s.rss_bytes))
    engines = [key for key in keys if key.partition("-")[0] == "engine"]
    kv_growth = (last.kv_cache_touched_bytes or 0) - (first.kv_cache_touched_bytes or 0)
    rows = []
    for key in [*keys, "total"]:

        def value(sample: Sample | None, key: str = key) -> int | None:
            if sample is None:
                return None
            return sum(sample.rss_bytes.values()) if key == "total" else sample.rss_bytes.get(key)

        start, end = value(first), value(last)
        peak = max((v for s in samples if (v := value(s)) is not None), default=None)
        kv = kv_growth if key == "total" else kv_growth / len(engines) if key in engines else 0
        growth = None if not start or end is None else round(100 * (end - start - kv) / start, 2)
        rows.append({
            "process": key,
            "warmup_end_mib": _mib(start), "end_mib": _mib(end), "idle_mib": _mib(value(idle)),
            "peak_mib": _mib(peak), "kv_touched_growth_mib": _mib(int(kv)), "growth_pct": growth,
            "growth_ok": None if growth is None else growth < max_growth_pct,
        })  # fmt: skip
    return rows


def _mib(value: int | None) -> float | None:
    return None if value is None else round(value / _MIB, 1)


def _results(
    options: SoakOptions,
    tally: Tally,
    samples: list[Sample],
    idle: bool,
    final: Sample,
    baseline: dict[str, float],
    load_s: float,
) -> dict[str, Any]:
    rss = _rss_table(samples, max_growth_pct=options.max_rss_growth_pct)
    growths = [row["growth_pct"] for row in rss if row["growth_pct"] is not None]
    checks: dict[str, bool | None] = {  # None: not measured (no server process to sample)
        "no_errors": tally.num_errors == 0,
        "kv_idle_at_end": idle and final.kv_cache_usage == 0,
        "rss_growth_under_max": max(growths) < options.max_rss_growth_pct if growths else None,
    }
    return {
        "load_duration_s": round(load_s, 1),
        "requests": tally.sent,
        "completed": tally.completed,
        "aborted": tally.aborted,
        "abort_planned_but_finished": tally.abort_missed,
        "rejected_429": tally.rejected,
        "errors": tally.num_errors,
        "errors_by_kind": dict(tally.errors),
        "error_examples": tally.error_examples,
        "requests_by_shape": dict(sorted(tally.shapes.items())),
        "output_tokens": tally.output_tokens,
        "output_throughput": round(tally.output_tokens / load_s, 1) if load_s else None,
        "kv_cache_usage_at_start": baseline.get(_KV_USAGE),
        "kv_cache_usage_at_end": final.kv_cache_usage,
        "num_running_at_end": final.num_running,
        "num_waiting_at_end": final.num_waiting,
        "idle_at_end": idle,
        "rss": rss,
        "max_rss_growth_pct": max(growths) if growths else None,
        "checks": checks,
        "passed": all(ok is not False for ok in checks.values()),
    }


def _write_files(options: SoakOptions, report: dict[str, Any], samples: list[Sample]) -> None:
    directory = options.output_dir
    keys = list(dict.fromkeys(key for s in samples for key in s.rss_bytes))
    with (directory / "samples.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["t_s", "phase", *(f"rss_mib_{k}" for k in keys), "rss_mib_total", "kv_cache_usage",
                         "num_running", "num_waiting", "requests_sent", "errors"])  # fmt: skip
        for s in samples:
            rss = [_mib(s.rss_bytes.get(k)) for k in keys]
            writer.writerow([s.t_s, s.phase, *("" if v is None else v for v in rss),
                             _mib(sum(s.rss_bytes.values())), s.kv_cache_usage, s.num_running, s.num_waiting,
                             s.requests_sent, s.errors])  # fmt: skip
    write_json({**report, "samples": [asdict(s) for s in samples]}, directory / "report.json")
    rss_panel = Panel("Resident memory (RSS) per process", "MiB")
    for key in [*keys, "total"]:
        rss_panel.series[key] = [
            (s.t_s, (sum(s.rss_bytes.values()) if key == "total" else s.rss_bytes[key]) / _MIB)
            for s in samples
            if key == "total" or key in s.rss_bytes
        ]
    load_panel = Panel("Engines", "% KV blocks in use / requests", y_min=0)
    load_panel.series["KV cache usage %"] = [(s.t_s, 100 * s.kv_cache_usage) for s in samples
                                             if s.kv_cache_usage is not None]  # fmt: skip
    load_panel.series["requests running"] = [(s.t_s, s.num_running) for s in samples if s.num_running is not None]
    load_panel.series["requests waiting"] = [(s.t_s, s.num_waiting) for s in samples if s.num_waiting is not None]
    end = next((s.t_s for s in reversed(samples) if s.phase == "load"), options.duration_s)
    markers = [(options.warmup_s, "warm-up end"), (end, "load end")]
    results = report["results"]
    title = (f"tokenmill bench soak: c={options.concurrency}, {results['load_duration_s']:.0f} s, "
             f"{results['requests']} requests, {results['errors']} errors, {results['aborted']} aborts")  # fmt: skip
    (directory / "rss.svg").write_text(
        line_chart_svg([rss_panel, load_panel], x_label="seconds since start", markers=markers, title=title)
    )
    logger.info("wrote %s/{report.json,samples.csv,rss.svg}", directory)


def format_soak(report: dict[str, Any]) -> str:
    """The report as a short text table."""
    p, r = report["parameters"], report["results"]
    lines = [
        f"soak: {p['model']} at {p['base_url']}, c={p['concurrency']}, {r['load_duration_s']} s "
        f"(warm-up {p['warmup_s']} s), abort fraction {p['abort_fraction']}",
        "",
        f"requests {r['requests']}: completed {r['completed']}, aborted by the client {r['aborted']} "
        f"(+{r['abort_planned_but_finished']} finished first), rejected (429) {r['rejected_429']}, "
        f"errors {r['errors']}" + (f" {r['errors_by_kind']}" if r["errors"] else ""),
        f"output tokens {r['output_tokens']} ({r['output_throughput']} tok/s)",
        f"at the end: KV cache usage {r['kv_cache_usage_at_end']}, running {r['num_running_at_end']}, "
        f"waiting {r['num_waiting_at_end']} ({'idle' if r['idle_at_end'] else 'NOT idle'})",
        "",
        "| process | RSS at warm-up end MiB | at load end MiB | idle MiB | peak MiB | KV first touches MiB | "
        "growth % (net of them) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rss"]:
        lines.append(f"| {row['process']} | {row['warmup_end_mib']} | {row['end_mib']} | {row['idle_mib']} | "
                     f"{row['peak_mib']} | {row['kv_touched_growth_mib']} | {row['growth_pct']} |")  # fmt: skip
    verdicts = {True: "ok", False: "FAILED", None: "not measured"}
    checks = ", ".join(f"{name} {verdicts[ok]}" for name, ok in r["checks"].items())
    lines += ["", f"checks: {checks}", f"files: {p['output_dir']}/report.json, samples.csv, rss.svg"]
    return "\n".join(lines)
