"""Command plugins (``tokenmill_register_commands``), from a package built from its own pyproject and installed
by pip outside the tree: a plugin adds a ``tokenmill`` subcommand; one that fails to import, whose hook raises,
or that takes a name the CLI already has adds nothing, is listed by ``tokenmill plugins`` with its error, and
leaves the rest of the CLI working. The first-party tools (bench, eval, quantize, train) come the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tokenmill import hookimpl
from tokenmill.plugin_manager import load_plugins
from tokenmill.testing import install_package, pythonpath_env

DISTRIBUTION = "tm-command-plugins"
FIRST_PARTY = ("bench", "eval", "quantize", "train")
CORE = ("chat", "config", "engine", "generate", "plugins", "pull", "serve")

HELLO = """
import click

from tokenmill import hookimpl


@hookimpl
def tokenmill_register_commands(cli):
    @cli.command()
    @click.option("--name", default="world")
    def hello(name):
        \"\"\"Say hello from a plugin.\"\"\"
        click.echo(f"hello, {name}")
"""

#: entry point name -> (the module's source, its error as ``tokenmill plugins`` prints it)
BROKEN = {
    "broken-import": (
        """
        import tokenmill_no_such_dependency  # an ImportError when tokenmill loads the plugin
        """,
        "failed to import: ModuleNotFoundError: No module named 'tokenmill_no_such_dependency'",
    ),
    "raising-hook": (
        """
        from tokenmill import hookimpl

        @hookimpl
        def tokenmill_register_commands(cli):
            @cli.command()
            def half():
                \"\"\"Added before the hook raised: must not stay.\"\"\"

            raise RuntimeError("no commands today")
        """,
        "tokenmill_register_commands raised RuntimeError: no commands today",
    ),
    "taken-name": (
        """
        import click

        from tokenmill import hookimpl

        @hookimpl
        def tokenmill_register_commands(cli):
            @cli.command()
            def taken_extra():
                \"\"\"Added beside a taken name: must not stay.\"\"\"

            cli.add_command(click.Command("serve", help="Not the real serve."))
        """,
        "adds command 'serve', which the tokenmill command already has",
    ),
}


def _module(entry_point: str) -> str:
    return entry_point.replace("-", "_") + "_commands"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One distribution with a module and an entry point per plugin, built from its own pyproject and installed
    by pip into a folder of its own."""
    package = tmp_path_factory.mktemp("command-plugins")
    sources = {"hello": HELLO, **{name: source for name, (source, _) in BROKEN.items()}}
    for entry_point, source in sources.items():
        (package / f"{_module(entry_point)}.py").write_text(textwrap.dedent(source))
    pyproject = [
        "[build-system]", 'requires = ["setuptools>=68"]', 'build-backend = "setuptools.build_meta"',
        "[project]", f'name = "{DISTRIBUTION}"', 'version = "0.1.0"',
        "[tool.setuptools]", f"py-modules = {json.dumps([_module(name) for name in sources])}",
        "[project.entry-points.tokenmill]", *(f'{name} = "{_module(name)}"' for name in sources),
    ]  # fmt: skip
    (package / "pyproject.toml").write_text("\n".join(pyproject) + "\n")
    return install_package(package, package.parent / "site")


def _tokenmill(site: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **pythonpath_env(site)}
    env.pop("TOKENMILL_PLUGINS", None)
    env.pop("TOKENMILL_DISABLE_PLUGIN_AUTOLOAD", None)
    env.update(extra_env)
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip


def _commands(help_text: str) -> set[str]:
    """The names in the ``Commands:`` section of ``--help``."""
    section = help_text.partition("\nCommands:\n")[2]
    return {line.split()[0] for line in section.splitlines() if line.startswith("  ") and line.strip()}


