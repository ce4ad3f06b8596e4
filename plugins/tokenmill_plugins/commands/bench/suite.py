"""The comparison suite: ``tokenmill bench decode | sweep | prefix | prefill``.

Each scenario starts a real ``tokenmill serve`` subprocess (``bench.local_server``)
with the user's engine config, sends untimed warm-up requests (one, or for a
sweep as many at once as its largest level), runs the
scenario's load through ``bench.serve`` (streaming token-id completions, so
lengths are exact), stops the server, and only then measures Hugging Face
transformers on the same model (``bench.hf_baseline``), so the two never share
the cores. The report holds both sets of figures and their ratios, written as
speedups: above 1 means tokenmill is faster (throughput ratio tokenmill /
transformers, latency ratio transformers / tokenmill).

Called by ``bench.cli``; ``format_comparison`` renders any of the four reports.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.local_server import LocalServer, local_server
from tokenmill_plugins.commands.bench.metrics import TABLE_WIDTH, build_report, format_header, format_value
from tokenmill_plugins.commands.bench.serve import ServeOptions, make_requests, run_serve
from tokenmill_plugins.commands.bench.workload import random_token_ids, shared_prefix_prompts

if TYPE_CHECKING:  # torch loads only when a baseline or the roofline runs
    from tokenmill_plugins.commands.bench.hf_baseline import HFModel

logger = logging.getLogger(__name__)

#: Added to --seed for the warm-up request, so its prompt shares no prefix with a measured one.
_WARMUP_SEED_OFFSET = 1_000_003
_WARMUP_OUTPUT_LEN = 4
_METRICS_SETTLE_S = 5.0  # the engines report counters in heartbeats, every 0.5 s
_HITS, _QUERIES = "tokenmill:prefix_cache_hits_total", "tokenmill:prefix_cache_queries_total"


class SuiteError(TokenmillError):
    """A scenario cannot run as asked (its warm-up request failed); the message says what to change."""


@dataclass(frozen=True)
class SuiteOptions:
    """What every scenario shares; built by ``bench.cli`` from its flags."""

    config: EngineConfig  # the server's engine config (model, threads, dtype, caching, ...)
    seed: int = 0
    hf_baseline: bool = True
    server_timeout_s: float = 600.0  # for the server to load the model and become healthy
    request_timeout_s: float = 600.0
    show_progress: bool = True


def run_decode(
    options: SuiteOptions,
    *,
    input_len: int = 128,
    output_len: int = 128,
    num_requests: int = 5,
    peak_bandwidth_gbs: float | None = None,
) -> dict[str, Any]:
    """Single-stream decode: ``num_requests`` requests one after another; transformers batch 1.

    With ``peak_bandwidth_gbs`` (or on a GPU of ``roofline.KNOWN_PEAK_BANDWIDTH_GBS``) the report
    also has the decode step's memory roofline, at the ITL p50.
    """
    from tokenmill_plugins.commands.bench.roofline import resolve_peak_bandwidth_gbs

    device = _device(options.config)
    peak = resolve_peak_bandwidth_gbs(peak_bandwidth_gbs, device)  # fails before any server starts
    _check_inputs(options)
    with _server(options, options.config) as server:
        _warm_up(server, options, input_len)
        tokenmill = _run_load(
            server, options, num_requests=num_requests, input_len=input_len, output_len=output_len, seed=options.seed
        )
    transformers = None
    if (model := _load_baseline(options, device)) is not None:
        transformers = model.generate(random_token_ids([input_len], seed=options.seed), [output_len])
    hf = transformers or {}
    speedup = {
        "output_throughput": _ratio(tokenmill["output_throughput"], hf.get("output_throughput")),
        "ttft_p50": _ratio(hf.get("ttft_ms"), _p50(tokenmill, "ttft_ms")),
        "itl_p50": _ratio(hf.get("itl_ms"), _p50(tokenmill, "itl_ms")),
    }
    roofline = None
    if peak is not None and (itl_p50 := _p50(tokenmill, "itl_ms")):
        roofline = _roofline(options.config, device, input_len, output_len, itl_p50 / 1000, peak)
    parameters = _parameters(
        options,
        device,
        model,
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests,
        concurrency=1,
    )
    results = {"tokenmill": tokenmill, "transformers": transformers, "speedup": speedup, "roofline": roofline}
    return build_report("decode", parameters, results)


def run_sweep(
    options: SuiteOptions,
    *,
    concurrency: Sequence[int] = (1, 4, 16, 32, 64),
    input_len: int = 128,
    output_len: int = 128,
    num_requests: int | None = None,
    mixed: bool = False,
    hf_max_batch: int | None = None,
    peak_bandwidth_gbs: float | None = None,
) -> dict[str, Any]:
    """A concurrency sweep against one server: at each level ``num_requests`` (default
    ``max(2 * concurrency, 8)``) requests with at most ``concurrency`` in flight, each level with
    its own seed (``seed + index``) so no level reuses another's cached prompts. transformers runs
    the level's first ``concurrency`` requests as one static batch (levels above ``hf_max_batch``
    are skipped). ``mixed`` draws log-normal lengths (``workload.sample_lengths``).

    With ``peak_bandwidth_gbs`` (or on a known GPU) each level also has the roofline of a decode step of
    ``concurrency`` streams at its ITL p50 (``roofline``, else None)."""
    from tokenmill_plugins.commands.bench.roofline import resolve_peak_bandwidth_gbs

    device = _device(options.config)
    peak = resolve_peak_bandwidth_gbs(peak_bandwidth_gbs, device)
    _check_inputs(options)
    levels: list[dict[str, Any]] = [
        {"concurrency": c, "num_requests": num_requests or max(2 * c, 8), "seed": options.seed + i}
        for i, c in enumerate(concurrency)
    ]
    with _server(options, options.config) as server:
        _warm_up(server, options, input_len, concurrency=max(concurrency))
        for level in levels:
            level["tokenmill"] = _run_load(
                server,
                options,
                num_requests=level["num_requests"],
                input_len=input_len,
                output_len=output_len,
                seed=level["seed"],
                concurrency=level["concurrency"],
                mixed=mixed,
            )
    model = _load_baseline(options, device)
    for level in levels:
        level["transformers"] = None
        if model is not None and (hf_max_batch is None or level["concurrency"] <= hf_max_batch):
            requests = make_requests(
                ServeOptions(
                    url="",
                    num_requests=level["num_requests"],
                    input_len=input_len,
                    output_len=output_len,
                    mixed=mixed,
                    seed=level["seed"],
                )
            )[: level["concurrency"]]
            level["transformers"] = model.generate(
                [r.payload["prompt"] for r in requests], [r.max_tokens for r in requests]
            )
        hf = level["transformers"] or {}
        level["speedup"] = {
            "output_throughput": _ratio(level["tokenmill"]["output_throughput"], hf.get("output_throughput"))
        }
        level["roofline"] = None
        if peak is not None and not mixed and (itl_p50 := _p50(level["tokenmill"], "itl_ms")):
            level["roofline"] = _roofline(
                options.config, device, input_len, output_len, itl_p50 / 1000, peak, batch_size=level["concurrency"]
            )
    parameters = _parameters(
        options,
        device,
        model,
        concurrency=",".join(str(c) for c in concurrency),
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests if num_requests is not None else "max(2 x concurrency, 8)",
        mixed=mixed,
        hf_max_batch=hf_max_batch,
        peak_bandwidth_gbs=peak,
    )
    return build_report("sweep", parameters, {"levels": levels})


def run_prefix(
    options: SuiteOptions,
    *,
    prefix_len: int = 1000,
    question_lens: tuple[int, int] = (16, 32),
    output_len: int = 16,
    num_requests: int = 16,
) -> dict[str, Any]:
    """Shared prefix: prompts of one ``prefix_len``-token system prompt plus a distinct question,
    sent one at a time to a server with prefix caching on, then to one with it off. Each server
    first gets one warm-up prompt of the same shape (which fills the cache), not measured. The
    report has TTFT with and without caching, their ratio, the servers' prefix-cache counters over
    the measured requests, and transformers' prefill of the first measured prompt (no prefix cache)."""
    device = _device(options.config)
    _check_inputs(options)
    warmup, *prompts = shared_prefix_prompts(num_requests + 1, prefix_len, question_lens, seed=options.seed)
    mean_len = round(sum(len(p) for p in prompts) / len(prompts))
    runs: dict[str, dict[str, Any]] = {}
    for caching in (True, False):
        config = msgspec.structs.replace(
            options.config, cache=msgspec.structs.replace(options.config.cache, enable_prefix_caching=caching)
        )
        with _server(options, config) as server:
            _warm_up(server, options, len(warmup), prompt=warmup)
            before = server.metrics()
            run = _run_load(
                server,
                options,
                num_requests=num_requests,
                input_len=mean_len,
                output_len=output_len,
                seed=options.seed,
                prompts=prompts,
            )
            # Counters arrive in engine heartbeats: wait until every measured prompt was looked up.
            expected_queries = before.get(_QUERIES, 0.0) + (run["total_input_tokens"] if caching else 0)
            after = _settled_metrics(server, _QUERIES, expected_queries)
        run["prefix_cache_queries"] = int(after.get(_QUERIES, 0.0) - before.get(_QUERIES, 0.0))
        run["prefix_cache_hits"] = int(after.get(_HITS, 0.0) - before.get(_HITS, 0.0))
        runs["cached" if caching else "uncached"] = run
    transformers = None
    if (model := _load_baseline(options, device)) is not None:
        transformers = model.prefill(prompts[0])
    hf_ttft_ms = transformers["prefill_s"] * 1000 if transformers else None
    cached_p50, uncached_p50 = _p50(runs["cached"], "ttft_ms"), _p50(runs["uncached"], "ttft_ms")
    results = {
        **runs,
        "ttft_p50_cached_over_uncached": _ratio(cached_p50, uncached_p50),
        "transformers": transformers,
        "speedup": {
            "cached_ttft_p50": _ratio(hf_ttft_ms, cached_p50),
            "uncached_ttft_p50": _ratio(hf_ttft_ms, uncached_p50),
        },
    }
    parameters = _parameters(
        options,
        device,
        model,
        prefix_len=prefix_len,
        question_lens=f"{question_lens[0]}..{question_lens[1]}",
        output_len=output_len,
        num_requests=num_requests,
        concurrency=1,
    )
    return build_report("prefix", parameters, results)


