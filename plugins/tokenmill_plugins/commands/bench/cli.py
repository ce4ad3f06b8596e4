"""``tokenmill bench``: the benchmark commands. Each prints its report as a table
on stdout and can write it as JSON.

``serve`` loads a running server; ``latency`` and ``throughput`` run the offline
engine; ``decode``, ``sweep``, ``prefix`` and ``prefill`` (the comparison suite,
``bench.suite``) start their own ``tokenmill serve`` and measure transformers on
the same model after it. The engine (and torch) is imported only by the commands
that run a model, so ``bench serve`` runs wherever the client does.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from tokenmill.config import EngineConfig
from tokenmill.config.options import config_options
from tokenmill.errors import TokenmillError
from tokenmill_plugins.commands.bench import options as opt
from tokenmill_plugins.commands.bench.lora import PARTS as LORA_PARTS
from tokenmill_plugins.commands.bench.metrics import format_table, write_json
from tokenmill_plugins.commands.bench.structured import PARTS
from tokenmill_plugins.commands.bench.suite import SuiteOptions, format_comparison

logger = logging.getLogger(__name__)


class _BenchGroup(click.Group):
    """Prints a ``TokenmillError`` as one line, as ``tokenmill`` does, also when the group runs alone."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TokenmillError as exc:
            raise click.ClickException(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def _report(
    report: dict[str, Any], output_json: Path | None, format_report: Callable[[dict[str, Any]], str] = format_table
) -> None:
    click.echo(format_report(report))
    if output_json is not None:
        write_json(report, output_json)
        click.echo(f"wrote {output_json}", err=True)


@click.group(cls=_BenchGroup)
def bench() -> None:
    """Benchmark a running server (serve), the offline engine (latency, throughput, step), or a server
    started for the run against Hugging Face transformers on the same model (decode, sweep, prefix, prefill);
    compare the CPU kernels' ISA variants and llama-server (isa)."""


@bench.command()
@click.option("--url", required=True, help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000.")
@click.option("--model", default=None, help="Model name to send; unset asks GET /v1/models and takes the first.")
@click.option(
    "--endpoint",
    type=click.Choice(["completions", "chat"]),
    default="completions",
    show_default=True,
    help="completions: token-id prompts of exact length; chat: random-word prompts of about that many tokens.",
)
@opt.concurrency(1, "Most requests in flight at once.")
@opt.num_requests(100, "Requests to send.")
@opt.input_len()
@opt.output_len()
@opt.request_rate
@opt.mixed
@opt.seed
@click.option("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'; never written to the report.")
@opt.request_timeout()
@opt.output_json
@opt.no_progress()
def serve(
    url: str,
    model: str | None,
    endpoint: str,
    concurrency: int,
    num_requests: int,
    input_len: int,
    output_len: int,
    request_rate: float,
    mixed: bool,
    seed: int,
    api_key: str | None,
    timeout: float,
    output_json: Path | None,
    no_progress: bool,
) -> None:
    """Load-test an OpenAI-compatible server with streaming requests; report TTFT, ITL, E2E and throughput."""
    from tokenmill_plugins.commands.bench.serve import ServeOptions, run_serve

    options = ServeOptions(
        url=url,
        model=model,
        endpoint="chat" if endpoint == "chat" else "completions",
        concurrency=concurrency,
        num_requests=num_requests,
        input_len=input_len,
        output_len=output_len,
        request_rate=request_rate,
        mixed=mixed,
        seed=seed,
        api_key=api_key,
        timeout_s=timeout,
        show_progress=not no_progress,
    )
    _report(run_serve(options), output_json)


@bench.command()
@click.option("--url", required=True, help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000.")
@click.option("--model", default=None, help="Model name to send; unset asks GET /v1/models and takes the first.")
@click.option(
    "--parts",
    default=",".join(PARTS),
    show_default=True,
    help="Comma-separated parts to run: validity (schemas, jsonschema-checked), tools (tool_choice required), "
    "overhead (constrained against unconstrained, alternated), ttft (a new 50-property schema against a warm one).",
)
@opt.num_requests(500, "validity: requests, cycling through the schemas.")
@click.option("--num-tool-requests", type=click.IntRange(min=1), default=100, show_default=True,
              help="tools: requests with tool_choice required.")  # fmt: skip
@opt.concurrency(32, "validity and tools: requests in flight at once.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=512, show_default=True,
              help="validity and tools: the most tokens a reply may take.")  # fmt: skip
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="validity and tools: sampling temperature.")  # fmt: skip
@opt.int_list("--overhead-concurrency", "1,32", "overhead: comma-separated streams at once.")
@opt.input_len(128, "overhead: prompt tokens per request (about, chat).")
@opt.output_len(128, "overhead: generated tokens per request.")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="overhead: alternations of the constrained and unconstrained runs.")  # fmt: skip
@click.option("--ttft-repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="ttft: new schemas, each sent twice (new, then warm).")  # fmt: skip
@opt.seed
@click.option("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'; never written to the report.")
@opt.request_timeout()
@opt.output_json
def structured(
    url: str,
    model: str | None,
    parts: str,
    num_requests: int,
    num_tool_requests: int,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    overhead_concurrency: list[int],
    input_len: int,
    output_len: int,
    rounds: int,
    ttft_repeats: int,
    seed: int,
    api_key: str | None,
    timeout: float,
    output_json: Path | None,
) -> None:
    """Structured outputs against a running server: schema validity, tool calls, mask overhead, new-schema TTFT."""
    from tokenmill_plugins.commands.bench.structured import StructuredOptions, format_structured, run_structured

    options = StructuredOptions(
        url=url,
        model=model,
        parts=tuple(p.strip() for p in parts.split(",") if p.strip()),
        num_requests=num_requests,
        num_tool_requests=num_tool_requests,
        concurrency=concurrency,
        max_tokens=max_tokens,
        temperature=temperature,
        overhead_concurrency=tuple(overhead_concurrency),
        input_len=input_len,
        output_len=output_len,
        rounds=rounds,
        ttft_repeats=ttft_repeats,
        seed=seed,
        api_key=api_key,
        timeout_s=timeout,
    )
    _report(run_structured(options), output_json, format_structured)


@bench.command("lora-adapters")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", default=None, help="Model whose architecture the adapters fit; unset: the default model.")
@click.option("--count", type=click.IntRange(min=1), default=8, show_default=True, help="Adapters to write.")
@click.option("--rank", type=click.IntRange(min=1), default=16, show_default=True, help="Their rank (alpha: 2 x rank).")
@opt.seed
def lora_adapters(directory: Path, model: str | None, count: int, rank: int, seed: int) -> None:
    """Write PEFT LoRA adapters (random, every linear) for a model, for `tokenmill bench lora`; needs peft."""
    from tokenmill.model_files import resolve_model
    from tokenmill_plugins.commands.bench.lora import make_adapters

    for path in make_adapters(resolve_model(model), directory, count, rank, seed):
        click.echo(f"{path.name}={path.resolve()}")


@bench.command()
@click.option(
    "--url", required=True, help="Base URL of a server started with --enable-lora, e.g. http://127.0.0.1:8000."
)
@click.option(
    "--adapters", default="", help="Comma-separated adapter names to spread requests over; unset: all served."
)
@click.option(
    "--parts",
    default=",".join(LORA_PARTS),
    show_default=True,
    help="overhead (adapters against the base model, alternated), stall (an adapter loaded at run time).",
)
@opt.int_list("--concurrency", "1,32", "overhead: comma-separated streams at once.")
@opt.input_len(128, "Prompt tokens per request.")
@opt.output_len(128, "Generated tokens per request.")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="overhead: alternations of the adapter and base runs.",
)
@click.option(
    "--load-adapter",
    default=None,
    help="stall: path (on the server's disk) of an adapter to load at run time; the server needs "
    "--allow-runtime-lora-updating.",
)
@click.option(
    "--stall-streams",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="stall: base-model streams running while the adapter loads.",
)
@opt.seed
@click.option("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'; never written to the report.")
@opt.request_timeout()
@opt.output_json
def lora(
    url: str,
    adapters: str,
    parts: str,
    concurrency: list[int],
    input_len: int,
    output_len: int,
    rounds: int,
    load_adapter: str | None,
    stall_streams: int,
    seed: int,
    api_key: str | None,
    timeout: float,
    output_json: Path | None,
) -> None:
    """Multi-LoRA serving against a running server: throughput and ITL over adapters, stalls while one loads."""
    from tokenmill_plugins.commands.bench.lora import LoRAOptions, format_lora, run_lora

    options = LoRAOptions(
        url=url,
        adapters=tuple(a.strip() for a in adapters.split(",") if a.strip()),
        parts=tuple(p.strip() for p in parts.split(",") if p.strip()),
        concurrency=tuple(concurrency),
        input_len=input_len,
        output_len=output_len,
        rounds=rounds,
        load_adapter=load_adapter,
        stall_streams=stall_streams,
        seed=seed,
        api_key=api_key,
        timeout_s=timeout,
    )
    _report(run_lora(options), output_json, format_lora)


@bench.command()
@config_options
@opt.input_len()
@opt.output_len()
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Prompts per iteration.")
@click.option("--num-iters", type=click.IntRange(min=1), default=10, show_default=True, help="Timed iterations.")
@click.option(
    "--num-iters-warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed iterations first."
)
@opt.seed
@opt.output_json
def latency(
    config: EngineConfig,
    input_len: int,
    output_len: int,
    batch_size: int,
    num_iters: int,
    num_iters_warmup: int,
    seed: int,
    output_json: Path | None,
) -> None:
    """Time generating one batch end to end with the offline engine, over several iterations."""
    from tokenmill.llm import LLM
    from tokenmill_plugins.commands.bench.offline import run_latency

    llm = LLM.from_config(config)
    report = run_latency(
        llm,
        input_len=input_len,
        output_len=output_len,
        batch_size=batch_size,
        num_iters=num_iters,
        num_iters_warmup=num_iters_warmup,
        seed=seed,
    )
    _report(report, output_json)


@bench.command()
@config_options
@click.option(
    "--num-prompts", type=click.IntRange(min=1), default=100, show_default=True, help="Prompts, all submitted at once."
)
@opt.input_len()
@opt.output_len()
@opt.mixed
@opt.seed
@opt.output_json
def throughput(
    config: EngineConfig,
    num_prompts: int,
    input_len: int,
    output_len: int,
    mixed: bool,
    seed: int,
    output_json: Path | None,
) -> None:
    """Measure how many requests and tokens per second the offline engine completes."""
    from tokenmill.llm import LLM
    from tokenmill_plugins.commands.bench.offline import run_throughput

    llm = LLM.from_config(config)
    report = run_throughput(
        llm, num_prompts=num_prompts, input_len=input_len, output_len=output_len, mixed=mixed, seed=seed
    )
    _report(report, output_json)


@bench.command()
@config_options
@opt.int_list("--batch-size", "1,32", "Comma-separated batch sizes: decoding requests per step.")
@click.option(
    "--context-len", type=click.IntRange(min=1), default=256, show_default=True, help="Tokens cached per request."
)
@click.option("--num-steps", type=click.IntRange(min=1), default=20, show_default=True, help="Timed repeats (median).")
@opt.seed
@opt.output_json
def step(
    config: EngineConfig,
    batch_size: list[int],
    context_len: int,
    num_steps: int,
    seed: int,
    output_json: Path | None,
) -> None:
    """Where one decode step's time goes: the whole step, its linears, its attention, the rest."""
    from tokenmill.engine import EngineCore
    from tokenmill_plugins.commands.bench.step import run_step

    engine = EngineCore(config)
    reports = [
        run_step(engine, batch_size=size, context_len=context_len, num_steps=num_steps, seed=seed)
        for size in batch_size
    ]
    for report in reports:
        click.echo(format_table(report))
    if output_json is not None:
        write_json({"benchmark": "step", "runs": reports}, output_json)
        click.echo(f"wrote {output_json}", err=True)


@bench.command()
@config_options
@click.option(
    "--compare",
    "compare",
    multiple=True,
    help="Another model (checkpoint path or name) to time after --model, with the same settings. Repeatable.",
)
@opt.int_list("--rows", "1,32", "Comma-separated input rows M.")
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True, help="Timed passes (best).")
@opt.seed
@opt.output_json
def linears(
    config: EngineConfig, compare: tuple[str, ...], rows: list[int], repeats: int, seed: int, output_json: Path | None
) -> None:
    """Every linear layer of --model and of each --compare model timed alone: how quantized formats of the
    same shapes compare, without the rest of the engine."""
    import msgspec

    from tokenmill_plugins.commands.bench.linears import format_linears, run_linears

    configs = [config] + [
        msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, model=model)) for model in compare
    ]
    _report(run_linears(configs, rows, repeats, seed), output_json, format_linears)


