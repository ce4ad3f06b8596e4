"""The plugin author pages run as written: testing.md's complete example passes under pytest, and the
tutorial's files, assembled from the page, make a package that pip installs and whose tests pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.testing import install_package, pythonpath_env

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins"
_BLOCK = re.compile(r"```(\w+)\n(.*?)```", flags=re.S)


def _blocks(page: str) -> list[tuple[str, str]]:
    return _BLOCK.findall((DOCS / page).read_text())


def _pytest(folder: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
        capture_output=True, text=True, cwd=folder, env={**os.environ, **(env or {})}, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_testing_page_example_passes(tmp_path: Path) -> None:
    (example,) = [code for language, code in _blocks("testing.md") if language == "python" and "NoRepeatPlugin" in code]
    (tmp_path / "test_no_repeat.py").write_text(example)
    result = _pytest(tmp_path)
    assert result.returncode == 0 and "3 passed" in result.stdout, result.stdout[-3000:]


@pytest.mark.slow
def test_tutorial_files_make_a_package_whose_tests_pass(tmp_path: Path) -> None:
    package = tmp_path / "tm-prefix-affinity"
    files = 0
    for _, code in _blocks("tutorial.md"):
        first, _, rest = code.partition("\n")
        if first.startswith("# file: ") and first != "# file: tokenmill.toml":
            path = package / first.removeprefix("# file: ")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code)
            files += 1
    assert files == 5  # pyproject, options, router, registration, tests
    site = install_package(package, tmp_path / "site")
    result = _pytest(package / "tests", pythonpath_env(site))
    assert result.returncode == 0 and "4 passed" in result.stdout, result.stdout[-3000:]