def run_prefill(
    options: SuiteOptions, *, input_len: int = 2000, output_len: int = 1, num_requests: int = 3
) -> dict[str, Any]:
    """Long prefill: ``num_requests`` ``input_len``-token prompts one at a time; TTFT p50 and prefill
    tokens per second (``input_len`` / TTFT p50) against transformers' forward over the first prompt."""
    device = _device(options.config)
    _check_inputs(options)
    with _server(options, options.config) as server:
        _warm_up(server, options, input_len)
        tokenmill = _run_load(
            server, options, num_requests=num_requests, input_len=input_len, output_len=output_len, seed=options.seed
        )
    ttft_p50 = _p50(tokenmill, "ttft_ms")
    tokenmill["prefill_throughput"] = input_len / (ttft_p50 / 1000) if ttft_p50 else None
    transformers = None
    if (model := _load_baseline(options, device)) is not None:
        transformers = model.prefill(random_token_ids([input_len], seed=options.seed)[0])
    hf = transformers or {}
    speedup = {"prefill_throughput": _ratio(tokenmill["prefill_throughput"], hf.get("prefill_throughput"))}
    parameters = _parameters(
        options,
        device,
        model,
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests,
        concurrency=1,
    )
    results = {"tokenmill": tokenmill, "transformers": transformers, "speedup": speedup}
    return build_report("prefill", parameters, results)


