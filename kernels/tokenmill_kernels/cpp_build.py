"""Building the CPU kernels' C++ on first use.

Wheels ship the C++ sources, not binaries tied to one torch build: ``torch.utils.cpp_extension.load``
compiles each extension the first time a process asks for it and caches the result under
``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``). torch's build takes a file lock in
that directory, so two engine processes starting together wait for one build. The kernels use
AVX2, FMA and F16C: :meth:`CppExtension.load` says what is missing instead of letting the process
die of an illegal instruction.

Every extension is built with ``-fopenmp``: ``at::parallel_for`` is a header template that runs
in parallel only when compiled with OpenMP, and the libgomp it links is matched by soname to the
one torch has loaded, so ``torch.set_num_threads`` governs the kernels' threads too.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from types import ModuleType

import torch


class CppExtension:
    """One C++ source file built into one importable extension, lazily and once per process."""

    def __init__(self, name: str, source: Path, cflags: list[str], description: str) -> None:
        """``name`` is the importable module's name (and its build directory's); ``cflags`` are the
        compiler flags beyond ``-fopenmp``; ``description`` names the kernels in errors."""
        self.name = name
        self.source = source
        self.cflags = cflags
        self.description = description
        self._module: ModuleType | None = None
        self._lock = threading.Lock()

    def missing(self) -> list[str]:
        """What stops the extension from building or running here; empty when nothing does."""
        missing = []
        # torch reports AVX2 (or AVX512) only when the CPU has both AVX2 and FMA.
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "AVX512"):
            missing.append(f"a CPU with AVX2 and FMA (torch reports {capability!r})")
        # F16C (float16 <-> float32, for float16 scales and caches) comes with every AVX2 CPU, but a
        # virtual machine may hide it; where the flags cannot be read, trust the AVX2 report.
        flags = cpu_flags()
        if flags is not None and "f16c" not in flags:
            missing.append("a CPU with F16C (not in /proc/cpuinfo's flags)")
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            missing.append(f"a C++ compiler ({compiler!r} is not on PATH; set CXX to choose one)")
        if not _cpp_extension().is_ninja_available():
            missing.append("ninja (pip install ninja)")
        return missing

    def is_available(self) -> bool:
        """True when the CPU can run the kernels and the toolchain to build them is present."""
        return self._module is not None or not self.missing()

    def load(self) -> ModuleType:
        """The compiled extension, built on first call; raises ``RuntimeError`` naming what is missing."""
        if self._module is not None:
            return self._module
        with self._lock:
            if self._module is None:
                missing = self.missing()
                if missing:
                    raise RuntimeError(f"tokenmill's {self.description} need " + " and ".join(missing))
                self._module = _cpp_extension().load(
                    name=self.name,
                    sources=[str(self.source)],
                    extra_cflags=[*self.cflags, "-fopenmp"],
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
        return self._module


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The CPU's feature flags as Linux lists them (``"avx2"``, ``"f16c"``, ...); None where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def _cpp_extension() -> ModuleType:
    # Imported on demand: it pulls in setuptools, which the rest of tokenmill does not need.
    import torch.utils.cpp_extension

    return torch.utils.cpp_extension
