"""``tokenmill bench``: the benchmark commands. Each prints its report as a table
on stdout and can write it as JSON.

The engine (and torch) is imported only by the offline commands, so ``bench serve``
runs wherever the client does.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import click

from tokenmill.bench.metrics import format_table, write_json
from tokenmill.config import EngineConfig
from tokenmill.config.options import config_options
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)


class _BenchGroup(click.Group):
    """Prints a ``TokenmillError`` as one line, as ``tokenmill`` does, also when the group runs alone."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TokenmillError as exc:
            raise click.ClickException(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


_output_json = click.option(
    "--output-json",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the report, with every parameter, to this JSON file.",
)
_seed = click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompts and lengths.")
_input_len = click.option(
    "--input-len", type=click.IntRange(min=1), default=256, show_default=True, help="Prompt tokens per request."
)
_output_len = click.option(
    "--output-len", type=click.IntRange(min=1), default=128, show_default=True, help="Generated tokens per request."
)
_mixed = click.option(
    "--mixed",
    is_flag=True,
    help="Seeded log-normal prompt and output lengths with means --input-len/--output-len (clipped to 1/4..4x).",
)


def _report(report: dict[str, Any], output_json: Path | None) -> None:
    click.echo(format_table(report))
    if output_json is not None:
        write_json(report, output_json)
        click.echo(f"wrote {output_json}", err=True)


@click.group(cls=_BenchGroup)
def bench() -> None:
    """Benchmark a running server (serve) or the offline engine (latency, throughput)."""


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
@click.option(
    "--concurrency", type=click.IntRange(min=1), default=1, show_default=True, help="Most requests in flight at once."
)
@click.option("--num-requests", type=click.IntRange(min=1), default=100, show_default=True, help="Requests to send.")
@_input_len
@_output_len
@click.option(
    "--request-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=math.inf,
    show_default=True,
    help="Mean requests per second, with Poisson (exponential-gap) arrivals; inf sends all at once.",
)
@_mixed
@_seed
@click.option("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY'; never written to the report.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds per request.",
)
@_output_json
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
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
    from tokenmill.bench.serve import ServeOptions, run_serve

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
@config_options
@_input_len
@_output_len
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Prompts per iteration.")
@click.option("--num-iters", type=click.IntRange(min=1), default=10, show_default=True, help="Timed iterations.")
@click.option(
    "--num-iters-warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed iterations first."
)
@_seed
@_output_json
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
    from tokenmill.bench.offline import run_latency
    from tokenmill.llm import LLM

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
@_input_len
@_output_len
@_mixed
@_seed
@_output_json
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
    from tokenmill.bench.offline import run_throughput
    from tokenmill.llm import LLM

    llm = LLM.from_config(config)
    report = run_throughput(
        llm, num_prompts=num_prompts, input_len=input_len, output_len=output_len, mixed=mixed, seed=seed
    )
    _report(report, output_json)