def _isa_levels(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    from tokenmill_kernels.cpu_isa import ISA_LEVELS

    if value is None:
        return None
    levels = [part.strip() for part in value.split(",") if part.strip()]
    unknown = [level for level in levels if level not in ISA_LEVELS]
    if not levels or unknown:
        raise click.BadParameter(f"{value!r}: give one or more of {', '.join(ISA_LEVELS)}, comma-separated")
    return levels


@bench.command()
@config_options
@click.option(
    "--isa",
    "levels",
    default=None,
    callback=_isa_levels,
    help="Comma-separated ISA levels to run (avx2, avx_vnni, avx512, avx512_vnni16, amx), each one this CPU's kernels "
    "support; at a level each kernel runs its best variant at or below it.  [default: every supported level]",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Rounds over the levels (and llama-server), alternating v1, v2, ..., v1, v2, ...; figures are medians.",
)
@opt.int_list("--batch-size", "1,32", "Comma-separated batch sizes of the bench step runs.")
@click.option(
    "--context-len", type=click.IntRange(min=1), default=256, show_default=True, help="bench step: cached tokens."
)
@click.option("--num-steps", type=click.IntRange(min=1), default=20, show_default=True, help="bench step: timed steps.")
@opt.int_list("--concurrency", "1,32", "Comma-separated streams at once of the end-to-end decode runs.")
@opt.input_len(128, "Decode runs: prompt tokens per request.")
@opt.output_len(128, "Decode runs: generated tokens per request.")
@opt.num_requests(None, "Decode runs: requests per concurrency level.  [default: max(2 x concurrency, 8)]")
@click.option(
    "--llama-server",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A llama-server binary to run the decode workloads against too, on the same GGUF, after the levels in "
    "each round (-np = the largest --concurrency, -cb, threads = tokenmill's).",
)
@opt.seed
@opt.server_timeout("Seconds each server (tokenmill or llama-server) may take to load the model and answer /health.")
@opt.request_timeout()
@opt.no_progress()
@click.option(
    "--output-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-isa.json"),
    show_default=True,
    help="Where to write the report, with every parameter, the CPU and the commit.",
)
def isa(
    config: EngineConfig,
    levels: list[str] | None,
    repeats: int,
    batch_size: list[int],
    context_len: int,
    num_steps: int,
    concurrency: list[int],
    input_len: int,
    output_len: int,
    num_requests: int | None,
    llama_server: Path | None,
    seed: int,
    server_timeout: float,
    timeout: float,
    no_progress: bool,
    output_json: Path,
) -> None:
    """The same workloads at every ISA level the CPU kernels support (bench step at each --batch-size, decode
    through a real server at each --concurrency) and on llama-server when given; prints a markdown table for
    docs/benchmarks.md."""
    from tokenmill_plugins.commands.bench.isa import (
        IsaBenchError,
        IsaBenchOptions,
        check_levels,
        format_isa,
        kernel_launchers,
        run_isa,
        supported_levels,
    )

    try:
        checked = check_levels(levels, supported_levels(kernel_launchers()))
    except IsaBenchError as exc:
        raise click.BadParameter(str(exc), param_hint="'--isa'") from None
    options = IsaBenchOptions(
        levels=checked, repeats=repeats, batch_sizes=tuple(batch_size), context_len=context_len,
        num_steps=num_steps, concurrency=tuple(concurrency), input_len=input_len, output_len=output_len,
        num_requests=num_requests, llama_server=llama_server, seed=seed, server_timeout_s=server_timeout,
        request_timeout_s=timeout, show_progress=not no_progress,
    )  # fmt: skip
    _report(run_isa(config, options), output_json, format_isa)