# ----------------------------------------------------------------- the runs


@contextmanager
def _server(options: SuiteOptions, config: EngineConfig) -> Iterator[LocalServer]:
    """A ``tokenmill serve`` for one scenario, its config and log in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as work_dir:
        with local_server(config, Path(work_dir), timeout_s=options.server_timeout_s) as server:
            yield server


def _run_load(
    server: LocalServer,
    options: SuiteOptions,
    *,
    num_requests: int,
    input_len: int,
    output_len: int,
    seed: int,
    concurrency: int = 1,
    mixed: bool = False,
    prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """One ``bench serve`` run against ``server``; returns its results (``metrics.ServeSummary`` as a dict)."""
    report = run_serve(
        ServeOptions(
            url=server.url,
            num_requests=num_requests,
            input_len=input_len,
            output_len=output_len,
            concurrency=concurrency,
            mixed=mixed,
            seed=seed,
            api_key=server.api_key,
            timeout_s=options.request_timeout_s,
            show_progress=options.show_progress,
            prompts=prompts,
        )
    )
    server.check_alive(f"the run at concurrency {concurrency}")
    results: dict[str, Any] = report["results"]
    if results["num_failed"]:
        logger.warning("%d of %d requests failed: %s", results["num_failed"], num_requests, results["errors"])
    return results


def _warm_up(
    server: LocalServer,
    options: SuiteOptions,
    input_len: int,
    *,
    prompt: list[int] | None = None,
    concurrency: int = 1,
) -> None:
    """Untimed requests (fresh random prompts of ``input_len``, or ``prompt``), so one-time costs are not
    measured: one, or ``concurrency`` at once, so that batches as large as the load's are seen too (on a GPU,
    Triton compiles kernels for new batch shapes on first use). Raises ``SuiteError`` when one fails: the
    measured requests would fail too."""
    results = _run_load(
        server,
        replace(options, show_progress=False),
        num_requests=concurrency,
        input_len=input_len,
        output_len=_WARMUP_OUTPUT_LEN,
        seed=options.seed + _WARMUP_SEED_OFFSET,
        concurrency=concurrency,
        prompts=[prompt] if prompt is not None else None,
    )
    if results["num_completed"] != concurrency:
        error = next(iter(results["errors"]), "unknown error")
        raise SuiteError(
            f"the warm-up request ({input_len} prompt tokens) failed: {error} "
            f"(the server log's tail is above; its last line: {server.log_summary()})"
        )


def _settled_metrics(server: LocalServer, name: str, at_least: float) -> dict[str, float]:
    """``/metrics`` once the counter ``name`` reaches ``at_least`` (or after ``_METRICS_SETTLE_S``)."""
    deadline = time.monotonic() + _METRICS_SETTLE_S
    while True:
        metrics = server.metrics()
        if metrics.get(name, 0.0) >= at_least or time.monotonic() > deadline:
            return metrics
        time.sleep(0.25)


def _device(config: EngineConfig) -> str:
    """Where the server runs the model: "cpu" or "cuda" (``auto`` resolved as the engine does)."""
    from tokenmill.model_loader import resolve_device

    return resolve_device(config.device.device).type


def _check_inputs(options: SuiteOptions) -> None:
    """Fail in a second, not after the tokenmill run: the model must exist (the default one is pulled
    now) and, for the baseline, transformers must be installed."""
    from tokenmill.model_files import resolve_model

    if not options.config.server.engines:  # remote engines load their own model
        resolve_model(options.config.model.model)
    if options.hf_baseline:
        from tokenmill_plugins.commands.bench.hf_baseline import check_transformers

        check_transformers()


def _load_baseline(options: SuiteOptions, device: str) -> HFModel | None:
    """transformers on the server's model, device, dtype and thread count; None with --no-hf-baseline."""
    if not options.hf_baseline:
        return None
    from tokenmill.model_files import resolve_model
    from tokenmill_plugins.commands.bench.hf_baseline import HFModel

    config = options.config
    return HFModel.load(
        resolve_model(config.model.model),
        device=device,
        dtype=_dtype(config, device),
        num_threads=config.device.num_threads,
    )


