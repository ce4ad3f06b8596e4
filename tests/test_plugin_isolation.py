"""Failure isolation, with real packages installed by pip: a plugin that fails to import, one that
registers a name a built-in already has, and one that implements a hook this tokenmill lacks are each
listed with their error and skipped. ``tokenmill plugins`` and ``tokenmill serve`` keep working; only
selecting something a broken plugin would have provided fails, at once, in one line that names it.
The ``TOKENMILL_PLUGINS`` allowlist never drops tokenmill's own entry-point plugins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.testing import TokenmillServer, install_package, pythonpath_env

pytestmark = pytest.mark.multiproc

#: entry point name -> (the module's source, the attention backend only it would provide, its error)
BROKEN_PLUGINS = {
    "broken-import": (
        """
        import tokenmill_no_such_dependency  # an ImportError when tokenmill loads the plugin
        """,
        "needs-a-dependency",
        "failed to import: ModuleNotFoundError: No module named 'tokenmill_no_such_dependency'",
    ),
    "duplicate-name": (
        """
        from tokenmill import hookimpl

        @hookimpl
        def tokenmill_register_attention_backends(register):
            register("torch", "duplicate_name_plugin:Backend")  # the built-in reference's name
            register("duplicate-only", "duplicate_name_plugin:Backend")
        """,
        "duplicate-only",
        "registers attention_backend 'torch', which plugin 'tokenmill.attention.plugin'",
    ),
    "unknown-hook": (
        """
        from tokenmill import hookimpl

        @hookimpl
        def tokenmill_register_nonexistent(register):
            register("x", "unknown_hook_plugin:X")

        @hookimpl
        def tokenmill_register_attention_backends(register):
            register("from-the-future", "unknown_hook_plugin:Backend")
        """,
        "from-the-future",
        "implements hook(s) that tokenmill 0.1.0 does not have: tokenmill_register_nonexistent",
    ),
}


def _module(entry_point: str) -> str:
    return entry_point.replace("-", "_") + "_plugin"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three packages, each built from its own pyproject and installed by pip into one folder."""
    root = tmp_path_factory.mktemp("broken-plugins")
    target = root / "site"
    for entry_point, (source, _, _) in BROKEN_PLUGINS.items():
        package = root / entry_point
        (package / _module(entry_point)).mkdir(parents=True)
        (package / _module(entry_point) / "__init__.py").write_text(textwrap.dedent(source))
        (package / "pyproject.toml").write_text(textwrap.dedent(f"""
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "tm-{entry_point}"
            version = "0.1.0"

            [project.entry-points.tokenmill]
            {entry_point} = "{_module(entry_point)}"
            """))  # fmt: skip
        install_package(package, target)
    return target


def _env(site: Path, **extra: str) -> dict[str, str]:
    return {**pythonpath_env(site), **extra}


def _tokenmill(site: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **_env(site, **extra_env)}, timeout=120)  # fmt: skip


def test_tokenmill_plugins_lists_each_broken_plugin_with_its_error(site: Path) -> None:
    result = _tokenmill(site, "plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for entry_point, (_, _, error) in BROKEN_PLUGINS.items():
        (line,) = [line for line in lines if line.startswith(f"{entry_point} ")]
        assert line.startswith(f"{entry_point} 0.1.0 (entry point, package tm-{entry_point}) FAILED: "), line
        assert error in line
    assert "attention_backend: torch" in result.stdout  # the built-in kept its name
    assert "duplicate-only" not in result.stdout and "from-the-future" not in result.stdout  # nothing half-registered


@pytest.mark.parametrize("entry_point", list(BROKEN_PLUGINS))
def test_selecting_what_a_broken_plugin_provides_fails_in_one_line_naming_it(
    site: Path, tiny_model_dir: Path, entry_point: str
) -> None:
    _, backend, error = BROKEN_PLUGINS[entry_point]
    started = time.monotonic()
    result = _tokenmill(site, "serve", str(tiny_model_dir), "--attention-backend", backend, "--device", "cpu")
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    warnings = [line for line in lines if " WARNING tokenmill.plugin_manager: " in line]
    assert len(warnings) == len(BROKEN_PLUGINS)  # each skipped plugin is logged once as it loads
    (line,) = [line for line in lines if line not in warnings]  # then one line, no traceback
    assert line.startswith(f"Error: attention.backend: unknown attention_backend '{backend}'; installed: "), line
    assert f"plugin '{entry_point}' (package tm-{entry_point} 0.1.0): {error}" in line
    assert elapsed < 2.0, f"took {elapsed:.2f} s"


@pytest.mark.slow
def test_serve_keeps_working_beside_broken_plugins(
    site: Path, tokenmill_server: Callable[..., TokenmillServer]
) -> None:
    server = tokenmill_server(env=_env(site))
    completion = server.client.completions.create(model=server.model, prompt="hello", max_tokens=3, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert "is skipped" in server.log.read_text()  # each broken plugin was reported in the log


def test_allowlist_never_drops_first_party_plugins(site: Path) -> None:
    result = _tokenmill(site, "plugins", "--json", TOKENMILL_PLUGINS="unknown-hook")
    assert result.returncode == 0, result.stderr
    plugins = {info["name"]: info for info in json.loads(result.stdout)["plugins"]}
    first_party = {name for name, info in plugins.items() if info["package"] == "tokenmill"}
    assert {"attention", "quant", "tokenmill.attention.plugin", "tokenmill.scheduler"} <= first_party
    third_party = set(plugins) - first_party
    assert third_party == {"unknown-hook"}  # the allowlist applies to everyone else
    assert plugins["attention"]["provides"]["attention_backend"] == ["cpu", "triton", "cuda"]
