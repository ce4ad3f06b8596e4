"""Building the CPU kernels' C++ on first use.

Wheels ship the C++ sources, not binaries tied to one torch build: ``torch.utils.cpp_extension.load``
compiles each extension the first time a process asks for it and caches the result under
``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``). torch's build takes a file lock in
that directory, so two engine processes starting together wait for one build. The kernels use
AVX2, FMA and F16C: :meth:`CppExtension.load` says what is missing instead of letting the process
die of an illegal instruction.

Each build lives in a directory named by :func:`build_key`, a hash of the source's bytes, the
compiler flags, the torch version and the Python ABI, and compiles a copy of the source kept
there. torch keys its directory by the extension's name alone, and ninja rebuilds whenever the
source path in its command changes, so two clones or installs sharing one cache used to rebuild
each other's kernels on every start; now each build's inputs have one directory of their own.

Every extension is built with ``-fopenmp``: ``at::parallel_for`` is a header template that runs
in parallel only when compiled with OpenMP, and the libgomp it links is matched by soname to the
one torch has loaded, so ``torch.set_num_threads`` governs the kernels' threads too.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_OPENMP_FLAGS = ("-fopenmp",)


class CppExtension:
    """One C++ source file built into one importable extension, lazily and once per process."""

    def __init__(self, name: str, source: Path, cflags: list[str], description: str, build_seconds: int = 60) -> None:
        """``name`` is the importable module's name (and starts its build directory's); ``cflags``
        are the compiler flags beyond ``-fopenmp``; ``description`` names the kernels in errors and
        in the build message, with ``build_seconds`` as its estimate."""
        self.name = name
        self.source = source
        self.cflags = cflags
        self.description = description
        self.build_seconds = build_seconds
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
        compiler = _compiler()
        if shutil.which(compiler) is None:
            missing.append(f"a C++ compiler ({compiler!r} is not on PATH; set CXX to choose one)")
        if _ninja_version() is None:
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
                self._module = self._build_or_load()
        return self._module

    def build_directory(self, source: bytes) -> Path:
        """Where the build of ``source`` (this extension's C++) with this torch and Python lives."""
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or _cpp_extension().get_default_build_root()
        toolchain = f"{_compiler()} ninja {_ninja_version()}"
        key = build_key(
            source, [*self.cflags, *_OPENMP_FLAGS], [*_OPENMP_FLAGS], toolchain, torch.__version__, _python_abi()
        )
        return Path(root) / f"{self.name}-{key}"

    def _build_or_load(self) -> ModuleType:
        source = self.source.read_bytes()
        directory = self.build_directory(source)
        directory.mkdir(parents=True, exist_ok=True)
        # Compile a copy kept beside the build: ninja's command then names no clone's own path.
        copy = directory / self.source.name
        if not copy.exists() or copy.read_bytes() != source:
            partial = copy.with_name(f"{copy.name}.{os.getpid()}.tmp")
            partial.write_bytes(source)
            partial.replace(copy)
        is_built = (directory / f"{self.name}.so").exists()
        if not is_built:
            logger.info(
                "building tokenmill's %s (first start only, about %d s) in %s",
                self.description,
                self.build_seconds,
                directory,
            )
        started = time.monotonic()
        module = _cpp_extension().load(
            name=self.name,
            sources=[str(copy)],
            extra_cflags=[*self.cflags, *_OPENMP_FLAGS],
            extra_ldflags=[*_OPENMP_FLAGS],  # a list of its own: torch appends its libraries to it
            build_directory=str(directory),
            verbose=False,
        )
        if not is_built:
            logger.debug("built %s in %.0f s", self.name, time.monotonic() - started)
        return module


def build_key(
    source: bytes, cflags: list[str], ldflags: list[str], toolchain: str, torch_version: str, python_abi: str
) -> str:
    """A short hash of everything a build depends on: the source's bytes, the flags, the toolchain (the
    compiler's name and ninja's version), the torch version and the Python ABI (``cpython-311-x86_64-linux-gnu``).

    Ninja is in it because versions record commands differently: a build directory shared by two
    ninjas (a venv's and the system's) was rebuilt by each after the other."""
    digest = hashlib.sha256(source)
    for part in (" ".join(cflags), " ".join(ldflags), toolchain, torch_version, python_abi):
        digest.update(b"\0" + str(part).encode())
    return digest.hexdigest()[:16]


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


def _python_abi() -> str:
    return sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag


def _compiler() -> str:
    # torch's build runs $CXX, else c++.
    return os.environ.get("CXX", "c++")


@functools.cache
def _ninja_version() -> str | None:
    """The version of the ninja torch's build runs (the first on PATH), or None when there is none."""
    try:
        result = subprocess.run(["ninja", "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return result.stdout.strip()


def _cpp_extension() -> ModuleType:
    # Imported on demand: it pulls in setuptools, which the rest of tokenmill does not need.
    import torch.utils.cpp_extension

    return torch.utils.cpp_extension