# ------------------------------------------------ the comparison suite (bench.suite)


def _suite_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The flags every suite command shares, plus every engine flag of ``tokenmill serve``
    (``config_options``); the command gets ``options: SuiteOptions``."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["options"] = SuiteOptions(
            config=kwargs.pop("config"),
            seed=kwargs.pop("seed"),
            hf_baseline=not kwargs.pop("no_hf_baseline"),
            server_timeout_s=kwargs.pop("server_timeout"),
            request_timeout_s=kwargs.pop("timeout"),
            show_progress=not kwargs.pop("no_progress"),
        )
        return command(*args, **kwargs)

    options: list[opt.Decorator] = [
        opt.seed,
        click.option(
            "--no-hf-baseline",
            is_flag=True,
            help="Measure tokenmill alone; without it, transformers runs the same model after the server stops.",
        ),
        opt.server_timeout(),
        opt.request_timeout(),
        opt.no_progress("Hide the progress bars."),
        config_options,
    ]
    decorated: Callable[..., Any] = wrapper
    for option in reversed(options):
        decorated = option(decorated)
    return decorated


@bench.command()
@opt.input_len(128, "Prompt tokens.")
@opt.output_len(128, "Generated tokens.", minimum=2)
@opt.num_requests(5, "Requests, one at a time.")
@opt.peak_bandwidth
@opt.output_json
@_suite_options
def decode(
    options: SuiteOptions,
    input_len: int,
    output_len: int,
    num_requests: int,
    peak_bandwidth_gbs: float | None,
    output_json: Path | None,
) -> None:
    """Single-stream decode on a tokenmill server vs transformers generate at batch 1."""
    from tokenmill_plugins.commands.bench.suite import run_decode

    report = run_decode(
        options,
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests,
        peak_bandwidth_gbs=peak_bandwidth_gbs,
    )
    _report(report, output_json, format_comparison)


