"""Structured outputs against a running server: ``tokenmill bench structured``.

Four parts, each optional (``--parts``), all through ``/v1/chat/completions`` as clients send them:

- ``validity``: requests sampled at temperature 1.0, cycling through ``schemas.SCHEMAS`` as ``response_format``
  ``json_schema`` (strict); each reply is checked with ``jsonschema``, a library we did not write.
- ``tools``: requests with ``schemas.TOOLS`` and ``tool_choice: required``; every call must name a tool and carry
  arguments valid against its parameters.
- ``overhead``: ``bench serve`` runs at each concurrency with every request constrained (a schema longer than
  ``output_len``, so both sides generate the same tokens) and unconstrained, alternated over ``rounds``.
- ``ttft``: time to first token of a request with a schema of 50 properties the server has never seen, against
  the same schema once it is compiled (warm), one request at a time.

Imports no torch: it runs wherever the client runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx

from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.metrics import TABLE_WIDTH, RequestRecord, build_report, format_header, row
from tokenmill_plugins.commands.bench.schemas import PROMPTS, SCHEMAS, TOOLS
from tokenmill_plugins.commands.bench.serve import (
    ServeOptions,
    _first_model,
    _send,
    alternate,
    base_url,
    check_parts,
    run_serve,
)

logger = logging.getLogger(__name__)

PARTS = ("validity", "tools", "overhead", "ttft")
_CHAT = "/v1/chat/completions"
_EXAMPLES = 5  # invalid replies kept in the report


@dataclass(frozen=True)
class StructuredOptions:
    """The parameters of one ``bench structured`` run; all but ``api_key`` go into the report."""

    url: str
    model: str | None = None
    parts: tuple[str, ...] = PARTS
    num_requests: int = 500  # validity
    num_tool_requests: int = 100  # tools
    concurrency: int = 32  # validity and tools: requests in flight
    max_tokens: int = 512  # validity and tools
    temperature: float = 1.0
    overhead_concurrency: tuple[int, ...] = (1, 32)
    input_len: int = 128  # overhead
    output_len: int = 128  # overhead
    rounds: int = 2  # overhead: constrained/unconstrained alternations
    ttft_repeats: int = 5
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_parts(self.parts, PARTS)

    @property
    def base_url(self) -> str:
        return base_url(self.url)

    def parameters(self, model: str) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "api_key"}, "model": model}


def run_structured(options: StructuredOptions) -> dict[str, Any]:
    """Run the chosen parts and return the report (``metrics.build_report``)."""
    model = options.model or asyncio.run(_model(options))
    results: dict[str, Any] = {}
    if "validity" in options.parts:
        results["validity"] = asyncio.run(_validity(options, model))
    if "tools" in options.parts:
        results["tools"] = asyncio.run(_tools(options, model))
    if "overhead" in options.parts:
        results["overhead"] = _overhead(options, model)
    if "ttft" in options.parts:
        results["ttft"] = asyncio.run(_ttft(options, model))
    return build_report("structured", options.parameters(model), results)


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def check_reply(text: str | None, schema: dict[str, Any]) -> str | None:
    """Why ``text`` is not a JSON document valid against ``schema`` (``jsonschema``), or None when it is."""
    import jsonschema  # a bench extra: only this part needs it

    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg} at {exc.pos}"
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message}"
    return None


async def _model(options: StructuredOptions) -> str:
    async with _client(options, 1) as client:
        return await _first_model(client, options.base_url)


def _client(options: StructuredOptions, concurrency: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.AsyncClient(headers=headers, timeout=options.timeout_s, limits=limits)


async def _post_all(options: StructuredOptions, bodies: list[dict[str, Any]]) -> list[dict[str, Any] | str]:
    """Each body's response JSON, or its error as text; at most ``concurrency`` in flight."""
    semaphore = asyncio.Semaphore(options.concurrency)
    async with _client(options, options.concurrency) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any] | str:
            async with semaphore:
                try:
                    response = await client.post(options.base_url + _CHAT, json=body)
                except httpx.HTTPError as exc:
                    return f"{type(exc).__name__}: {exc}"
                if response.status_code != 200:
                    return f"HTTP {response.status_code}: {response.text[:200]}"
                result: dict[str, Any] = response.json()
                return result

        return await asyncio.gather(*(one(body) for body in bodies))


