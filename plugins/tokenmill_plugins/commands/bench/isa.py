"""``bench isa``: the same workloads at every instruction-set level the CPU kernels support, and llama-server.

A *level* (``avx2``, ``avx_vnni``, ``avx512``, ``avx512_vnni16``, ``amx``; ``tokenmill_kernels.cpu_isa``) stands for
a CPU that has that and nothing above it: each kernel with variants (the int4/int8 matmul, paged attention, the dense
float32 matmul) runs the best variant it has at or below the level, so ``avx_vnni`` runs the matmul's
``avx_vnni`` with ``avx2`` attention and dense matmul, as a CPU with AVX-VNNI and no AVX-512 would. The layer
kernels (norms, rope) have one variant and torch's own operators are not capped (``ATEN_CPU_CAPABILITY`` and
``ONEDNN_MAX_CPU_ISA`` do that for torch, for a whole run). The levels run are those of ``--isa``, by default every
level some kernel supports on this CPU.

Per level, in one round: ``bench step`` at each batch size in this process (one engine, its kernels switched with
``set_isa``), then a fresh ``tokenmill serve`` started with ``TOKENMILL_CPU_ISA=LEVEL`` (its engine processes
inherit it and their kernels apply it as they load), warmed up with as many requests at once as the largest
concurrency, and one ``bench serve`` load per concurrency level (token-id prompts, ``ignore_eos``). With
``--llama-server PATH`` that binary is started on the same GGUF after the levels in each round and gets the same
warm-up and loads from the same client. Rounds repeat (``--repeats``), so the order is v1, v2, ..., llama, v1, v2,
..., llama: a shared machine's drift spreads over every variant instead of landing on one. Figures are reported
per round and as medians over the rounds; the speedups against llama-server are of the medians, written so that
above 1 means tokenmill is faster (ITL llama / tokenmill, throughput tokenmill / llama).

``format_isa`` renders the report as a markdown section to paste into docs/benchmarks.md: one table per CPU,
one row per level and one for llama-server.
"""

from __future__ import annotations

import logging
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench.local_server import free_port, start_local_server
from tokenmill_plugins.commands.bench.metrics import build_report, format_value
from tokenmill_plugins.commands.bench.serve import ServeOptions, run_serve

logger = logging.getLogger(__name__)

#: The /proc/cpuinfo flags the report records: what the kernels' variants need, and AVX-512 F for the rest.
CPU_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_vnni")
#: Added to --seed for the warm-up requests, so their prompts share no prefix with a measured one.
_WARMUP_SEED_OFFSET = 1_000_003
_WARMUP_OUTPUT_LEN = 4
#: Tokens of each llama-server slot beyond a request's prompt and output.
_SLOT_MARGIN = 64
_POLL_INTERVAL_S = 0.3
_STOP_TIMEOUT_S = 30.0
#: The kernels' short names in the table.
_SHORT_NAMES = {"quant_matmul": "quant", "paged_attention": "attention", "dense_matmul": "dense"}


class IsaBenchError(TokenmillError):
    """``bench isa`` cannot run as asked (an unsupported level, no GGUF for llama-server, a server that fails)."""


@dataclass(frozen=True)
class IsaBenchOptions:
    """The parameters of one ``bench isa`` run; built by ``bench.cli`` from its flags."""

    levels: tuple[str, ...]
    repeats: int = 1
    batch_sizes: tuple[int, ...] = (1, 32)  # bench step
    context_len: int = 256  # bench step: tokens cached per request
    num_steps: int = 20  # bench step: timed steps (median)
    concurrency: tuple[int, ...] = (1, 32)  # end-to-end decode: streams at once
    input_len: int = 128
    output_len: int = 128
    num_requests: int | None = None  # per concurrency level; None: max(2 x concurrency, 8)
    llama_server: Path | None = None
    seed: int = 0
    server_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    show_progress: bool = True

    def requests_at(self, concurrency: int) -> int:
        return self.num_requests or max(2 * concurrency, 8)


# ------------------------------------------------------------------ the kernels and the machine


