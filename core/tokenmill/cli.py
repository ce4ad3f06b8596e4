"""The ``tokenmill`` command.

The core's own subcommands are here (serve, engine, plugins, config, pull,
generate, chat); plugins add the others through ``tokenmill_register_commands``
(the first-party ``commands`` plugin adds bench, eval, quantize and train).
Every subcommand turns tokenmill's own exceptions into a one-line message
and exit status 1; a traceback means a bug.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from tokenmill import __version__, envs
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.config.options import config_options
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)


class _Main(click.Group):
    """Prints a ``TokenmillError`` as one line (``Error: ...``, exit 1) instead of a traceback, and adds the
    plugins' commands the first time it needs a command that is not its own (to list or to run one)."""

    _has_plugin_commands = False
    _args: Sequence[str] = ()

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TokenmillError as exc:
            raise click.ClickException(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        self._args = tuple(args)  # read for --disable-plugin when the plugins' commands are added
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._add_plugin_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            self._add_plugin_commands()
        return super().get_command(ctx, cmd_name)

    def _add_plugin_commands(self) -> None:
        """Each plugin's ``tokenmill_register_commands``, once. Plugins load as for any command (the allowlist,
        ``TOKENMILL_DISABLE_PLUGIN_AUTOLOAD`` and ``--disable-plugin`` on the command line apply); a plugin that
        fails is logged in one line, listed by ``tokenmill plugins``, and adds nothing."""
        if self._has_plugin_commands:
            return
        self._has_plugin_commands = True
        from tokenmill.plugin_manager import load_plugins

        try:
            load_plugins(disabled=_disabled_plugins(self._args), cli=self)
        except TokenmillError as exc:  # --disable-plugin naming an essential plugin, or a broken built-in one
            logger.warning("no plugin commands: %s", exc)


def _disabled_plugins(args: Sequence[str]) -> list[str]:
    """The names given to ``--disable-plugin`` anywhere in ``args`` (before the config is parsed)."""
    names = []
    for index, arg in enumerate(args):
        if arg == "--disable-plugin" and index + 1 < len(args):
            names.append(args[index + 1])
        elif arg.startswith("--disable-plugin="):
            names.append(arg.partition("=")[2])
    return names


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tokenmill")
def main() -> None:
    """tokenmill: a plugin-based LLM inference runtime."""
    logging.basicConfig(level=envs.TOKENMILL_LOG_LEVEL.get(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request drowns the output


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@config_options
def plugins(config: EngineConfig, as_json: bool) -> None:
    """List every slot, its implementations and which one the config selects, and each installed plugin
    with its version, package, options, and the error that made it skipped."""
    from tokenmill.plugin_manager import load_plugins

    # The plugins' commands go to a copy of the core's, so that a plugin whose command hook fails is listed so.
    core = click.Group(commands={name: main.commands[name] for name in _CORE_COMMANDS})
    system = load_plugins(disabled=config.disable_plugins, cli=core)
    system.configure(config.plugins)
    report = _plugins_report(system, config)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    for info in report["plugins"]:
        where = (
            info["source"]
            if info["package"] in ("tokenmill", "unknown")
            else f"{info['source']}, package {info['package']}"
        )
        status = f" FAILED: {info['error']}" if info["error"] else ""
        click.echo(f"{info['name']} {info['version']} ({where}){status}")
        for slot, names in sorted(info["provides"].items()):
            click.echo(f"    {slot}: {', '.join(names)}")
        if info["options"]:
            values = ", ".join(f"{key} = {json.dumps(value)}" for key, value in info["options"].items())
            click.echo(f"    options [plugins.{info['name']}]: {values}")
    click.echo("")
    click.echo("slot: selected by; installed")
    for slot in report["slots"]:
        chosen = f"{slot['setting']} = {', '.join(slot['selected'])}" if slot["selected"] else slot["setting"]
        click.echo(f"  {slot['slot']}: {chosen}; {', '.join(slot['installed']) or 'none yet'}")
    click.echo("")
    click.echo("architecture: class (plugin); supports")
    for row in report["architectures"]:
        click.echo(f"  {row['architecture']}: {row['implementation']} ({row['plugin']}); {_supports(row)}")


def _supports(row: dict[str, Any]) -> str:
    """What one architecture row supports, in words."""
    if row["error"]:
        return f"FAILED: {row['error']}"
    features = ["fallback for any architecture without a native plugin"] if row["is_fallback"] else ["native"]
    features.append("quantized weights" if row["supports_quantization"] else "dense weights only")
    features += ["tensor parallel"] if row["supports_tensor_parallel"] else []
    features += ["GGUF"] if row["reads_gguf"] else []
    return ", ".join(features)


def _plugins_report(system: Any, config: EngineConfig) -> dict[str, Any]:
    import msgspec

    from tokenmill.models.catalog import architecture_table
    from tokenmill.plugin_manager import slot_selections

    plugins = []
    for info in system.infos:
        options = system.options(info.name) if info.error is None else None
        plugins.append({
            "name": info.name, "version": info.version, "source": info.source, "package": info.package,
            "hooks": info.hooks, "provides": info.provides, "error": info.error,
            "options": msgspec.to_builtins(options) if options is not None else None,
        })  # fmt: skip
    slots = [
        {"slot": slot.value, "setting": setting, "selected": names, "installed": system.registry.names(slot)}
        for slot, (setting, names) in slot_selections(config).items()
    ]
    architectures = [dataclasses.asdict(row) for row in architecture_table(system.registry)]
    return {"plugins": plugins, "slots": slots, "architectures": architectures}


@main.group()
def config() -> None:
    """Inspect configuration."""


@config.command("show")
@config_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of TOML.")
def config_show(config: EngineConfig, as_json: bool) -> None:
    """Print the resolved config (file + flags + defaults, plugin options included) as TOML."""
    from tokenmill.plugin_manager import resolve_plugins

    config = resolve_plugins(config).resolved_config(config)
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

    llm = LLM.from_config(config)  # checks the config's plugin names before loading anything
    summary = run_batch(llm, input_path, output_path, use_tqdm=not no_progress)
    click.echo(
        f"{summary.num_completed} completed, {summary.num_errors} errors, "
        f"{summary.num_skipped} already in {output_path}",
        err=True,
    )


#: vLLM's ``--data-parallel-backend`` values, as ``server.backend`` names them.
_DATA_PARALLEL_BACKENDS = {"mp": "local", "ray": "ray"}


@main.command()
@click.argument("model_argument", metavar="[MODEL]", required=False)
@click.option(
    "--data-parallel-backend",
    type=click.Choice(sorted(_DATA_PARALLEL_BACKENDS)),
    help="vLLM's spelling of --backend: 'mp' is 'local' (engine processes on this host), 'ray' is 'ray'.",
)
@config_options
def serve(config: EngineConfig, data_parallel_backend: str | None) -> None:
    """Serve MODEL (or the config's model) over an OpenAI-compatible HTTP API."""
    import msgspec

    from tokenmill.plugin_manager import resolve_plugins
    from tokenmill.server.serve import run_server

    if data_parallel_backend is not None:
        backend = _DATA_PARALLEL_BACKENDS[data_parallel_backend]
        given = click.get_current_context().params.get("cfg__server__backend")
        if given is not None and given != backend:
            raise click.UsageError(f"--backend {given} and --data-parallel-backend {data_parallel_backend} disagree")
        try:  # converted again, so that the server section's checks see the new backend
            server = msgspec.convert({**msgspec.to_builtins(config.server), "backend": backend}, type(config.server))
        except (msgspec.ValidationError, ValueError) as exc:
            raise ConfigError(str(exc)) from None
        config = msgspec.structs.replace(config, server=server)
    resolve_plugins(config)  # a misspelled plugin name fails here, in well under a second

    raise SystemExit(run_server(config))


@main.command()
@click.option("--listen", required=True, help="Address to serve, e.g. tcp://0.0.0.0:5555 or ipc:///tmp/engine.sock.")
@click.argument("model_argument", metavar="[MODEL]", required=False)
@config_options
def engine(config: EngineConfig, listen: str) -> None:
    """Run one engine process on LISTEN, for `tokenmill serve --engine LISTEN` on another host."""
    from tokenmill.engine_process import run_engine_process
    from tokenmill.plugin_manager import FRONT_END_SLOTS, resolve_plugins

    resolve_plugins(config, skip=FRONT_END_SLOTS)  # its front end, on another host, builds the router

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


#: The core's own subcommands; plugins add the rest when the CLI first needs them.
_CORE_COMMANDS = tuple(main.commands)


if __name__ == "__main__":
    main()