def _sampled(options: StructuredOptions, model: str, i: int) -> dict[str, Any]:
    prompt = PROMPTS[i % len(PROMPTS)]
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": options.temperature,
            "seed": options.seed + i, "max_tokens": options.max_tokens}  # fmt: skip


async def _validity(options: StructuredOptions, model: str) -> dict[str, Any]:
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(options.num_requests)]
    bodies = [
        {**_sampled(options, model, i), "response_format": response_format(name, SCHEMAS[name])}
        for i, name in enumerate(names)
    ]
    responses = await _post_all(options, bodies)
    per_schema = {name: {"valid": 0, "invalid": 0} for name in SCHEMAS}
    counts = {"valid": 0, "invalid": 0, "truncated": 0, "failed": 0}
    examples: list[dict[str, Any]] = []
    for name, response in zip(names, responses, strict=True):
        if isinstance(response, str):
            counts["failed"] += 1
            if len(examples) < _EXAMPLES:
                examples.append({"schema": name, "error": response})
            continue
        choice = response["choices"][0]
        problem = check_reply(choice["message"].get("content"), SCHEMAS[name])
        outcome = "valid" if problem is None else "invalid"
        counts[outcome] += 1
        per_schema[name][outcome] += 1
        if problem is not None:
            counts["truncated"] += choice.get("finish_reason") == "length"
            if len(examples) < _EXAMPLES:
                examples.append({"schema": name, "problem": problem, "finish_reason": choice.get("finish_reason"),
                                 "content": (choice["message"].get("content") or "")[:300]})  # fmt: skip
    answered = counts["valid"] + counts["invalid"]
    return {
        "num_requests": options.num_requests,
        "num_schemas": len(SCHEMAS),
        **counts,
        "valid_fraction": counts["valid"] / answered if answered else 0.0,
        "per_schema": per_schema,
        "examples": examples,
    }


async def _tools(options: StructuredOptions, model: str) -> dict[str, Any]:
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    bodies = [
        {**_sampled(options, model, i), "tools": TOOLS, "tool_choice": "required"}
        for i in range(options.num_tool_requests)
    ]
    responses = await _post_all(options, bodies)
    # A reply cut at max_tokens (``truncated``) holds no complete call list; one that stopped without a call
    # (``without_calls``) broke ``required``.
    counts = {"valid_calls": 0, "invalid_calls": 0, "without_calls": 0, "truncated": 0, "failed": 0}
    examples: list[dict[str, Any]] = []
    for response in responses:
        if isinstance(response, str):
            counts["failed"] += 1
            if len(examples) < _EXAMPLES:
                examples.append({"error": response})
            continue
        choice = response["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        if not calls:
            counts["truncated" if choice.get("finish_reason") == "length" else "without_calls"] += 1
        for call in calls:
            name = call["function"]["name"]
            problem = (
                check_reply(call["function"]["arguments"], parameters[name])
                if name in parameters
                else f"unknown tool {name!r}"
            )
            counts["valid_calls" if problem is None else "invalid_calls"] += 1
            if problem is not None and len(examples) < _EXAMPLES:
                examples.append({"tool": name, "problem": problem, "arguments": call["function"]["arguments"][:300]})
    calls = counts["valid_calls"] + counts["invalid_calls"]
    return {
        "num_requests": options.num_tool_requests,
        **counts,
        "valid_fraction": counts["valid_calls"] / calls if calls else 0.0,
        "examples": examples,
    }


#: A schema whose replies outlast any ``output_len`` up to about 1,000 tokens, so that a constrained request
#: generates as many tokens as an unconstrained one (``ignore_eos``) and the two runs compare step for step.
LONG_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    },
    "minItems": 256,
    "maxItems": 256,
}