@bench.command()
@opt.int_list(
    "--concurrency", "1,4,16,32,64", "Comma-separated concurrency levels, measured in order against one server."
)
@opt.input_len(128, "Prompt tokens.")
@opt.output_len(128, "Generated tokens.")
@opt.num_requests(None, "Requests per level.  [default: max(2 x concurrency, 8)]")
@opt.mixed
@click.option(
    "--hf-max-batch",
    type=click.IntRange(min=1),
    default=None,
    help="Skip the transformers baseline at levels above this batch size (it is slow on CPU).",
)
@opt.peak_bandwidth
@opt.output_json
@_suite_options
def sweep(
    options: SuiteOptions,
    concurrency: list[int],
    input_len: int,
    output_len: int,
    num_requests: int | None,
    mixed: bool,
    hf_max_batch: int | None,
    peak_bandwidth_gbs: float | None,
    output_json: Path | None,
) -> None:
    """Output throughput at each concurrency level vs transformers batched generate at that batch size."""
    from tokenmill_plugins.commands.bench.suite import run_sweep

    report = run_sweep(
        options,
        concurrency=concurrency,
        input_len=input_len,
        output_len=output_len,
        num_requests=num_requests,
        mixed=mixed,
        hf_max_batch=hf_max_batch,
        peak_bandwidth_gbs=peak_bandwidth_gbs,
    )
    _report(report, output_json, format_comparison)