def _dtype(config: EngineConfig, device: str) -> str:
    """The dtype the engine computes in ("float32", ...), resolved as the model loader does."""
    import torch

    from tokenmill.model_loader import resolve_dtype
    from tokenmill_plugins.commands.bench.roofline import read_architecture

    dtype = resolve_dtype(config.model.dtype, read_architecture(config), torch.device(device))
    return str(dtype).removeprefix("torch.")


def _roofline(
    config: EngineConfig,
    device: str,
    input_len: int,
    output_len: int,
    step_time_s: float,
    peak_gbs: float,
    *,
    batch_size: int = 1,
) -> dict[str, Any]:
    from tokenmill_plugins.commands.bench.roofline import decode_step_roofline, read_architecture

    arch = read_architecture(config)
    dtype = _dtype(config, device)
    quantization = config.model.quantization
    if quantization != "none" and (quantization != "auto" or getattr(arch, "stored_weight_type", None)):
        logger.warning(
            "the roofline counts dense %s weights; quantization %r may store fewer bytes, "
            "so the fraction is an upper bound",
            dtype,
            quantization,
        )
    roofline = decode_step_roofline(
        arch,
        dtype=dtype,
        input_len=input_len,
        output_len=output_len,
        step_time_s=step_time_s,
        peak_bandwidth_gbs=peak_gbs,
        batch_size=batch_size,
    )
    return asdict(roofline)


