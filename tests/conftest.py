"""Fixtures shared by every test package."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cpu_machine import cpu_kernels_missing

_WEIGHT_CACHE = "TOKENMILL_WEIGHT_CACHE_DIR"


def pytest_configure(config: pytest.Config) -> None:
    # Quantized models that tests load (and the servers they start, which inherit the environment) cache
    # their repacked weights in a folder of this run, removed at its end, not in ~/.cache/tokenmill/weights.
    if _WEIGHT_CACHE not in os.environ:
        config.stash[_weight_cache_key] = os.environ[_WEIGHT_CACHE] = tempfile.mkdtemp(prefix="tokenmill-weights-")


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_weight_cache_key, None)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
        del os.environ[_WEIGHT_CACHE]


_weight_cache_key = pytest.StashKey[str]()

# A skip for want of the CPU kernels says so: "need(s) AVX2", "a compiler", "a C++ toolchain". A skip for an ISA
# variant this CPU lacks may list the ones it has ("it supports avx2, ..."), which is not one.
_KERNEL_SKIP = re.compile(r"needs? AVX2|compiler|toolchain", re.IGNORECASE)
_kernel_skips: list[str] = []  # "nodeid: reason", this run's


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and isinstance(report.longrepr, tuple) and _KERNEL_SKIP.search(str(report.longrepr[2])):
        _kernel_skips.append(f"{report.nodeid}: {report.longrepr[2]}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run when tests skipped for want of the CPU kernels on a machine that can build and run them: a
    kernel package reporting itself unavailable there is a bug, and its tests must not vanish unseen."""
    skipped = _kernel_skips
    if skipped and cpu_kernels_missing() is None:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(
                f"{len(skipped)} tests skipped for want of the CPU kernels, on a machine with AVX2 and a compiler:",
                red=True,
            )
            for line in skipped[:20]:
                reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """An engine built in-process sets torch's thread count (``device.num_threads``, tensor-parallel shares): put
    it back, so that no test runs with what an earlier one left (a thread count changes float summation order,
    and with it which activations round which way in quantized references)."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file, pulled into the cache on first use."""
    from tokenmill.model_files import pull

    return pull()
