"""``tokenmill train``: train weights that a plugin loads (Medusa heads for the ``medusa`` speculator).

Torch and the engine are imported by the subcommand that runs, not by ``tokenmill --help``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import click

from tokenmill.config import EngineConfig
from tokenmill.config.options import config_options

logger = logging.getLogger(__name__)


@click.group()
def train() -> None:
    """Train speculator weights for a model: `tokenmill train medusa`."""


@train.command("medusa")
@click.argument("model_argument", metavar="[MODEL]", required=False)
@click.option(
    "--output",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write the heads to (config.json and medusa_lm_head.safetensors).",
)
@click.option("--num-heads", type=click.IntRange(min=1), default=3, show_default=True, help="Medusa heads to train.")
@click.option("--num-layers", type=click.IntRange(min=1), default=4, show_default=True, help="ResBlocks per head.")
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Prompts to answer, one per line; default: the bundled prompts.",
)
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="Longest answer per prompt."
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Temperature of each prompt's first answer; 0 (greedy) trains the heads for greedy decoding.",
)
@click.option(
    "--num-sampled-answers",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="More answers per prompt, sampled at --sample-temperature: more varied text to train on. Every head "
    "learns the model's greedy choice at each position of every answer.",
)
@click.option(
    "--sample-temperature",
    type=click.FloatRange(min=0, min_open=True),
    default=0.8,
    show_default=True,
    help="Temperature of the sampled answers.",
)
@click.option(
    "--epochs", type=click.IntRange(min=1), default=3, show_default=True, help="Passes over the training positions."
)
@click.option(
    "--batch-size", type=click.IntRange(min=1), default=128, show_default=True, help="Positions per optimizer step."
)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True, help="AdamW rate.")
@click.option(
    "--held-out",
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    default=0.1,
    show_default=True,
    help="Share of the answers kept out of training to measure the heads' accuracy.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the split, the batches and sampling.")
@click.option(
    "--draft-vocab-size",
    type=click.IntRange(min=0),
    default=8192,
    show_default=True,
    help="Store the tokens the heads learnt to predict most often, this many (config.json's draft_vocab): the "
    "heads then score only those, reading that share of the output projection each step; 0: all tokens.",
)
@click.option(
    "--tree-nodes",
    type=click.IntRange(min=0, max=64),
    default=16,
    show_default=True,
    help="Store the draft tree of this many nodes that the held-out answers would have accepted most of "
    "(config.json's medusa_choices; the medusa speculator verifies it where the attention backend can); 0: none.",
)
@click.option(
    "--save-projection",
    is_flag=True,
    help="Also store the vocabulary projection in every head (Medusa-1's layout, hidden x vocab each), for "
    "loaders that need it; without it the heads use the model's own lm_head.",
)
@click.option("--no-progress", is_flag=True, help="Hide the progress bars.")
@config_options
def medusa(
    config: EngineConfig,
    output: Path,
    num_heads: int,
    num_layers: int,
    prompts: Path | None,
    max_new_tokens: int,
    temperature: float,
    num_sampled_answers: int,
    sample_temperature: float,
    epochs: int,
    batch_size: int,
    lr: float,
    held_out: float,
    seed: int,
    tree_nodes: int,
    draft_vocab_size: int,
    save_projection: bool,
    no_progress: bool,
) -> None:
    """Train Medusa heads for MODEL (or the config's model) on its own answers to a set of prompts.

    The model is run as `tokenmill serve` would run it (so train with the same --quantization and --dtype you
    serve with); serve the heads with --speculative-config '{"method": "medusa", "model": "OUTPUT"}'.
    """
    from tokenmill_plugins.commands.train.medusa import MedusaTrainingOptions, train_medusa

    options = MedusaTrainingOptions(
        num_heads=num_heads,
        num_layers=num_layers,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        num_sampled_answers=num_sampled_answers,
        sample_temperature=sample_temperature,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        held_out=held_out,
        seed=seed,
        tree_nodes=tree_nodes,
        draft_vocab_size=draft_vocab_size,
        save_projection=save_projection,
        progress=not no_progress,
    )
    result = train_medusa(config, output, options)
    click.echo(result.summary())