@bench.command()
@click.option(
    "--prefix-len", type=click.IntRange(min=1), default=1000, show_default=True, help="Tokens of the shared prefix."
)
@opt.length_range("--question-len", (16, 32), "Shortest and longest distinct question after the prefix, in tokens.")
@opt.output_len(16)
@opt.num_requests(16, "Measured requests per server, one at a time, after one warm-up.")
@opt.output_json
@_suite_options
def prefix(
    options: SuiteOptions,
    prefix_len: int,
    question_len: tuple[int, int],
    output_len: int,
    num_requests: int,
    output_json: Path | None,
) -> None:
    """TTFT of prompts sharing a long prefix, with prefix caching on and off, vs transformers prefill."""
    from tokenmill_plugins.commands.bench.suite import run_prefix

    report = run_prefix(
        options, prefix_len=prefix_len, question_lens=question_len, output_len=output_len, num_requests=num_requests
    )
    _report(report, output_json, format_comparison)


@bench.command()
@opt.input_len(2000, "Prompt tokens.")
@opt.output_len(1)
@opt.num_requests(3, "Requests, one at a time.")
@opt.output_json
@_suite_options
def prefill(
    options: SuiteOptions, input_len: int, output_len: int, num_requests: int, output_json: Path | None
) -> None:
    """Time to first token of a long prompt vs one transformers forward over it."""
    from tokenmill_plugins.commands.bench.suite import run_prefill

    report = run_prefill(options, input_len=input_len, output_len=output_len, num_requests=num_requests)
    _report(report, output_json, format_comparison)


