"""``tokenmill eval``: measure a model as tokenmill runs it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from tokenmill.config import EngineConfig
from tokenmill.config.options import config_options


@click.group("eval")
def eval_group() -> None:
    """Evaluate a model (perplexity)."""


@eval_group.command()
@click.argument("model_argument", metavar="[MODEL]", required=False)
@click.option(
    "--text",
    "text_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="UTF-8 text file to score. Default: the bundled CC0 text (about 2,000 tokens).",
)
@click.option("--context-length", type=click.IntRange(min=2), default=512, show_default=True, help="Tokens per window.")
@click.option(
    "--stride", type=click.IntRange(min=1), default=None, help="Tokens between window starts. [default: half a window]"
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@config_options
def perplexity(
    config: EngineConfig, text_path: Path | None, context_length: int, stride: int | None, as_json: bool
) -> None:
    """Perplexity of MODEL (or the config's model) on a text, scored in sliding windows through tokenmill's
    own model runner, with the model's size on disk."""
    from tokenmill_plugins.commands.eval.perplexity import format_perplexity, run_perplexity

    text = text_path.read_text(encoding="utf-8") if text_path is not None else None
    result = run_perplexity(config, text, context_length=context_length, stride=stride)
    if as_json:
        report = {**asdict(result), "tokens_per_second": result.tokens_per_second}
        report["text"] = str(text_path) if text_path is not None else "bundled"
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_perplexity(result))
