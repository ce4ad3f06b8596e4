"""The `tokenmill` command: real subprocesses, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tokenmill.model_files import DEFAULT_MODEL


def tokenmill(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, env=env)


def test_config_show_prints_resolved_toml(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cache]\nblock_size = 8\n[attention]\nbackend = "torch"\n')
    result = tokenmill("config", "show", "--config", str(path), "--block-size", "64", "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr
    shown = tomllib.loads(result.stdout)
    assert shown["cache"]["block_size"] == 64
    assert shown["model"]["dtype"] == "bfloat16"
    assert shown["model"]["model"] == DEFAULT_MODEL.name


def test_bad_flag_value_is_one_line_error() -> None:
    result = tokenmill("config", "show", "--block-size", "12")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "Error: command line: invalid setting cache: block_size must be a power of two (8, 16, 32, ...), got 12"
    )


def test_bad_file_is_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[cache]\nblok_size = 8\n")
    result = tokenmill("config", "show", "--config", str(path))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "unknown setting 'cache.blok_size'" in result.stderr


def test_help_lists_flags_generated_from_fields() -> None:
    result = tokenmill("config", "show", "--help")
    assert result.returncode == 0
    for flag in ("--block-size", "--attention-backend", "--dtype", "--max-model-len", "--disable-plugin"):
        assert flag in result.stdout
    assert "Tokens per KV cache block" in result.stdout