@bench.command()
@config_options
@click.option(
    "--workload",
    type=click.Choice(["copy", "chat"]),
    default="copy",
    show_default=True,
    help="'copy': rewrite, proofread, summarise or edit text and code given in the prompt; 'chat': open questions.",
)
@opt.int_list(
    "--concurrency", "1,32", "Comma-separated concurrency levels (requests in flight at once).", "concurrency_levels"
)
@opt.output_len(128, "Most tokens per answer.")
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Conversations run one by one at c=1.",
)
@click.option(
    "--rounds", type=click.IntRange(min=1), default=2, show_default=True, help="Alternated rounds (best kept)."
)
@opt.output_json
def speculative(
    config: EngineConfig,
    workload: str,
    concurrency_levels: list[int],
    output_len: int,
    num_prompts: int,
    rounds: int,
    output_json: Path | None,
) -> None:
    """Output tokens/s with and without --speculative-config on the same workload, greedy, in one process;
    with the speculator's acceptance rate, mean accepted length and acceptance per draft position."""
    from tokenmill_plugins.commands.bench.speculative import format_speculative, run_speculative

    report = run_speculative(
        config,
        workload=workload,
        concurrency_levels=concurrency_levels,
        output_len=output_len,
        num_prompts=num_prompts,
        rounds=rounds,
    )
    _report(report, output_json, format_speculative)


@bench.command("kv-tiers")
@config_options
@click.option(
    "--workload",
    type=click.Choice(["multi-turn", "restart"]),
    default="multi-turn",
    show_default=True,
    help="'multi-turn': conversations over shared documents whose prefixes exceed the device KV cache, with and "
    "without the tiers; 'restart': a long prompt again after a restart over a disk tier, against a cold one.",
)
@click.option("--documents", type=click.IntRange(min=1), default=4, show_default=True, help="Shared documents.")
@click.option("--document-len", type=click.IntRange(min=1), default=1024, show_default=True, help="Tokens each.")
@click.option("--conversations-per-document", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--turns", type=click.IntRange(min=1), default=3, show_default=True, help="Turns per conversation.")
@click.option("--turn-len", type=click.IntRange(min=1), default=32, show_default=True, help="Tokens per question.")
@opt.input_len(2000, "restart: prompt.", minimum=2)
@opt.output_len(16, "Tokens per answer.")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True, help="multi-turn: repeats.")
@opt.seed
@opt.output_json
def kv_tiers(
    config: EngineConfig,
    workload: str,
    documents: int,
    document_len: int,
    conversations_per_document: int,
    turns: int,
    turn_len: int,
    input_len: int,
    output_len: int,
    rounds: int,
    seed: int,
    output_json: Path | None,
) -> None:
    """Time to first token with and without --kv-tier tiers (offline engines, one process, greedy)."""
    from tokenmill_plugins.commands.bench.kv_tiers import format_kv_tiers, run_multi_turn, run_restart

    if workload == "restart":
        report = run_restart(config, input_len=input_len, output_len=output_len, seed=seed)
    else:
        report = run_multi_turn(
            config, documents=documents, document_len=document_len,
            conversations_per_document=conversations_per_document, turns=turns, turn_len=turn_len,
            output_len=output_len, rounds=rounds, seed=seed,
        )  # fmt: skip
    _report(report, output_json, format_kv_tiers)


@bench.command("engine-kills")
@config_options
@click.option("--kills", type=click.IntRange(min=1), default=20, show_default=True, help="SIGKILLs of engine 0.")
@opt.concurrency(8, "Streams kept in flight.")
@opt.input_len(64, "Prompt tokens.")
@opt.output_len(256)
@opt.seed
@opt.server_timeout("Seconds the server may take to start, and to serve again after a kill.")
@opt.output_json
def engine_kills(
    config: EngineConfig,
    kills: int,
    concurrency: int,
    input_len: int,
    output_len: int,
    seed: int,
    server_timeout: float,
    output_json: Path | None,
) -> None:
    """Start a server, SIGKILL its engine again and again under streaming load: how fast in-flight requests
    fail and the server serves again, and whether any process, port or memory is left behind."""
    from tokenmill_plugins.commands.bench.engine_kills import format_engine_kills, run_engine_kills

    report = run_engine_kills(
        config, kills=kills, concurrency=concurrency, input_len=input_len, output_len=output_len, seed=seed,
        server_timeout_s=server_timeout,
    )  # fmt: skip
    _report(report, output_json, format_engine_kills)


class _Duration(click.ParamType):
    """Seconds, as a number or with a unit: ``90``, ``90s``, ``30m``, ``2h``."""

    name = "duration"
    _UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip().lower()
        scale = self._UNITS.get(text[-1:], None) if text else None
        try:
            seconds = float(text[:-1] if scale else text) * (scale or 1.0)
        except ValueError:
            self.fail(f"{value!r} is not a duration such as 90, 90s, 30m or 2h", param, ctx)
        if not seconds > 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        return seconds


