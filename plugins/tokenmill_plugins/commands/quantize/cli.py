"""The ``tokenmill quantize`` command."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from tokenmill.config import EngineConfig
from tokenmill.config.options import config_options


@click.command()
@click.argument("model_argument", metavar="[MODEL]", required=False)
@click.option("--method", required=True, help="gptq (int4, W4A16), awq (int4 with zero points), fp8 or int8 (W8A8).")
@click.option(
    "--output", required=True, type=click.Path(file_okay=False, path_type=Path), help="New directory to write."
)
@click.option(
    "--calibration",
    "calibration_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="UTF-8 calibration text. Default: the bundled CC0 text (about 5,000 tokens).",
)
@click.option("--num-samples", type=int, default=64, show_default=True, help="Calibration windows, at most.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per calibration window.")
@click.option("--group-size", type=int, default=128, show_default=True, help="gptq/awq: input columns per scale.")
@click.option("--act-order/--no-act-order", default=True, show_default=True, help="gptq/int8: columns by activation.")
@click.option("--dampening", type=float, default=0.01, show_default=True, help="GPTQ Hessian dampening fraction.")
@click.option(
    "--output-dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="Of the tensors left in float and the scales; auto: the checkpoint's own (float32 for GGUF).",
)
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@config_options
def quantize(
    config: EngineConfig,
    method: str,
    output: Path,
    calibration_path: Path | None,
    num_samples: int,
    seq_len: int,
    group_size: int,
    act_order: bool,
    dampening: float,
    output_dtype: str,
    no_progress: bool,
) -> None:
    """Quantize MODEL (or the config's model) and write a compressed-tensors checkpoint that transformers,
    vLLM and tokenmill load."""
    from tokenmill_plugins.commands.quantize.pipeline import QuantizeOptions, quantize_model
    from tokenmill_plugins.commands.quantize.schemes import make_scheme

    scheme = make_scheme(method, group_size, act_order)
    options = QuantizeOptions(
        output=output,
        calibration_text=calibration_path.read_text(encoding="utf-8") if calibration_path is not None else None,
        num_samples=num_samples,
        seq_len=seq_len,
        dampening=dampening,
        dtype=output_dtype,
    )
    with ExitStack() as stack:
        bars: list[Any] = []

        def progress(done: int, total: int) -> None:
            if not bars:
                bar = click.progressbar(length=total, label=f"quantizing ({method})", hidden=no_progress)
                bars.append(stack.enter_context(bar))
            bars[0].update(done - bars[0].pos)

        result = quantize_model(config, scheme, options, progress)
    click.echo(
        f"{result.method}: {result.num_layers} layers, {result.num_samples} calibration samples of {result.seq_len} "
        f"tokens, {result.size_bytes / 2**20:.1f} MiB -> {result.output}"
    )