def kernel_launchers() -> dict[str, ModuleType]:
    """The CPU kernels with variants that can run here, by name (each has ``supported_isas``/``set_isa``)."""
    from tokenmill_kernels.dense_matmul import cpu as dense_matmul
    from tokenmill_kernels.paged_attention import cpu as paged_attention
    from tokenmill_kernels.quant_matmul import cpu as quant_matmul

    launchers = {"quant_matmul": quant_matmul, "paged_attention": paged_attention, "dense_matmul": dense_matmul}
    return {name: launcher for name, launcher in launchers.items() if launcher.is_available()}


def supported_levels(launchers: dict[str, ModuleType]) -> list[str]:
    """The levels some kernel has a variant of on this CPU, lowest first."""
    from tokenmill_kernels.cpu_isa import ISA_LEVELS

    names = {name for launcher in launchers.values() for name in launcher.supported_isas()}
    return [level for level in ISA_LEVELS if level in names]


def check_levels(requested: Sequence[str] | None, supported: Sequence[str]) -> tuple[str, ...]:
    """``requested`` (all of ``supported`` when None) in the order given; ``IsaBenchError`` for one not supported."""
    if not supported:
        raise IsaBenchError("no CPU kernel with variants can run here (they need AVX2, FMA and a C++ compiler)")
    if requested is None:
        return tuple(supported)
    for level in requested:
        if level not in supported:
            raise IsaBenchError(f"{level!r} is not a level this CPU's kernels support ({', '.join(supported)})")
    return tuple(dict.fromkeys(requested))


