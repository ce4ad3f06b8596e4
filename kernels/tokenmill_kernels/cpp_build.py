"""Building the CPU kernels' C++ on first use.

Wheels ship the C++ sources, not binaries tied to one torch build: ``torch.utils.cpp_extension.load``
compiles each extension the first time a process asks for it and caches the result under
``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``). A build holds an ``flock`` in its
directory, so two engine processes starting together wait for one build; torch's own lock file,
which a killed build leaves behind for every later start to wait on, is removed by the next build
that holds the ``flock`` (:func:`_build_lock`). The kernels use
AVX2, FMA and F16C: :meth:`CppExtension.load` says what is missing instead of letting the process
die of an illegal instruction.

Each build lives in a directory named by :func:`build_key`, a hash of the source's bytes, the
compiler flags, the torch version and the Python ABI, and compiles a copy of the source kept
there. torch keys its directory by the extension's name alone, and ninja rebuilds whenever the
source path in its command changes, so two clones or installs sharing one cache used to rebuild
each other's kernels on every start; now each build's inputs have one directory of their own.

The headers the extensions share (``cpu_common/isa.h``: the run-time choice of an instruction-set variant) live
under :data:`INCLUDE_ROOT` and are included by their path from there (``#include "cpu_common/isa.h"``). A build
copies those its source includes (:func:`local_headers`) into ``include/`` in its directory, passed with ``-I``,
and their bytes are part of the key: an edited header rebuilds every extension that includes it, and no other.

A first start builds only the extensions the selected kernels use, and builds them side by side: each plugin's
constructor calls :meth:`CppExtension.prepare`, which starts a missing build on a thread of its own (the compiler
runs in a subprocess, so the builds share the cores while the weights load), and the first call that needs the
module waits for it in :meth:`CppExtension.load`, logging every 15 s how long it has waited. An extension built
by an earlier start is imported directly (its key says the build is current): no setuptools, no ninja. The extensions
include a lean set of torch headers (``cpu_common/extension.h``), not ``<torch/extension.h>``, which alone took
22 s of each build.

An extension with instruction-set variants (one that includes ``cpu_common/isa.h``) compiles only those the building
machine's CPU has (:func:`variant_flags`): a CPU without AVX-512 does not compile, nor wait for, the AVX-512 and AMX
tiles, which are most of the int4 matmul's build.

Every extension is built with ``-fopenmp``: ``at::parallel_for`` is a header template that runs
in parallel only when compiled with OpenMP, and the libgomp it links is matched by soname to the
one torch has loaded, so ``torch.set_num_threads`` governs the kernels' threads too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType

import torch

from tokenmill_kernels.cpu_isa import apply_level_from_env

logger = logging.getLogger(__name__)

_OPENMP_FLAGS = ("-fopenmp",)

#: The folder the extensions' shared headers are included from: ``cpu_common/isa.h`` is ``INCLUDE_ROOT / "cpu_common"
#: / "isa.h"``.
INCLUDE_ROOT = Path(__file__).resolve().parent

_WAIT_LOG_SECONDS = 15.0

#: The file in a build directory whose ``flock`` a building process holds (:func:`_build_lock`).
_BUILD_LOCK = "tokenmill-build.lock"

#: The header whose TOKENMILL_BUILD_<SET> macros :func:`variant_flags` sets.
_ISA_HEADER = "cpu_common/isa.h"

#: Each TOKENMILL_BUILD_<SET> of ``cpu_common/isa.h`` and the /proc/cpuinfo flags its variants need.
_VARIANT_SETS = {
    "AVX_VNNI": ("avx_vnni",),
    "AVX512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "AVX512_VNNI": ("avx512_vnni",),
    "AMX": ("amx_tile", "amx_int8"),
}

_QUOTED_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


class CppExtension:
    """One C++ source file built into one importable extension, lazily and once per process."""

    def __init__(
        self,
        name: str,
        source: Path,
        cflags: list[str],
        description: str,
        include_root: Path = INCLUDE_ROOT,
    ) -> None:
        """``name`` is the importable module's name (and starts its build directory's); ``cflags``
        are the compiler flags beyond ``-fopenmp``; ``description`` names the kernels in errors and
        in the build messages; ``include_root`` is where the headers the source includes with quotes
        are looked up (:func:`local_headers`)."""
        self.name = name
        self.source = source
        self.cflags = cflags
        self.description = description
        self.include_root = include_root
        self._module: ModuleType | None = None
        self._lock = threading.Lock()  # held by whoever builds or loads the module
        self._start_lock = threading.Lock()  # held while prepare() starts the background build
        self._background: threading.Thread | None = None
        self._started: float | None = None  # time.monotonic() when prepare() started the background build

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

    def prepare(self) -> None:
        """Start building (or loading) the extension on a background thread and return at once; :meth:`load` waits
        for it. Does nothing when it is loaded or started already, or cannot build here (:meth:`load` then says
        why). The thread is not a daemon: a process that exits meanwhile finishes the build, rather than leaving
        the next start to build it again."""
        # Not self._lock, which the build holds throughout: a second prepare() (the int4 quantizer's int8 output
        # projection's) would wait for the build it meant to leave running.
        with self._start_lock:
            if self._module is not None or self._background is not None or self.missing():
                return
            if self._built_library() is not None:
                # A dlopen: nothing to overlap, and no setuptools to import. A failure is load()'s to raise, where
                # its caller reports it, as for a background build.
                with contextlib.suppress(Exception):
                    self.load()
                return
            # Imported here, on the caller's thread: importing it imports setuptools, which inserts a finder into
            # sys.meta_path and removes it again, and an import running meanwhile on another thread (the caller
            # loading the model) can then step past the path finder: ModuleNotFoundError for a module that exists.
            _cpp_extension()
            self._background = threading.Thread(target=self._load_in_background, name=f"build {self.name}")
            self._started = time.monotonic()
            self._background.start()

    def load(self) -> ModuleType:
        """The compiled extension, built on first call; raises ``RuntimeError`` naming what is missing."""
        if self._module is not None:
            return self._module
        started = self._started or time.monotonic()  # the build's start, not this wait's
        while not self._lock.acquire(timeout=_WAIT_LOG_SECONDS):
            logger.info(
                "still building tokenmill's %s (%.0f s so far; first start only)",
                self.description, time.monotonic() - started,
            )  # fmt: skip
        try:
            if self._module is None:
                missing = self.missing()
                if missing:
                    raise RuntimeError(f"tokenmill's {self.description} need " + " and ".join(missing))
                module = self._build_or_load()
                apply_level_from_env(module)  # TOKENMILL_CPU_ISA, before any caller sees it
                self._module = module
        finally:
            self._lock.release()
        return self._module

    def _load_in_background(self) -> None:
        try:
            self.load()
        except Exception:  # the caller's own load() builds again and raises it where it can be reported
            logger.debug("background build of %s failed", self.name, exc_info=True)

    def supported_isas(self) -> list[str]:
        """The variants of the kernels this CPU can run, best last: the extension's ``supported_isas()``, which
        an extension with variants defines through its ``tokenmill::IsaChoice`` (``cpu_common/isa.h``)."""
        return list(self.load().supported_isas())

    def isa(self) -> str:
        """The variant the kernels run now: the best supported, unless :meth:`set_isa` said otherwise."""
        return str(self.load().isa())

    def set_isa(self, name: str) -> None:
        """Run variant ``name`` (one of :meth:`supported_isas`, or ``"auto"`` for the best) in this process from
        now on; ``ValueError`` names the supported ones."""
        self.load().set_isa(name)

    def build_directory(self, source: bytes, headers: Mapping[str, bytes] | None = None) -> Path:
        """Where the build of ``source`` (this extension's C++) and ``headers`` (by default those it
        includes, :func:`local_headers`) with this torch and Python lives."""
        if headers is None:
            headers = local_headers(source, self.include_root)
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or _default_build_root()
        toolchain = f"{_compiler()} ninja {_ninja_version()}"
        key = build_key(
            source,
            self._compile_flags(headers),
            [*_OPENMP_FLAGS],
            toolchain,
            torch.__version__,
            _python_abi(),
            headers=headers,
        )
        return Path(root) / f"{self.name}-{key}"

    def _compile_flags(self, headers: Mapping[str, bytes]) -> list[str]:
        variants = variant_flags(cpu_flags()) if _ISA_HEADER in headers else []
        return [*self.cflags, *variants, *_OPENMP_FLAGS]

    def _built_library(self) -> Path | None:
        """The library an earlier start built from this source, or None when it must be built (or a build of it
        is under way: torch's lock file is there)."""
        directory = self.build_directory(self.source.read_bytes())
        library = directory / f"{self.name}.so"
        return library if library.exists() and not (directory / "lock").exists() else None

    def _build_or_load(self) -> ModuleType:
        library = self._built_library()
        if library is not None:
            # The key covers everything the build read, so there is nothing for ninja to check: import it directly,
            # without torch's loader (setuptools, a compiler version check and a ninja run per extension).
            return _import_library(self.name, library)
        source = self.source.read_bytes()
        headers = local_headers(source, self.include_root)
        directory = self.build_directory(source, headers)
        with _build_lock(directory):
            library = self._built_library()  # built by the process this one waited for
            if library is not None:
                return _import_library(self.name, library)
            return self._build(directory, source, headers)

    def _build(self, directory: Path, source: bytes, headers: Mapping[str, bytes]) -> ModuleType:
        baton = directory / "lock"
        if baton.exists():
            # We hold the build lock, so no live process is building here: a build was killed and left torch's
            # lock file, on which torch's loader would wait forever.
            logger.warning(
                "removing %s, left by a build of tokenmill's %s that did not finish", baton, self.description
            )
            baton.unlink(missing_ok=True)
        # Compile copies kept beside the build: ninja's command then names no clone's own path.
        _write_if_changed(directory / self.source.name, source)
        include = directory / "include"
        for header, text in headers.items():
            _write_if_changed(include / header, text)
        is_built = (directory / f"{self.name}.so").exists()
        if not is_built:
            logger.info("building tokenmill's %s (first start only) in %s", self.description, directory)
        started = time.monotonic()
        module = _cpp_extension().load(
            name=self.name,
            sources=[str(directory / self.source.name)],
            extra_include_paths=[str(include)] if headers else None,
            extra_cflags=self._compile_flags(headers),
            extra_ldflags=[*_OPENMP_FLAGS],  # a list of its own: torch appends its libraries to it
            build_directory=str(directory),
            verbose=False,
        )
        if not is_built:
            logger.info("built tokenmill's %s in %.0f s", self.description, time.monotonic() - started)
        return module


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[None]:
    """Held while this process builds in ``directory``: an exclusive ``flock`` beside torch's lock file. The kernel
    drops it when its holder dies, so unlike torch's lock file it cannot outlive a killed build."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / _BUILD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building this extension: wait for it
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_key(
    source: bytes,
    cflags: list[str],
    ldflags: list[str],
    toolchain: str,
    torch_version: str,
    python_abi: str,
    headers: Mapping[str, bytes] | None = None,
) -> str:
    """A short hash of everything a build depends on: the source's bytes, the flags, the toolchain (the
    compiler's name and ninja's version), the torch version, the Python ABI (``cpython-311-x86_64-linux-gnu``)
    and the headers the source includes (their paths as included, and bytes; none leaves the key as it was).

    Ninja is in it because versions record commands differently: a build directory shared by two
    ninjas (a venv's and the system's) was rebuilt by each after the other."""
    digest = hashlib.sha256(source)
    for part in (" ".join(cflags), " ".join(ldflags), toolchain, torch_version, python_abi):
        digest.update(b"\0" + str(part).encode())
    for name, text in sorted((headers or {}).items()):
        digest.update(b"\0%s\0%d\0" % (name.encode(), len(text)) + text)
    return digest.hexdigest()[:16]


def local_headers(source: bytes, root: Path = INCLUDE_ROOT) -> dict[str, bytes]:
    """The headers ``source`` includes with quotes (``#include "cpu_common/isa.h"``) that are files under ``root``,
    and those these include in the same way, each by its path as included: ``{"cpu_common/isa.h": bytes}``.

    Paths are taken from ``root``, not from the including file's folder; other includes (``<torch/extension.h>``,
    a name not under ``root``, an absolute one, one with ``..``) are left to the compiler's own search."""
    headers: dict[str, bytes] = {}
    pending = [source]
    while pending:
        for match in _QUOTED_INCLUDE.finditer(pending.pop()):
            name = match.group(1).decode(errors="replace")
            path = root / name
            if name in headers or Path(name).is_absolute() or ".." in Path(name).parts or not path.is_file():
                continue
            headers[name] = path.read_bytes()
            pending.append(headers[name])
    return headers