def _parameters(options: SuiteOptions, device: str, model: HFModel | None, **scenario: Any) -> dict[str, Any]:
    """A report's parameters: what every scenario has, then ``scenario``'s own, then the resolved config."""
    config = options.config
    return {
        "model": config.model.model,
        "device": device,
        "num_threads": config.device.num_threads,
        "seed": options.seed,
        "hf_baseline": options.hf_baseline,
        "hf_dtype": model.dtype if model is not None else None,
        **scenario,
        "config": config.to_dict(),
    }


def _p50(results: dict[str, Any], name: str) -> float | None:
    stats = results.get(name)
    return float(stats["p50"]) if stats else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


# ----------------------------------------------------------------- the tables


def format_comparison(report: dict[str, Any]) -> str:
    """A suite report (from any ``run_*`` here) as aligned text, with its "vs transformers" lines."""
    results = report["results"]
    body = _BODIES[report["benchmark"]](results)
    runs = [results.get("tokenmill"), results.get("cached"), results.get("uncached")]
    runs += [level["tokenmill"] for level in results.get("levels", [])]
    errors: dict[str, int] = {}
    for run in runs:
        for text, count in ((run or {}).get("errors") or {}).items():
            errors[text] = errors.get(text, 0) + count
    lines = [*format_header(report), *body]
    if errors:
        lines += ["-" * TABLE_WIDTH, "Errors:", *(f"{count:>6} x {text}" for text, count in errors.items())]
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


_LABEL_WIDTH = 25
_CELL_WIDTH = 13


def _columns(label: str, *cells: Any) -> str:
    return f"{label:<{_LABEL_WIDTH}}" + "".join(f"{format_value(cell):>{_CELL_WIDTH}}" for cell in cells)


def _times(ratio: float | None) -> str:
    return "not measured" if ratio is None else f"{ratio:.2f}x"


def _ratio_line(label: str, ratio: float | None) -> str:
    return f"{label:<{TABLE_WIDTH - 16}}{_times(ratio):>16}"


def _requests(results: dict[str, Any]) -> str:
    return f"{results['num_completed']} ok, {results['num_failed']} failed"


def _decode_body(results: dict[str, Any]) -> list[str]:
    tm, hf, speedup = results["tokenmill"], results["transformers"] or {}, results["speedup"]
    lines = [
        _columns("", "tokenmill", "transformers"),
        _columns("Requests", _requests(tm), f"batch {hf['batch_size']}" if hf else None),
        _columns("Output tokens", tm["total_output_tokens"], hf.get("num_output_tokens")),
        _columns("Output tok/s", tm["output_throughput"], hf.get("output_throughput")),
        _columns("TTFT p50 (ms)", _p50(tm, "ttft_ms"), hf.get("ttft_ms")),
        _columns("ITL p50 (ms)", _p50(tm, "itl_ms"), hf.get("itl_ms")),
        "-" * TABLE_WIDTH,
        _ratio_line("vs transformers: output tok/s", speedup["output_throughput"]),
        _ratio_line("vs transformers: TTFT p50 (faster by)", speedup["ttft_p50"]),
        _ratio_line("vs transformers: ITL p50 (faster by)", speedup["itl_p50"]),
    ]
    roofline = results.get("roofline")
    if roofline:
        lines += [
            "-" * TABLE_WIDTH,
            _columns("Decode step reads (MB)", (roofline["weight_bytes"] + roofline["kv_bytes"]) / 1e6),
            _columns("Achieved bandwidth (GB/s)", roofline["achieved_gbs"]),
            _columns("Peak bandwidth (GB/s)", roofline["peak_bandwidth_gbs"]),
            _columns("Fraction of roofline", roofline["fraction"]),
        ]
    return lines