def variants_at(level: str, launchers: dict[str, ModuleType]) -> dict[str, str]:
    """The variant each kernel runs at ``level``: its best at or below it (``tokenmill_kernels.cpu_isa``)."""
    from tokenmill_kernels.cpu_isa import variant_for_level

    return {name: variant_for_level(launcher.supported_isas(), level) for name, launcher in launchers.items()}


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The first CPU's ``model name``, ``cpu family`` and ``model`` (None where unreadable; a virtual machine may
    name only the vendor, and the family and model tell the generation) and which of :data:`CPU_FLAGS` it has."""
    fields: dict[str, str] = {}
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "model_name": fields.get("model name"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "flags": {flag: flag in flags for flag in CPU_FLAGS},
    }


def git_commit(directory: Path | None = None) -> dict[str, Any] | None:
    """The commit of the tokenmill tree this runs from, and whether tracked files differ from it (``dirty``);
    None when it is not a git checkout."""
    if directory is None:
        import tokenmill

        directory = Path(tokenmill.__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


# ------------------------------------------------------------------ the servers


@contextmanager
def _tokenmill_server(config: EngineConfig, work_dir: Path, level: str, timeout_s: float) -> Iterator[str]:
    """A ``tokenmill serve`` whose processes start with ``TOKENMILL_CPU_ISA=level``; yields its URL."""
    from tokenmill_kernels.cpu_isa import ISA_LEVEL_ENV

    # The server inherits this process's environment when it starts: set the variable for that moment only.
    previous = os.environ.get(ISA_LEVEL_ENV)
    os.environ[ISA_LEVEL_ENV] = level
    try:
        server = start_local_server(config, work_dir, timeout_s=timeout_s)
    finally:
        if previous is None:
            del os.environ[ISA_LEVEL_ENV]
        else:
            os.environ[ISA_LEVEL_ENV] = previous
    try:
        yield server.url
        server.check_alive(f"the {level} runs")
    finally:
        server.stop()


def llama_server_flags(*, num_threads: int, num_slots: int, slot_context: int) -> list[str]:
    """llama-server's flags beyond the model and address: ``num_slots`` parallel slots of ``slot_context`` tokens
    each, continuous batching, and ``num_threads`` threads for decode and prompt batches alike."""
    return [
        "-np", str(num_slots), "-cb", "-c", str(num_slots * slot_context),
        "-t", str(num_threads), "-tb", str(num_threads),
    ]  # fmt: skip


@contextmanager
def llama_server(binary: Path, model: Path, flags: Sequence[str], work_dir: Path, timeout_s: float) -> Iterator[str]:
    """Start ``binary`` (llama-server) on ``model`` on a free loopback port with ``flags``, wait for ``GET /health``
    to answer 200 (it answers 503 while the model loads), yield its URL, and stop it. ``IsaBenchError`` with the
    log's last line when it exits first or is not healthy in ``timeout_s``."""
    port = free_port()
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *flags]
    log_path = work_dir / f"llama-server-{port}.log"
    logger.info("starting %s (log: %s)", " ".join(command), log_path)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _is_healthy(url):
            if process.poll() is not None:
                raise IsaBenchError(f"llama-server exited with status {process.returncode}: {_last_line(log_path)}")
            if time.monotonic() > deadline:
                raise IsaBenchError(f"llama-server was not healthy after {timeout_s:.0f} s: {_last_line(log_path)}")
            time.sleep(_POLL_INTERVAL_S)
        yield url
        if process.poll() is not None:
            raise IsaBenchError(f"llama-server exited during the runs: {_last_line(log_path)}")
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _last_line(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "(the log is empty)"


# ------------------------------------------------------------------ the workloads


def _decode_runs(
    url: str, options: IsaBenchOptions, vocab_size: int, api_key: str | None = None
) -> dict[str, dict[str, Any]]:
    """The warm-up, then one load per concurrency level against ``url`` (token-id prompts below ``vocab_size``):
    the figures of each, by level."""

    def load(concurrency: int, num_requests: int, output_len: int, seed: int, progress: bool) -> dict[str, Any]:
        serve_options = ServeOptions(
            url=url, num_requests=num_requests, input_len=options.input_len, output_len=output_len,
            concurrency=concurrency, seed=seed, api_key=api_key, timeout_s=options.request_timeout_s,
            show_progress=progress, vocab_size=vocab_size,
        )  # fmt: skip
        results: dict[str, Any] = run_serve(serve_options)["results"]
        if results["num_failed"]:
            logger.warning("%d of %d requests failed: %s", results["num_failed"], num_requests, results["errors"])
        return results

    widest = max(options.concurrency)
    warm_up = load(widest, widest, _WARMUP_OUTPUT_LEN, options.seed + _WARMUP_SEED_OFFSET, False)
    if warm_up["num_completed"] != widest:
        raise IsaBenchError(f"the warm-up requests to {url} failed: {next(iter(warm_up['errors']), 'unknown error')}")
    runs = {}
    for index, concurrency in enumerate(options.concurrency):
        results = load(
            concurrency, options.requests_at(concurrency), options.output_len, options.seed + index,
            options.show_progress,
        )  # fmt: skip
        runs[str(concurrency)] = {
            "output_throughput": results["output_throughput"],
            "itl_p50_ms": (results["itl_ms"] or {}).get("p50"),
            "ttft_p50_ms": (results["ttft_ms"] or {}).get("p50"),
            "num_completed": results["num_completed"],
            "num_failed": results["num_failed"],
        }
    return runs


def _medians(runs: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, float | None]]:
    """Each figure's median over the rounds: ``{workload key: {figure: median}}``."""
    medians: dict[str, dict[str, float | None]] = {}
    for key in runs[0]:
        medians[key] = {}
        for figure in runs[0][key]:
            values = [run[key][figure] for run in runs if run[key][figure] is not None]
            medians[key][figure] = statistics.median(values) if values else None
    return medians


def _speedups(
    tokenmill: dict[str, dict[str, Any]], llama: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float | None]]:
    """Per concurrency level: ITL p50 llama / tokenmill and output tok/s tokenmill / llama (above 1: tokenmill
    is faster)."""

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return numerator / denominator if numerator and denominator else None

    return {
        level: {
            "itl_p50": ratio(llama[level]["itl_p50_ms"], figures["itl_p50_ms"]),
            "output_throughput": ratio(figures["output_throughput"], llama[level]["output_throughput"]),
        }
        for level, figures in tokenmill.items()
    }


