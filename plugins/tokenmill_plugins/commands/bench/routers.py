"""``tokenmill bench routers``: routers compared on the same workload, each behind its own fresh server.

For each workload and each router, a ``tokenmill serve`` with ``--data-parallel-size 2`` (or the config's,
if larger) and that ``--router`` starts with cold caches, the workload's requests stream through it
(``bench.serve``: the same prompts, output lengths and arrival times for every router), and the report gives
the prefix cache hit rate (prompt tokens served from the engines' prefix caches over prompt tokens looked
up, from ``/metrics``), TTFT p50/p99, end-to-end p50, output throughput and how many requests each engine
finished, plus each router's ratios to ``round_robin`` on the same workload.

Workloads (``--workload``):

- ``shared-prefix``: several tenants, each with a long system prompt, and requests each made of its
  tenant's system prompt and a short distinct user suffix, tenants interleaved at random
  (``workload.multi_tenant_prompts``). Unless ``--num-kv-blocks`` is given, each engine's KV cache holds
  ``--kv-fraction`` of all the tenants' system prompts (plus room for the running requests): a router that
  sends every tenant to every engine makes each cache cycle through all of them, one that keeps tenants
  apart lets each engine keep its own tenants' prefixes.
- ``mixed``: random prompts and outputs of seeded log-normal lengths (means ``--input-len`` and
  ``--output-len``, clipped to 1/4..4x), where a router blind to load can stack long requests on one
  engine.

This module imports no torch (the servers are subprocesses).
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

from tokenmill.config import EngineConfig
from tokenmill_plugins.commands.bench.local_server import LocalServer, local_server
from tokenmill_plugins.commands.bench.metrics import build_report
from tokenmill_plugins.commands.bench.serve import ServeOptions, run_serve
from tokenmill_plugins.commands.bench.workload import multi_tenant_prompts

logger = logging.getLogger(__name__)

WORKLOADS = ("shared-prefix", "mixed")
BASELINE = "round_robin"


@dataclass(frozen=True)
class RouterBenchOptions:
    """The parameters of one ``bench routers`` run (all of them go into the report)."""

    routers: tuple[str, ...] = ("round_robin", "least_loaded", "prefix_aware")
    workloads: tuple[str, ...] = WORKLOADS
    num_requests: int = 200
    concurrency: int = 16
    request_rate: float = math.inf
    output_len: int = 64
    # shared-prefix
    num_tenants: int = 8
    system_prompt_len: int = 1024
    suffix_lens: tuple[int, int] = (16, 64)
    kv_fraction: float = 0.6
    # mixed
    input_len: int = 512
    seed: int = 0
    server_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    show_progress: bool = True


def shared_prefix_kv_blocks(options: RouterBenchOptions, block_size: int) -> int:
    """KV blocks per engine for ``shared-prefix``: ``kv_fraction`` of every tenant's system prompt, plus each
    running request's suffix and output, and never less than one whole request."""
    blocks = lambda tokens: -(-tokens // block_size)  # noqa: E731
    prefixes = blocks(math.ceil(options.kv_fraction * options.num_tenants * options.system_prompt_len))
    per_request = blocks(options.suffix_lens[1] + options.output_len) + 1
    one_request = blocks(options.system_prompt_len + options.suffix_lens[1] + options.output_len) + 1
    return max(prefixes + options.concurrency * per_request, one_request)


def _engine_samples(server: LocalServer, name: str) -> dict[str, float]:
    """``name``'s samples summed per engine (label ``engine``)."""
    response = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10)
    response.raise_for_status()
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if not line.startswith(name + "{"):
            continue
        sample, value = line.rsplit(" ", 1)
        engine = next((part.split("=", 1)[1].strip('"') for part in sample[len(name) + 1 : -1].split(",")
                       if part.startswith("engine=")), "?")  # fmt: skip
        values[engine] = values.get(engine, 0.0) + float(value)
    return values


def _serve_options(options: RouterBenchOptions, workload: str, url: str) -> ServeOptions:
    prompts = None
    if workload == "shared-prefix":
        prompts, _ = multi_tenant_prompts(options.num_requests, options.num_tenants, options.system_prompt_len,
                                          options.suffix_lens, seed=options.seed)  # fmt: skip
    return ServeOptions(
        url=url, num_requests=options.num_requests, input_len=options.input_len, output_len=options.output_len,
        concurrency=options.concurrency, request_rate=options.request_rate, mixed=workload == "mixed",
        seed=options.seed, timeout_s=options.request_timeout_s, show_progress=options.show_progress, prompts=prompts,
    )  # fmt: skip


def _server_config(config: EngineConfig, options: RouterBenchOptions, workload: str, router: str) -> EngineConfig:
    server = msgspec.structs.replace(
        config.server, router=router, data_parallel_size=max(2, config.server.data_parallel_size)
    )
    cache = config.cache
    if workload == "shared-prefix" and cache.num_kv_blocks is None:
        cache = msgspec.structs.replace(cache, num_kv_blocks=shared_prefix_kv_blocks(options, cache.block_size))
    return msgspec.structs.replace(config, server=server, cache=cache)


