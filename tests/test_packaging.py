"""The distribution itself: layout, wheel contents, import hygiene, docs that run."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Each top-level source folder holds exactly one import package, named as it is imported.
SOURCE_ROOTS = {
    "tokenmill": REPO / "core",
    "tokenmill_plugins": REPO / "plugins",
    "tokenmill_kernels": REPO / "kernels",
}


def _python_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci_lines if "pytest" in line)
    assert command in (REPO / "README.md").read_text().splitlines()


def test_every_import_name_maps_to_its_directory() -> None:
    """``tokenmill.x.y`` lives in core/tokenmill/x/y: tools resolve imports from the tree, no remap."""
    for name, root in SOURCE_ROOTS.items():
        entries = {p.name for p in root.iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info")}
        assert entries == {name}, f"{root.name}/ must hold only the package {name}/, found {sorted(entries)}"
        assert (root / name / "__init__.py").is_file()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "package-dir" not in pyproject["tool"]["setuptools"]
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["where"] == [r.name for r in SOURCE_ROOTS.values()]


@pytest.mark.slow
def test_wheel_maps_source_folders_to_import_names(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("tokenmill-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "tokenmill/__init__.py",
        "tokenmill/hookspecs.py",
        "tokenmill_plugins/__init__.py",
        "tokenmill_kernels/__init__.py",
        "tokenmill_kernels/quant_matmul/cpu/quant_matmul.cpp",
        "tokenmill_kernels/layer_kernels/cpu/layer_kernels.cpp",
        "tokenmill/models/llama.py",
        "tokenmill/py.typed",
    ):
        assert expected in names
    assert not any(name.startswith(("core/", "tests/")) for name in names)


def test_front_end_modules_do_not_import_torch() -> None:
    code = (
        "import sys, tokenmill, tokenmill.config, tokenmill.cli, tokenmill.tokenizer, tokenmill.plugin_manager;"
        "tokenmill.plugin_manager.load_plugins(autoload=False);"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.parametrize(
    "markdown", ["README.md", "docs/plugins/guide.md", "docs/tokenizer.md", "docs/sampling.md", "docs/engine.md"]
)
def test_python_blocks_in_docs_run(markdown: str, smollm2_gguf: Path) -> None:
    blocks = _python_blocks(REPO / markdown)
    assert blocks
    for block in blocks:
        result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, f"{markdown} block failed:\n{block}\n{result.stderr[-2000:]}"


def test_generated_reference_pages_are_current() -> None:
    from scripts.docgen import generated_pages

    for relative, text in generated_pages().items():
        assert (REPO / "docs" / relative).read_text() == text, (
            f"docs/{relative} is stale: python scripts/docgen.py docs"
        )