def run_isa(config: EngineConfig, options: IsaBenchOptions) -> dict[str, Any]:
    """Every level of ``options.levels`` through ``bench step`` and end-to-end decode, round after round, then
    llama-server in each round when given; the report (see ``format_isa``)."""
    import torch

    from tokenmill.engine import EngineCore
    from tokenmill.model_files import resolve_model
    from tokenmill.model_loader import resolve_device
    from tokenmill_plugins.commands.bench.step import run_step

    if resolve_device(config.device.device).type != "cpu":
        raise IsaBenchError("bench isa compares the CPU kernels' variants: run it with --device cpu")
    launchers = kernel_launchers()
    check_levels(options.levels, supported_levels(launchers))
    model = resolve_model(config.model.model)
    if options.llama_server is not None and model.suffix.lower() != ".gguf":
        raise IsaBenchError(f"--llama-server needs a .gguf model, and the model is {model}: pass --model FILE.gguf")
    engine = EngineCore(config)
    num_threads = torch.get_num_threads()
    variants: list[dict[str, Any]] = [
        {"isa": level, "kernels": variants_at(level, launchers), "runs": []} for level in options.levels
    ]
    llama: dict[str, Any] | None = None
    if options.llama_server is not None:
        flags = llama_server_flags(
            num_threads=num_threads, num_slots=max(options.concurrency),
            slot_context=options.input_len + options.output_len + _SLOT_MARGIN,
        )  # fmt: skip
        llama = {"binary": str(options.llama_server), "model": str(model), "flags": flags, "runs": []}
    before = {name: launcher.isa() for name, launcher in launchers.items()}
    try:
        with tempfile.TemporaryDirectory(prefix="tokenmill-bench-isa-") as work:
            for repeat in range(options.repeats):
                for variant in variants:
                    logger.info("round %d of %d: %s %s", repeat + 1, options.repeats, variant["isa"],
                                variant["kernels"])  # fmt: skip
                    for name, isa in variant["kernels"].items():
                        launchers[name].set_isa(isa)
                    step = {
                        str(size): run_step(
                            engine, batch_size=size, context_len=options.context_len, num_steps=options.num_steps,
                            seed=options.seed,
                        )["results"]
                        for size in options.batch_sizes
                    }  # fmt: skip
                    timeout = options.server_timeout_s
                    with _tokenmill_server(config, Path(work), variant["isa"], timeout) as url:
                        decode = _decode_runs(url, options, engine.vocab_size, config.server.api_key)
                    variant["runs"].append({"step": step, "decode": decode})
                if llama is not None and options.llama_server is not None:
                    with llama_server(options.llama_server, model, llama["flags"], Path(work),
                                      options.server_timeout_s) as url:  # fmt: skip
                        llama["runs"].append({"decode": _decode_runs(url, options, engine.vocab_size)})
    finally:
        for name, isa in before.items():
            launchers[name].set_isa(isa)
        engine.close()
    for variant in variants:
        variant["median"] = {
            "step": _medians([run["step"] for run in variant["runs"]]),
            "decode": _medians([run["decode"] for run in variant["runs"]]),
        }
    if llama is not None:
        llama["median"] = {"decode": _medians([run["decode"] for run in llama["runs"]])}
        for variant in variants:
            variant["speedup_vs_llama_server"] = _speedups(variant["median"]["decode"], llama["median"]["decode"])
    parameters = {
        "model": model.name,
        **{k: v for k, v in asdict(options).items() if k not in ("show_progress", "llama_server")},
        "num_requests": {str(c): options.requests_at(c) for c in options.concurrency},
        "llama_server": str(options.llama_server) if options.llama_server else None,
        "num_threads": num_threads,
        "config": config.to_dict(),
    }
    results = {
        "cpu": cpu_info(),
        "git": git_commit(),
        "torch_threads": num_threads,
        "variants": variants,
        "llama_server": llama,
    }
    return build_report("isa", parameters, results)


# ------------------------------------------------------------------ the table