def _sweep_body(results: dict[str, Any]) -> list[str]:
    widths = (5, 8, 9, 10, 9, 10, 7, 6)  # sums to TABLE_WIDTH; "128/128" fits its column
    header = ("conc", "reqs", "tok/s", "TTFT p50", "ITL p50", "HF tok/s", "vs HF", "roof")
    lines = ["".join(f"{name:>{w}}" for name, w in zip(header, widths, strict=True))]
    for level in results["levels"]:
        tm, hf = level["tokenmill"], level["transformers"] or {}
        cells = (
            level["concurrency"],
            f"{tm['num_completed']}/{level['num_requests']}",
            tm["output_throughput"],
            _p50(tm, "ttft_ms"),
            _p50(tm, "itl_ms"),
            hf.get("output_throughput"),
            _times(level["speedup"]["output_throughput"]) if hf else "-",
            f"{level['roofline']['fraction']:.0%}" if level.get("roofline") else "-",
        )
        lines.append("".join(f"{format_value(cell):>{w}}" for cell, w in zip(cells, widths, strict=True)))
    lines += [
        "-" * TABLE_WIDTH,
        "tok/s: output tokens per second; TTFT, ITL: p50 in ms;",
        "HF: transformers, one static batch of `conc` rows.",
        "roof: the decode step's fraction of the memory roofline (at the ITL p50).",
    ]
    return lines


def _prefix_body(results: dict[str, Any]) -> list[str]:
    cached, uncached, hf = results["cached"], results["uncached"], results["transformers"] or {}
    hf_ttft = hf["prefill_s"] * 1000 if hf else None
    speedup = results["speedup"]
    return [
        _columns("", "cached", "uncached", "transformers"),
        _columns("Requests", cached["num_completed"], uncached["num_completed"]),
        _columns("TTFT p50 (ms)", _p50(cached, "ttft_ms"), _p50(uncached, "ttft_ms"), hf_ttft),
        _columns("TTFT p95 (ms)", (cached["ttft_ms"] or {}).get("p95"), (uncached["ttft_ms"] or {}).get("p95")),
        _columns("ITL p50 (ms)", _p50(cached, "itl_ms"), _p50(uncached, "itl_ms")),
        _columns("Prefix-cache hit tokens", cached["prefix_cache_hits"], uncached["prefix_cache_hits"]),
        "-" * TABLE_WIDTH,
        _ratio_line("TTFT p50, cached / uncached", results["ttft_p50_cached_over_uncached"]),
        _ratio_line("vs transformers: TTFT p50 cached (faster by)", speedup["cached_ttft_p50"]),
        _ratio_line("vs transformers: TTFT p50 uncached (faster by)", speedup["uncached_ttft_p50"]),
    ]


def _prefill_body(results: dict[str, Any]) -> list[str]:
    tm, hf = results["tokenmill"], results["transformers"] or {}
    return [
        _columns("", "tokenmill", "transformers"),
        _columns("Requests", _requests(tm)),
        _columns("TTFT p50 (ms)", _p50(tm, "ttft_ms"), hf["prefill_s"] * 1000 if hf else None),
        _columns("Prefill tok/s", tm["prefill_throughput"], hf.get("prefill_throughput")),
        "-" * TABLE_WIDTH,
        _ratio_line("vs transformers: prefill tok/s", results["speedup"]["prefill_throughput"]),
    ]


_BODIES = {"decode": _decode_body, "sweep": _sweep_body, "prefix": _prefix_body, "prefill": _prefill_body}
