"""The run fails when tests skip for want of the CPU kernels on a machine that has what they need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_machine import cpu_kernels_missing

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, reason: str) -> subprocess.CompletedProcess[str]:
    planted = tmp_path / "test_planted.py"
    planted.write_text(f"import pytest\n\ndef test_planted():\n    pytest.skip({reason!r})\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(planted)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(cpu_kernels_missing() is not None, reason="this machine cannot build the CPU kernels")
def test_a_kernel_skip_on_a_machine_that_can_build_them_fails_the_run(tmp_path: Path) -> None:
    result = _run(tmp_path, "needs AVX2+FMA and a C++ toolchain")
    assert result.returncode == 1, result.stdout
    assert "1 tests skipped for want of the CPU kernels" in result.stdout
    assert "test_planted.py::test_planted: Skipped: needs AVX2+FMA and a C++ toolchain" in result.stdout


@pytest.mark.parametrize(
    "reason", ["no CUDA device", "this CPU lacks amx (it supports avx2, avx_vnni, avx512, avx512_vnni16)"]
)
def test_other_skips_pass(tmp_path: Path, reason: str) -> None:
    result = _run(tmp_path, reason)
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(cpu_kernels_missing() is not None, reason="this machine cannot build the CPU kernels")
@pytest.mark.parametrize("reason", ["the int8 kernels need AVX2, FMA and a compiler", "needs a C++ toolchain"])
def test_every_way_the_kernel_skips_say_it_is_caught(tmp_path: Path, reason: str) -> None:
    assert _run(tmp_path, reason).returncode == 1