def format_isa(report: dict[str, Any]) -> str:
    """A markdown section for docs/benchmarks.md: the CPU as its heading, what ran, and one table with a row per
    level (and llama-server): each ``bench step`` batch's step ms with its linears / attention / other (and, for
    a mixture of experts, its fused experts after the linears) and the host time of a step run module by module
    (``other_in_step_ms``: without a fused decoder, the step's own), each
    concurrency's output tok/s and ITL p50, and the speedups against llama-server (first level's ITL, last
    level's throughput)."""
    parameters, results = report["parameters"], report["results"]
    cpu = results["cpu"]
    flags = ", ".join(flag for flag, present in cpu["flags"].items() if present) or "none of " + ", ".join(CPU_FLAGS)
    git = results["git"]
    commit = f"commit {git['commit'][:7]}{' (uncommitted changes)' if git['dirty'] else ''}" if git else "no commit"
    batch_sizes, levels = parameters["batch_sizes"], [str(c) for c in parameters["concurrency"]]
    llama = results["llama_server"]
    # A mixture of experts' fused experts are a part of their own (``experts_ms``), beside the linears.
    experts = any(
        variant["median"]["step"][str(b)].get("experts_ms") for variant in results["variants"] for b in batch_sizes
    )
    parts = "linears / experts / attention / other" if experts else "linears / attention / other"
    header = [
        "variant", "kernels", *(f"step b={b} ms ({parts}; host by modules)" for b in batch_sizes),
        *(cell for c in levels for cell in (f"c={c} tok/s", f"c={c} ITL p50 ms")),
    ]  # fmt: skip
    if llama:
        header += [f"c={levels[0]} ITL vs llama-server", f"c={levels[-1]} tok/s vs llama-server"]
    rows = []
    for variant in results["variants"]:
        median = variant["median"]
        kernels = ", ".join(f"{_SHORT_NAMES.get(name, name)} {isa}" for name, isa in variant["kernels"].items())
        cells = [f"`{variant['isa']}`", kernels, *(_step_cell(median["step"][str(b)], experts) for b in batch_sizes)]
        cells += _decode_cells(median["decode"], levels)
        if llama:
            speedup = variant["speedup_vs_llama_server"]
            cells += [_times(speedup[levels[0]]["itl_p50"]), _times(speedup[levels[-1]]["output_throughput"])]
        rows.append(cells)
    if llama:
        rows.append(["llama-server", "-", *("-" for _ in batch_sizes), *_decode_cells(llama["median"]["decode"],
                                                                                      levels), "-", "-"])  # fmt: skip
    generation = f", family {cpu['family']} model {cpu['model']}" if cpu.get("family") and cpu.get("model") else ""
    threads = results["torch_threads"]
    lines = [
        f"### CPU: {cpu['model_name'] or 'unknown'}{generation} ({flags})",
        "",
        f"`tokenmill bench isa`, {report['date'][:10]}, {commit}, tokenmill {report['tokenmill_version']}; model "
        f"{parameters['model']}, {threads} thread{'s' if threads != 1 else ''}; median of {parameters['repeats']} "
        f"round{'s' if parameters['repeats'] != 1 else ''}, "
        f"levels alternating; `bench step` at {parameters['context_len']} cached tokens, decode "
        f"{parameters['input_len']} prompt + {parameters['output_len']} generated tokens per request"
        + (f"; llama-server on the same GGUF with `{' '.join(llama['flags'])}`." if llama else "."),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]
    return "\n".join(lines)


def _step_cell(figures: dict[str, Any], experts: bool = False) -> str:
    names = (
        ("linear_ms", "experts_ms", "attention_ms", "other_ms")
        if experts
        else ("linear_ms", "attention_ms", "other_ms")
    )
    parts = " / ".join(format_value(figures.get(name, 0.0)) for name in names)
    host = figures.get("other_in_step_ms")  # None on a GPU, absent from reports of older trees
    return f"{format_value(figures['step_ms'])} ({parts}{'' if host is None else f'; host {format_value(host)}'})"


def _decode_cells(decode: dict[str, dict[str, Any]], levels: Sequence[str]) -> list[str]:
    return [
        format_value(value)
        for level in levels
        for value in (decode[level]["output_throughput"], decode[level]["itl_p50_ms"])
    ]


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"
