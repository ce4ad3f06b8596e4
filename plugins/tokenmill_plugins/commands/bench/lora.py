"""Multi-LoRA serving against a running server: ``tokenmill bench lora`` and ``tokenmill bench lora-adapters``.

``lora-adapters`` writes PEFT adapters for a model's architecture with ``peft`` itself (its random, non-zero
initialisation of both matrices, so every adapter changes the model's output). ``lora`` then measures, on a
server started with those adapters:

- ``overhead``: ``bench serve`` runs (chat, random-word prompts) at each concurrency with the requests spread
  over the adapters (request ``i`` names adapter ``i mod N`` in its ``model`` field) and with every request on
  the base model, alternated over ``rounds``; both sides generate the same tokens (``ignore_eos``), so the
  ratios are the adapters' cost.
- ``stall``: base-model streams run while an adapter is loaded at run time (``POST /v1/load_lora_adapter``) and
  its first request runs (the engine reads its weights then); the longest gap between two tokens of any stream
  meanwhile, and the time the streams lost, each less the same while a second request runs on the adapter once
  loaded, in the streams' median gaps, say whether loading stalled them for more than a step.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.metrics import TABLE_WIDTH, build_report, format_header, row
from tokenmill_plugins.commands.bench.serve import (
    ServeOptions,
    _has_content,
    alternate,
    base_url,
    check_parts,
    run_serve,
)
from tokenmill_plugins.commands.bench.workload import random_texts

PARTS = ("overhead", "stall")
#: The linears PEFT adapts in the Llama family, every one of them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(model: Path, directory: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """``count`` PEFT adapters of ``rank`` (alpha ``2 * rank``, every linear of every layer) for ``model``'s
    architecture, written to ``directory/adapter{i}``; both matrices random (PEFT's ``init_lora_weights=False``).
    An adapter's shapes do not depend on the base's weights, so the base is built from its config, not loaded."""
    try:
        import torch
        import transformers
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise TokenmillError(f"bench lora-adapters needs peft and transformers ({exc}); pip install peft") from None
    from tokenmill.model_loader import select_weight_format
    from tokenmill.plugin_manager import load_plugins

    hf_config = select_weight_format(model, load_plugins(), None).read_config(model)
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
    paths = []
    for i in range(count):
        torch.manual_seed(seed + i)
        settings = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES), init_lora_weights=False)
        adapted = get_peft_model(base, settings)
        path = directory / f"adapter{i}"
        adapted.save_pretrained(str(path))
        paths.append(path)
        base = adapted.unload()  # the bare base again, for the next adapter
    return paths


@dataclass(frozen=True)
class LoRAOptions:
    """The parameters of one ``bench lora`` run; all but ``api_key`` go into the report."""

    url: str
    adapters: tuple[str, ...] = ()  # served adapter names; empty: every adapter ``GET /v1/models`` lists
    parts: tuple[str, ...] = PARTS
    concurrency: tuple[int, ...] = (1, 32)
    input_len: int = 128
    output_len: int = 128
    rounds: int = 2
    load_adapter: str | None = None  # stall: the path of an adapter to load at run time (on the server's disk)
    stall_streams: int = 4
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_parts(self.parts, PARTS)
        if "stall" in self.parts and self.load_adapter is None:
            raise TokenmillError("the stall part loads an adapter at run time: give its path with --load-adapter")

    @property
    def base_url(self) -> str:
        return base_url(self.url)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def run_lora(options: LoRAOptions) -> dict[str, Any]:
    """Run the chosen parts and return the report (``metrics.build_report``)."""
    base_model, served = _models(options)
    adapters = options.adapters or served
    if not adapters:
        raise TokenmillError(f"{options.base_url} serves no LoRA adapter: start it with --enable-lora --lora-modules")
    missing = sorted(set(adapters) - set(served))
    if missing:
        raise TokenmillError(f"adapters {', '.join(missing)} are not served; served: {', '.join(served) or 'none'}")
    results: dict[str, Any] = {}
    if "overhead" in options.parts:
        results["overhead"] = _overhead(options, base_model, adapters)
    if "stall" in options.parts:
        results["stall"] = asyncio.run(_stall(options, base_model))
    parameters = {**{k: v for k, v in asdict(options).items() if k != "api_key"}, "model": base_model}
    return build_report("lora", {**parameters, "adapters": list(adapters)}, results)


def _models(options: LoRAOptions) -> tuple[str, tuple[str, ...]]:
    """The base model's name and the adapters' names, from ``GET /v1/models`` (an adapter has a ``parent``)."""
    try:
        response = httpx.get(options.base_url + "/v1/models", headers=options.headers, timeout=30)
        response.raise_for_status()
        cards = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise TokenmillError(f"could not list {options.base_url}/v1/models ({type(exc).__name__}: {exc})") from None
    base = next(card["id"] for card in cards if not card.get("parent"))
    return base, tuple(card["id"] for card in cards if card.get("parent"))


def _overhead(options: LoRAOptions, base_model: str, adapters: tuple[str, ...]) -> dict[str, Any]:
    base = ServeOptions(url=options.url, num_requests=1, input_len=options.input_len, output_len=options.output_len,
                        model=base_model, seed=options.seed, endpoint="chat", api_key=options.api_key,
                        timeout_s=options.timeout_s, show_progress=False)  # fmt: skip
    run_serve(replace(base, models=adapters, num_requests=len(adapters)))  # every adapter read once, untimed
    sides: dict[str, dict[str, Any]] = {"base": {"models": None}, "adapters": {"models": adapters}}
    return alternate(base, sides, options.concurrency, options.rounds)


async def _stall(options: LoRAOptions, base_model: str) -> dict[str, Any]:
    """Token arrival times of ``stall_streams`` base-model streams while three requests join them, one after the
    other, each with a prompt of the same length that no cache holds: on the base model, on an adapter loaded at
    run time just before it, and on that adapter again, loaded by then. The load stalls the others by the
    difference between the longest gaps the last two cause (both run the adapter on their prompt's prefill); the
    first says what any request joining costs."""
    assert options.load_adapter is not None
    name = f"bench-loaded-{int(time.time())}"
    prompts = random_texts([options.input_len] * (options.stall_streams + 1), seed=options.seed)
    probe, prompts = prompts[-1], prompts[:-1]
    arrivals: list[list[float]] = [[] for _ in prompts]
    async with httpx.AsyncClient(headers=options.headers, timeout=options.timeout_s) as client:

        async def stream(i: int) -> None:
            body = {"model": base_model, "messages": [{"role": "user", "content": prompts[i]}], "stream": True,
                    "max_tokens": 4 * options.output_len, "temperature": 0, "ignore_eos": True}  # fmt: skip
            async with client.stream("POST", options.base_url + "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data:") and "[DONE]" not in line and _has_content(json.loads(line[5:])):
                        arrivals[i].append(time.perf_counter())

        async def join(model: str, nonce: str, load: bool = False) -> tuple[float, float]:
            """Send ``probe`` (after ``nonce``, so that no prefix cache holds any of it) on ``model`` for one token once
            every stream has moved on, loading ``model`` first when ``load``; its window."""
            counts = [len(a) for a in arrivals]
            while any(
                len(a) < count + 8 and not task.done() for a, count, task in zip(arrivals, counts, streams, strict=True)
            ):
                await asyncio.sleep(0.01)
            started = time.perf_counter()
            if load:
                response = await client.post(options.base_url + "/v1/load_lora_adapter",
                                             json={"lora_name": name, "lora_path": options.load_adapter})  # fmt: skip
                if response.status_code != 200:
                    raise TokenmillError(f"POST /v1/load_lora_adapter answered {response.status_code}: "
                                         f"{response.text[:200]} (is --allow-runtime-lora-updating on?)")  # fmt: skip
            # The nonce opens the prompt (a system message in place of the template's default one): a prompt that
            # began with the template's system prompt would find its first blocks cached under the base model and,
            # from the second request on, under the adapter, and the first request on an adapter would prefill
            # more tokens than the next.
            messages = [{"role": "system", "content": nonce}, {"role": "user", "content": probe}]
            body = {"model": model, "messages": messages, "max_tokens": 1}
            response = await client.post(options.base_url + "/v1/chat/completions", json=body)
            response.raise_for_status()
            return started, time.perf_counter()

        # The streams decode until the three requests have joined (4 * output_len tokens at most), then are cut.
        streams = [asyncio.create_task(stream(i)) for i in range(len(prompts))]
        while any(len(a) < options.output_len // 4 and not t.done() for a, t in zip(arrivals, streams, strict=True)):
            await asyncio.sleep(0.01)  # every stream is decoding
        try:
            nonce = str(time.time_ns())
            control = await join(base_model, "a" + nonce)  # the letter first: the prompts differ from their first block
            load = await join(name, "b" + nonce, load=True)
            loaded = await join(name, "c" + nonce)
        finally:
            for task in streams:
                task.cancel()
            ended = await asyncio.gather(*streams, return_exceptions=True)
        failure = next((e for e in ended if isinstance(e, Exception)), None)  # not the cancellations
        if failure is not None:
            raise failure
        await client.post(options.base_url + "/v1/unload_lora_adapter", json={"lora_name": name})
    per_stream = [list(zip(times, times[1:], strict=False)) for times in arrivals]
    gaps = [gap for stream_gaps in per_stream for gap in stream_gaps]
    median = statistics.median(b - a for a, b in gaps)

    def longest(window: tuple[float, float]) -> float:
        """The longest gap between two tokens of a stream that overlaps ``window``."""
        return max((b - a for a, b in gaps if b >= window[0] and a <= window[1]), default=0.0)

    def lost(window: tuple[float, float]) -> float:
        return time_lost(per_stream, median, window)

    return {
        "load_ms": (load[1] - load[0]) * 1000,
        "itl_p50_ms": median * 1000,
        "max_gap_base_join_ms": longest(control) * 1000,
        "max_gap_load_join_ms": longest(load) * 1000,
        "max_gap_adapter_join_ms": longest(loaded) * 1000,
        "extra_gap_in_steps": (longest(load) - longest(loaded)) / median,
        "lost_base_join_ms": lost(control) * 1000,
        "lost_load_join_ms": lost(load) * 1000,
        "lost_adapter_join_ms": lost(loaded) * 1000,
        "extra_lost_in_steps": (lost(load) - lost(loaded)) / median,
    }


def time_lost(per_stream: list[list[tuple[float, float]]], median: float, window: tuple[float, float]) -> float:
    """The time the streams lost to the steps that overlap ``window``: over each stream's gaps ``(a, b)`` between
    two tokens that overlap it, the sum of each gap beyond ``median``; the mean over the streams. Unlike the longest
    gap, it counts the small delays of many steps too."""
    totals = [sum(b - a - median for a, b in gaps if b >= window[0] and a <= window[1]) for gaps in per_stream]
    return statistics.fmean(totals)


def format_lora(report: dict[str, Any]) -> str:
    """The report as aligned text: the parameters, then each part's figures."""
    results = report["results"]
    lines = format_header(report)
    for concurrency, o in results.get("overhead", {}).items():
        base, adapters = (max(r["output_throughput"] for r in o["runs"][side]) for side in ("base", "adapters"))
        lines += [
            row(f"c={concurrency}: tok/s base / adapters", f"{base:.1f} / {adapters:.1f}"),
            row(f"c={concurrency}: throughput ratio", o["throughput_ratio"]),
            row(f"c={concurrency}: ITL p50 ratio", o["itl_p50_ratio"]),
        ]
    if "stall" in results:
        s = results["stall"]
        lines += [
            row("stall: load and first token (ms)", s["load_ms"]),
            row("stall: ITL p50 (ms)", s["itl_p50_ms"]),
            row(
                "stall: longest gap, base / load / loaded join (ms)",
                f"{s['max_gap_base_join_ms']:.1f} / {s['max_gap_load_join_ms']:.1f} / "
                f"{s['max_gap_adapter_join_ms']:.1f}",
            ),
            row("stall: the load's extra gap in steps", s["extra_gap_in_steps"]),
            row(
                "stall: time lost, base / load / loaded join (ms)",
                f"{s['lost_base_join_ms']:.1f} / {s['lost_load_join_ms']:.1f} / {s['lost_adapter_join_ms']:.1f}",
            ),
            row("stall: the load's extra time lost in steps", s["extra_lost_in_steps"]),
        ]
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)