def _overhead(options: StructuredOptions, model: str) -> dict[str, Any]:
    base = ServeOptions(url=options.url, num_requests=1, input_len=options.input_len, output_len=options.output_len,
                        model=model, seed=options.seed, endpoint="chat", api_key=options.api_key,
                        timeout_s=options.timeout_s, show_progress=False)  # fmt: skip
    constrained_body = {"response_format": response_format("long", LONG_SCHEMA)}
    # The schema compiles once, before anything is timed.
    run_serve(replace(base, extra_body=constrained_body))
    sides: dict[str, dict[str, Any]] = {
        "unconstrained": {"extra_body": None},
        "constrained": {"extra_body": constrained_body},
    }
    return alternate(base, sides, options.overhead_concurrency, options.rounds)


def fifty_properties(tag: str) -> dict[str, Any]:
    """A schema of 50 required properties of mixed types, named after ``tag`` so that no server has seen it."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 8},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"},
        {"enum": ["low", "mid", "high"]},
        {"type": "number"},
    ]
    properties = {f"f{tag}_{k}": kinds[k % len(kinds)] for k in range(50)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


async def _ttft(options: StructuredOptions, model: str) -> dict[str, Any]:
    new: list[float] = []
    warm: list[float] = []
    async with _client(options, 1) as client:
        url = options.base_url + _CHAT
        for _ in range(options.ttft_repeats):
            schema = fifty_properties(uuid.uuid4().hex[:8])
            body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 4,
                    "temperature": 0, "stream": True, "response_format": response_format("fifty", schema)}  # fmt: skip
            for times in (new, warm):  # first unseen, then compiled
                record = RequestRecord(0, 4)
                await _send(client, url, body, record)
                if not record.success:
                    raise TokenmillError(f"bench structured: a 50-property schema request failed: {record.error}")
                times.append(record.ttft * 1000)
    return {
        "new_ttft_ms": new,
        "warm_ttft_ms": warm,
        "new_ttft_p50_ms": statistics.median(new),
        "warm_ttft_p50_ms": statistics.median(warm),
        "extra_ms_p50": statistics.median(a - b for a, b in zip(new, warm, strict=True)),
        "extra_ms_max": max((a - b for a, b in zip(new, warm, strict=True)), default=math.nan),
    }


def format_structured(report: dict[str, Any]) -> str:
    """The report as aligned text: the parameters, then each part's figures."""
    results = report["results"]
    lines = format_header(report)
    if "validity" in results:
        v = results["validity"]
        lines += [
            row("validity: valid / answered", f"{v['valid']} / {v['valid'] + v['invalid']}"),
            row("validity: invalid (cut at max_tokens)", f"{v['invalid']} ({v['truncated']})"),
            row("validity: failed requests", v["failed"]),
        ]
    if "tools" in results:
        t = results["tools"]
        lines += [
            row("tools: valid / all calls", f"{t['valid_calls']} / {t['valid_calls'] + t['invalid_calls']}"),
            row("tools: replies without a call (cut)", f"{t['without_calls']} ({t['truncated']})"),
            row("tools: failed requests", t["failed"]),
        ]
    for concurrency, o in results.get("overhead", {}).items():
        free, constrained = (
            max(r["output_throughput"] for r in o["runs"][side]) for side in ("unconstrained", "constrained")
        )
        lines += [
            row(f"c={concurrency}: tok/s free / constrained", f"{free:.1f} / {constrained:.1f}"),
            row(f"c={concurrency}: throughput ratio", o["throughput_ratio"]),
            row(f"c={concurrency}: ITL p50 ratio", o["itl_p50_ratio"]),
        ]
    if "ttft" in results:
        f = results["ttft"]
        lines += [
            row("ttft: new schema p50 (ms)", f["new_ttft_p50_ms"]),
            row("ttft: warm schema p50 (ms)", f["warm_ttft_p50_ms"]),
            row("ttft: new minus warm p50 / max (ms)", f"{f['extra_ms_p50']:.1f} / {f['extra_ms_max']:.1f}"),
        ]
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)