def variant_flags(flags: frozenset[str] | None) -> list[str]:
    """The ``-DTOKENMILL_BUILD_<SET>=0`` flags that leave out of a build the variants a CPU with these
    :func:`cpu_flags` cannot run; none where the flags are unknown (every variant is compiled, and the run-time
    checks choose)."""
    if flags is None:
        return []
    return [f"-DTOKENMILL_BUILD_{name}=0" for name, needs in _VARIANT_SETS.items() if not flags.issuperset(needs)]


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


def _write_if_changed(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` unless it is there already, whole: a process reading it meanwhile sees the old
    file or the new one."""
    if path.exists() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(data)
    partial.replace(path)


def _python_abi() -> str:
    # The interpreter's own extension suffix (".cpython-311-x86_64-linux-gnu.so"), not sysconfig's SOABI: on
    # Python 3.11 sysconfig fills its variables on first use without a lock, so the background builds, racing
    # there, read None now and then, and a warm start built everything again under another key.
    return importlib.machinery.EXTENSION_SUFFIXES[0].removeprefix(".").removesuffix(".so")


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


def _default_build_root() -> str:
    # torch's own default (cpp_extension.get_default_build_root), without importing cpp_extension.
    import torch._appdirs

    return os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {name} from {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpp_extension() -> ModuleType:
    # Imported on demand: it pulls in setuptools, which the rest of tokenmill does not need.
    import torch.utils.cpp_extension

    return torch.utils.cpp_extension
