"""The ``tokenmill`` command.

Every subcommand turns tokenmill's own exceptions into a one-line message
and exit status 1; a traceback means a bug.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import click

from tokenmill import __version__, envs
from tokenmill.bench.cli import bench
from tokenmill.config import EngineConfig
from tokenmill.config.options import config_options
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)


class _Main(click.Group):
    """Prints a ``TokenmillError`` as one line (``Error: ...``, exit 1) instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TokenmillError as exc:
            raise click.ClickException(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tokenmill")
def main() -> None:
    """tokenmill: a plugin-based LLM inference runtime."""
    logging.basicConfig(level=envs.TOKENMILL_LOG_LEVEL.get(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request drowns the output


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--disable-plugin", "disabled", multiple=True, help="Plugin not to load. Repeatable.")
def plugins(as_json: bool, disabled: tuple[str, ...]) -> None:
    """List installed plugins, their versions and what they provide."""
    from tokenmill.plugin_manager import load_plugins

    system = load_plugins(disabled=disabled)
    if as_json:
        click.echo(json.dumps([info.__dict__ for info in system.infos], indent=2))
        return
    for info in system.infos:
        status = f"FAILED: {info.error}" if info.error else ""
        click.echo(f"{info.name} {info.version} ({info.source}) {status}".rstrip())
        for slot, names in sorted(info.provides.items()):
            click.echo(f"    {slot}: {', '.join(names)}")


@main.group()
def config() -> None:
    """Inspect configuration."""


@config.command("show")
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of TOML.")
def config_show(config: EngineConfig, as_json: bool) -> None:
    """Print the resolved config (file + flags + defaults) as TOML."""
    if as_json:
        click.echo(json.dumps(config.to_dict(), indent=2))
    else:
        click.echo(config.to_toml(), nl=False)


@main.command()
def pull() -> None:
    """Fetch the default model (SmolLM2-135M-Instruct Q4_1 GGUF) into the cache."""
    from tokenmill.model_files import DEFAULT_MODEL
    from tokenmill.model_files import pull as pull_model

    path = pull_model(DEFAULT_MODEL)
    click.echo(str(path))


@main.command()
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL: one object per line with 'prompt' or 'messages', optional 'id' and sampling fields.",
)
@click.option(
    "--output",
    "output_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSONL results, appended; ids already there are skipped, so a rerun resumes.",
)
@click.option("--no-progress", is_flag=True, help="Hide the progress bar.")
@config_options
def generate(config: EngineConfig, input_path: Path, output_path: Path, no_progress: bool) -> None:
    """Generate for every line of a JSONL file (offline, in this process)."""
    from tokenmill.batch_generate import run_batch
    from tokenmill.llm import LLM

    llm = LLM.from_config(config)
    summary = run_batch(llm, input_path, output_path, use_tqdm=not no_progress)
    click.echo(
        f"{summary.num_completed} completed, {summary.num_errors} errors, "
        f"{summary.num_skipped} already in {output_path}",
        err=True,
    )


@main.command()
@click.argument("model_argument", metavar="[MODEL]", required=False)
@config_options
def serve(config: EngineConfig) -> None:
    """Serve MODEL (or the config's model) over an OpenAI-compatible HTTP API."""
    from tokenmill.server.serve import run_server

    raise SystemExit(run_server(config))


@main.command()
@click.option("--listen", required=True, help="Address to serve, e.g. tcp://0.0.0.0:5555 or ipc:///tmp/engine.sock.")
@click.argument("model_argument", metavar="[MODEL]", required=False)
@config_options
def engine(config: EngineConfig, listen: str) -> None:
    """Run one engine process on LISTEN, for `tokenmill serve --engine LISTEN` on another host."""
    from tokenmill.engine_process import run_engine_process

    run_engine_process(config.to_dict(), listen)


@main.command()
@click.option("--url", help="A running server (http://HOST:PORT); without it, the model runs in this process.")
@click.option("--system", help="System prompt.")
@click.option("--max-tokens", default=512, show_default=True, help="Most tokens per reply.")
@click.option("--temperature", default=0.7, show_default=True, help="Sampling temperature.")
@config_options
def chat(config: EngineConfig, url: str | None, system: str | None, max_tokens: int, temperature: float) -> None:
    """Talk to the model in the terminal. /reset starts over; /exit (or Ctrl-D) quits."""
    from tokenmill.chat import run_chat

    run_chat(config, url, system, max_tokens, temperature)


main.add_command(bench)


if __name__ == "__main__":
    main()