@pytest.mark.multiproc
def test_help_lists_the_plugin_commands_and_each_runs(site: Path) -> None:
    result = _tokenmill(site, "--help")
    assert result.returncode == 0, result.stderr
    assert _commands(result.stdout) == {*CORE, *FIRST_PARTY, "hello"}  # nothing from the broken ones
    assert "Say hello from a plugin." in result.stdout
    warnings = result.stderr.strip().splitlines()  # one line for each plugin that adds nothing, no traceback
    assert len(warnings) == len(BROKEN), result.stderr
    for entry_point, (_, error) in BROKEN.items():
        (line,) = [line for line in warnings if f"plugin '{entry_point}'" in line]
        assert line.startswith(f"plugin '{entry_point}' (package {DISTRIBUTION} 0.1.0) is skipped: "), line
        assert error in line

    hello = _tokenmill(site, "hello", "--name", "tokenmill")
    assert (hello.returncode, hello.stdout) == (0, "hello, tokenmill\n"), hello.stderr
    serve = _tokenmill(site, "serve", "--help")  # the core's own, not the plugin's
    assert serve.returncode == 0 and "OpenAI-compatible" in serve.stdout, serve.stderr
    for command in FIRST_PARTY:
        first_party = _tokenmill(site, command, "--help")
        assert first_party.returncode == 0, first_party.stderr


@pytest.mark.multiproc
def test_tokenmill_plugins_lists_each_command_plugin_and_each_broken_one_with_its_error(site: Path) -> None:
    result = _tokenmill(site, "plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    hello = lines.index(f"hello 0.1.0 (entry point, package {DISTRIBUTION})")
    assert lines[hello + 1] == "    command: hello"
    commands = lines.index("commands 0.1.0 (entry point)")
    assert lines[commands + 1] == f"    command: {', '.join(FIRST_PARTY)}"
    for entry_point, (_, error) in BROKEN.items():
        (line,) = [line for line in lines if line.startswith(f"{entry_point} ")]
        assert line.startswith(f"{entry_point} 0.1.0 (entry point, package {DISTRIBUTION}) FAILED: "), line
        assert error in line


@pytest.mark.multiproc
def test_the_plugin_controls_apply_to_commands(site: Path) -> None:
    no_autoload = _tokenmill(site, "--help", TOKENMILL_DISABLE_PLUGIN_AUTOLOAD="1")
    assert no_autoload.returncode == 0 and _commands(no_autoload.stdout) == set(CORE), no_autoload.stderr
    allowlist = _tokenmill(site, "--help", TOKENMILL_PLUGINS="raising-hook")  # first-party ones always load
    assert _commands(allowlist.stdout) == {*CORE, *FIRST_PARTY}, allowlist.stderr
    disabled = _tokenmill(site, "hello", "--disable-plugin", "hello")
    assert disabled.returncode == 2 and "No such command 'hello'" in disabled.stderr, disabled.stderr


class _Greeter:
    @hookimpl
    def tokenmill_register_commands(self, cli: click.Group) -> None:
        @cli.command()
        def greet() -> None:
            click.echo("hi")


class _Raising:
    @hookimpl
    def tokenmill_register_commands(self, cli: click.Group) -> None:
        cli.add_command(click.Command("leftover"))
        raise ValueError("boom")


def test_load_plugins_adds_commands_and_undoes_a_raising_hook() -> None:
    cli = click.Group(commands={"serve": click.Command("serve")})
    system = load_plugins(autoload=False, extra_plugins=[("greeter", _Greeter()), ("raising", _Raising())], cli=cli)
    infos = {info.name: info for info in system.infos}
    assert infos["greeter"].provides == {"command": ["greet"]}
    assert infos["raising"].error == "tokenmill_register_commands raised ValueError: boom"
    assert sorted(cli.commands) == ["greet", "serve"]
    assert CliRunner().invoke(cli, ["greet"]).output == "hi\n"
    # Without a group (every process but the tokenmill command's), the hook is not called at all.
    quiet = load_plugins(autoload=False, extra_plugins=[("raising", _Raising())])
    assert next(info for info in quiet.infos if info.name == "raising").error is None