def _run_one(
    config: EngineConfig, options: RouterBenchOptions, workload: str, router: str, work_dir: Path
) -> dict[str, Any]:
    server_config = _server_config(config, options, workload, router)
    logger.info("%s with router %s: %d engines, %s KV blocks each", workload, router,
                server_config.server.data_parallel_size, server_config.cache.num_kv_blocks or "auto")  # fmt: skip
    with local_server(server_config, work_dir, timeout_s=options.server_timeout_s) as server:
        before = server.metrics()
        finished_before = _engine_samples(server, "tokenmill:request_success_total")
        report = run_serve(_serve_options(options, workload, server.url))
        server.check_alive(f"the {workload} workload with router {router}")
        after = server.metrics()
        finished = _engine_samples(server, "tokenmill:request_success_total")
    queries = after.get("tokenmill:prefix_cache_queries_total", 0.0) - before.get(
        "tokenmill:prefix_cache_queries_total", 0.0
    )
    hits = after.get("tokenmill:prefix_cache_hits_total", 0.0) - before.get("tokenmill:prefix_cache_hits_total", 0.0)
    fallbacks = after.get("tokenmill:router_fallbacks_total", 0.0) - before.get("tokenmill:router_fallbacks_total", 0.0)
    results = report["results"]
    return {
        "workload": workload,
        "router": router,
        "data_parallel_size": server_config.server.data_parallel_size,
        "kv_blocks_per_engine": server_config.cache.num_kv_blocks,
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "ttft_p50_ms": round(results["ttft_ms"]["p50"], 1),
        "ttft_p99_ms": round(results["ttft_ms"]["p99"], 1),
        "e2e_p50_ms": round(results["e2e_ms"]["p50"], 1),
        "output_throughput": round(results["output_throughput"], 1),
        "num_failed": results["num_failed"],
        "requests_per_engine": {e: int(finished[e] - finished_before.get(e, 0.0)) for e in sorted(finished)},
        "router_fallbacks": int(fallbacks),
    }


def _comparisons(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each router's ratios to round_robin on the same workload (hit rate up is better, TTFT down)."""
    rows = []
    for run in runs:
        base = next((r for r in runs if r["workload"] == run["workload"] and r["router"] == BASELINE), None)
        if base is None or run is base:
            continue
        ratio = lambda a, b: round(a / b, 3) if b else None  # noqa: E731
        rows.append({
            "workload": run["workload"], "router": run["router"],
            "hit_rate_vs_round_robin": ratio(run["prefix_cache_hit_rate"], base["prefix_cache_hit_rate"]),
            "ttft_p50_vs_round_robin": ratio(run["ttft_p50_ms"], base["ttft_p50_ms"]),
            "ttft_p99_vs_round_robin": ratio(run["ttft_p99_ms"], base["ttft_p99_ms"]),
        })  # fmt: skip
    return rows


def run_routers(config: EngineConfig, options: RouterBenchOptions) -> dict[str, Any]:
    """Every workload under every router, one fresh server each; returns the report."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-routers-") as scratch:
        for workload in options.workloads:
            for router in options.routers:
                runs.append(_run_one(config, options, workload, router, Path(scratch)))
    parameters = {**{k: getattr(options, k) for k in options.__dataclass_fields__}, "model": config.model.model}
    return build_report("routers", parameters, {"runs": runs, "comparisons": _comparisons(runs)})


def format_routers(report: dict[str, Any]) -> str:
    """The report as two short tables: the runs, then the ratios to round_robin."""
    lines = [
        "| workload | router | prefix hit rate | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | out tok/s | per engine "
        "| failed | fallbacks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in report["results"]["runs"]:
        per_engine = "/".join(str(n) for n in run["requests_per_engine"].values())
        lines.append(
            f"| {run['workload']} | {run['router']} | {run['prefix_cache_hit_rate']:.1%} | {run['ttft_p50_ms']} | "
            f"{run['ttft_p99_ms']} | {run['e2e_p50_ms']} | {run['output_throughput']} | {per_engine} | "
            f"{run['num_failed']} | {run['router_fallbacks']} |"
        )
    comparisons = report["results"]["comparisons"]
    if comparisons:
        lines += ["", "| workload | router | hit rate / round_robin | TTFT p50 / round_robin | "
                  "TTFT p99 / round_robin |", "|---|---|---|---|---|"]  # fmt: skip
        for row in comparisons:
            ratios = [row[f"{key}_vs_round_robin"] for key in ("hit_rate", "ttft_p50", "ttft_p99")]
            cells = " | ".join("n/a" if ratio is None else f"{ratio}x" for ratio in ratios)
            lines.append(f"| {row['workload']} | {row['router']} | {cells} |")
    return "\n".join(lines)