@bench.command()
@config_options
@click.option(
    "--routers",
    "router_names",
    default="round_robin,least_loaded,prefix_aware",
    show_default=True,
    help="Comma-separated routers, each measured behind its own fresh server; ratios are to round_robin.",
)
@click.option(
    "--workload",
    type=click.Choice(["shared-prefix", "mixed", "both"]),
    default="both",
    show_default=True,
    help="'shared-prefix': tenants with long system prompts, short user suffixes, interleaved; 'mixed': log-normal "
    "prompt and output lengths (means --input-len, --output-len).",
)
@opt.num_requests(200, "Per workload and router.")
@opt.concurrency(16)
@opt.request_rate
@click.option("--tenants", type=click.IntRange(min=1), default=8, show_default=True, help="shared-prefix: tenants.")
@click.option(
    "--system-prompt-len", type=click.IntRange(min=1), default=1024, show_default=True,
    help="shared-prefix: tokens of each tenant's system prompt.",
)  # fmt: skip
@opt.length_range("--suffix-len", (16, 64), "shared-prefix: shortest and longest user suffix, in tokens.")
@click.option(
    "--kv-fraction", type=click.FloatRange(min=0, min_open=True), default=0.6, show_default=True,
    help="shared-prefix, without --num-kv-blocks: each engine's KV cache holds this share of all the tenants' system "
    "prompts (plus room for the running requests).",
)  # fmt: skip
@opt.input_len(512, "mixed: mean prompt.")
@opt.output_len(64, "Generated tokens.")
@opt.seed
@opt.server_timeout("Seconds each server may take to load the model and answer /health.")
@opt.request_timeout()
@opt.no_progress("Hide the progress bars.")
@opt.output_json
def routers(
    config: EngineConfig,
    router_names: str,
    workload: str,
    num_requests: int,
    concurrency: int,
    request_rate: float,
    tenants: int,
    system_prompt_len: int,
    suffix_len: tuple[int, int],
    kv_fraction: float,
    input_len: int,
    output_len: int,
    seed: int,
    server_timeout: float,
    timeout: float,
    no_progress: bool,
    output_json: Path | None,
) -> None:
    """Routers compared with --data-parallel-size 2 (or more): prefix cache hit rate (/metrics), TTFT p50/p99 and
    throughput of each router on the same requests, each behind a fresh server, with ratios to round_robin."""
    from tokenmill.plugin_manager import Slot, load_plugins
    from tokenmill_plugins.commands.bench.routers import WORKLOADS, RouterBenchOptions, format_routers, run_routers

    names = tuple(name.strip() for name in router_names.split(",") if name.strip())
    registry = load_plugins().registry
    for name in names:
        registry.get(Slot.ROUTER, name)  # an unknown router fails now, with the installed ones
    options = RouterBenchOptions(
        routers=names, workloads=WORKLOADS if workload == "both" else (workload,), num_requests=num_requests,
        concurrency=concurrency, request_rate=request_rate, output_len=output_len, num_tenants=tenants,
        system_prompt_len=system_prompt_len, suffix_lens=suffix_len, kv_fraction=kv_fraction, input_len=input_len,
        seed=seed, server_timeout_s=server_timeout, request_timeout_s=timeout, show_progress=not no_progress,
    )  # fmt: skip
    _report(run_routers(config, options), output_json, format_routers)


