"""The click options that several ``tokenmill bench`` commands share, each defined once.

An option every command spells the same way is a decorator (``seed``, ``output_json``); one whose default or
help differs from command to command is a function that takes those and returns the decorator
(``input_len(2000, "Prompt tokens.")``). Type, range and ``show_default`` are the same everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

_COUNT = click.IntRange(min=1)
_SECONDS = click.FloatRange(min=0, min_open=True)

output_json = click.option(
    "--output-json",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the report, with every parameter, to this JSON file.",
)
seed = click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompts and lengths.")
request_rate = click.option(
    "--request-rate",
    type=_SECONDS,
    default=math.inf,
    show_default=True,
    help="Mean requests per second, with Poisson (exponential-gap) arrivals; inf sends all at once (at most "
    "--concurrency in flight).",
)
mixed = click.option(
    "--mixed",
    is_flag=True,
    help="Seeded log-normal prompt and output lengths with means --input-len/--output-len (clipped to 1/4..4x).",
)
peak_bandwidth = click.option(
    "--peak-bandwidth-gbs",
    type=_SECONDS,
    default=None,
    help="Memory bandwidth (GB/s) for the decode-step roofline, such as a measured device-to-device copy's; "
    "known GPUs (H100, H200) default to their datasheet peak.",
)


def input_len(default: int = 256, help: str = "Prompt tokens per request.", minimum: int = 1) -> Decorator:
    """``--input-len``: prompt tokens of each request."""
    return click.option("--input-len", type=click.IntRange(min=minimum), default=default, show_default=True, help=help)


def output_len(default: int = 128, help: str = "Generated tokens per request.", minimum: int = 1) -> Decorator:
    """``--output-len``: tokens each request generates."""
    return click.option("--output-len", type=click.IntRange(min=minimum), default=default, show_default=True, help=help)


def num_requests(default: int | None, help: str) -> Decorator:
    """``--num-requests``: how many requests a run sends."""
    return click.option("--num-requests", type=_COUNT, default=default, show_default=True, help=help)


def concurrency(default: int, help: str = "Requests in flight at once.") -> Decorator:
    """``--concurrency``: one level of requests in flight (``int_list`` for several)."""
    return click.option("--concurrency", type=_COUNT, default=default, show_default=True, help=help)


def request_timeout(default: float = 600.0) -> Decorator:
    """``--timeout``: seconds one request may take."""
    return click.option("--timeout", type=_SECONDS, default=default, show_default=True, help="Seconds per request.")


def server_timeout(help: str = "Seconds the server may take to load the model and answer /health.") -> Decorator:
    """``--server-timeout``: seconds a server the command starts may take to serve."""
    return click.option("--server-timeout", type=_SECONDS, default=600.0, show_default=True, help=help)


def no_progress(help: str = "Hide the progress bar.") -> Decorator:
    """``--no-progress``."""
    return click.option("--no-progress", is_flag=True, help=help)


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        levels = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers, e.g. 1,4,16") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{value!r}: give one or more levels, each at least 1")
    return levels


def int_list(flag: str, default: str, help: str, name: str | None = None) -> Decorator:
    """A comma-separated list of positive integers (``--batch-size 1,32``), passed as ``list[int]``."""
    declarations = (flag, name) if name is not None else (flag,)
    return click.option(*declarations, default=default, show_default=True, callback=_int_list, help=help)


def _length_range(ctx: click.Context, param: click.Parameter, value: tuple[int, int]) -> tuple[int, int]:
    if value[0] > value[1]:
        raise click.BadParameter(f"MIN {value[0]} > MAX {value[1]}")
    return value


def length_range(flag: str, default: tuple[int, int], help: str) -> Decorator:
    """Two positive integers, the smallest and the largest (``--input-len 16 512``), passed as a tuple."""
    return click.option(
        flag, type=(_COUNT, _COUNT), default=default, show_default=True, callback=_length_range, help=help
    )