@bench.command()
@click.option(
    "--base-url",
    default=None,
    help="Soak a running server (http://HOST:PORT) instead of starting one with the engine flags below.",
)
@click.option(
    "--server-pid",
    type=int,
    default=None,
    help="With --base-url: the server's root process, for the RSS samples.  [default: the local process listening "
    "on the URL's port]",
)
@click.option("--duration", type=_Duration(), default="5m", show_default=True, help="How long to send load.")
@click.option(
    "--warmup",
    type=_Duration(),
    default="60s",
    show_default=True,
    help="The first part of the load, after which RSS growth is measured.",
)
@opt.concurrency(16)
@opt.length_range(
    "--input-len", (16, 512), "Shortest and longest prompt, in tokens (about, for text prompts), drawn uniformly."
)
@opt.length_range("--output-len", (8, 256), "Smallest and largest max_tokens, drawn uniformly.")
@click.option(
    "--abort-fraction",
    type=click.FloatRange(0, 1),
    default=0.1,
    show_default=True,
    help="Share of the requests the client drops at a random point.",
)
@click.option(
    "--sample-interval", type=_Duration(), default="5s", show_default=True, help="Between RSS and /metrics samples."
)
@click.option(
    "--max-rss-growth",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="The check: most RSS growth (%) of any process, and of their total, from the warm-up's end to the load's.",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("soak"),
    show_default=True,
    help="Where report.json, samples.csv, rss.svg (and the server's log) go.",
)
@opt.seed
@opt.request_timeout(300.0)
@opt.server_timeout()
@opt.no_progress("Hide the progress line.")
@config_options
def soak(
    config: EngineConfig,
    base_url: str | None,
    server_pid: int | None,
    duration: float,
    warmup: float,
    concurrency: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    abort_fraction: float,
    sample_interval: float,
    max_rss_growth: float,
    output_dir: Path,
    seed: int,
    timeout: float,
    server_timeout: float,
    no_progress: bool,
) -> None:
    """Mixed traffic (chat and completions, streaming or not, n>1, stop strings, logprobs, client aborts) for
    --duration: errors, each server process's RSS over time, and KV blocks in use once idle. Exits 1 when a
    check fails (an error, RSS growth over --max-rss-growth, KV blocks still in use)."""
    from contextlib import ExitStack

    from tokenmill_plugins.commands.bench.local_server import local_server
    from tokenmill_plugins.commands.bench.process_rss import find_listening_pid
    from tokenmill_plugins.commands.bench.soak import SoakOptions, format_soak, run_soak

    output_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if base_url is None:
            server = stack.enter_context(local_server(config, output_dir, timeout_s=server_timeout))
            base_url, server_pid = server.url, server.process.pid
        elif server_pid is None:
            server_pid = find_listening_pid(base_url)
            if server_pid is None:
                logger.warning("no local process listens on %s: no RSS samples (pass --server-pid)", base_url)
        options = SoakOptions(
            base_url=base_url, output_dir=output_dir, duration_s=duration, concurrency=concurrency,
            warmup_s=warmup, sample_interval_s=sample_interval, input_len=input_len, output_len=output_len,
            abort_fraction=abort_fraction, seed=seed, model=config.server.served_model_name,
            api_key=config.server.api_key, timeout_s=timeout, max_rss_growth_pct=max_rss_growth,
            server_pid=server_pid, show_progress=not no_progress,
        )  # fmt: skip
        report = run_soak(options)
    click.echo(format_soak(report))
    if not report["results"]["passed"]:
        raise SystemExit(1)


def _accuracy_variant(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[Any]:
    from tokenmill_plugins.commands.bench.accuracy import Variant

    try:
        return [Variant.parse(text) for text in value]
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@bench.command()
@config_options
@click.option(
    "--variant",
    "variants",
    multiple=True,
    default=("default",),
    show_default=True,
    callback=_accuracy_variant,
    help="Repeatable. 'default' (the engine as configured) or comma-separated changes to it: kv=DTYPE "
    "(float32, float16, bfloat16, fp8, int8), "
    "quantization=NAME, act=MODE, body_act=MODE, head_act=MODE, with MODE kernel, float, int8 or int16 "
    "(the linears' input as the kernel rounds it, or emulated; see tokenmill_plugins.commands.bench.accuracy).",
)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Greedy tokens per prompt at most."
)
@click.option(
    "--max-error",
    type=click.FloatRange(min=0),
    default=None,
    help="Exit 1 when a variant's chosen-token logprob error exceeds this many nats on any prompt.",
)
@opt.output_json
def accuracy(
    config: EngineConfig, variants: list[Any], max_tokens: int, max_error: float | None, output_json: Path | None
) -> None:
    """Greedy output on fixed chat prompts, and the perplexity of a fixed text, against transformers float32 on
    the same weights (a GGUF file dequantized exactly): per prompt the largest and mean chosen-token logprob
    error in nats and where greedy output parts from the reference."""
    from tokenmill_plugins.commands.bench.accuracy import format_accuracy, run_accuracy

    report = run_accuracy(config, variants, max_tokens=max_tokens)
    _report(report, output_json, format_accuracy)
    if max_error is not None and any(v["max_error"] > max_error for v in report["results"]["variants"]):
        raise SystemExit(1)
