"""What ``CppExtension`` checks before it builds (the CPU features the kernels need), where it
builds, and what it logs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from tokenmill_kernels import cpp_build
from tokenmill_kernels.cpp_build import CppExtension, cpu_flags


def test_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma f16c\n\nprocessor\t: 1\n")
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "avx2", "fma", "f16c"}
    assert cpu_flags(tmp_path / "absent") is None
    cpuinfo.write_text("processor\t: 0\n")  # no flags line (not x86): unknown, not "none"
    assert cpu_flags(cpuinfo) is None


def test_a_cpu_without_f16c_is_reported_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    extension = CppExtension("tokenmill_never_built", Path("unused.cpp"), [], "test kernels")
    monkeypatch.setattr(cpp_build.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert any("F16C" in reason for reason in extension.missing())
    assert not extension.is_available()
    with pytest.raises(RuntimeError, match="tokenmill's test kernels need .*F16C"):
        extension.load()
    monkeypatch.setattr(cpp_build, "cpu_flags", lambda: None)  # flags unreadable: trust torch's AVX2 report
    assert not any("F16C" in reason for reason in extension.missing())


def test_build_key_changes_with_every_input_and_nothing_else() -> None:
    inputs = (b"int main() {}", ["-O3", "-fopenmp"], ["-fopenmp"], "c++", "2.13.0+cpu", "cpython-311-x86_64-linux-gnu")
    key = cpp_build.build_key(*inputs)
    assert key == cpp_build.build_key(*inputs)  # deterministic: the next process finds the same build
    assert len(key) == 16
    changed = [
        (b"int main() { return 1; }", *inputs[1:]),
        (inputs[0], ["-O2", "-fopenmp"], *inputs[2:]),
        (*inputs[:2], [], *inputs[3:]),
        (*inputs[:3], "clang++", *inputs[4:]),
        (*inputs[:4], "2.14.0+cpu", inputs[5]),
        (*inputs[:5], "cpython-312-x86_64-linux-gnu"),
    ]
    keys = {cpp_build.build_key(*other) for other in changed}
    assert key not in keys and len(keys) == len(changed)
    # Flags are joined with spaces, parts separated by NUL: moving a flag between lists still counts.
    assert cpp_build.build_key(inputs[0], ["-O3"], ["-fopenmp"], *inputs[3:]) != cpp_build.build_key(
        inputs[0], ["-O3", "-fopenmp"], [], *inputs[3:]
    )


def test_build_key_covers_the_included_headers() -> None:
    inputs = (b'#include "cpu_common/isa.h"', ["-O3"], ["-fopenmp"], "c++ ninja 1.11.1", "2.13.0+cpu", "cpython-311")
    header = {"cpu_common/isa.h": b"#pragma once\n"}
    key = cpp_build.build_key(*inputs, headers=header)
    assert key != cpp_build.build_key(*inputs)
    assert cpp_build.build_key(*inputs, headers={}) == cpp_build.build_key(*inputs)  # no headers: the key as before
    edited = {"cpu_common/isa.h": b"#pragma once\n// edited\n"}
    moved = {"cpu_common/isa2.h": b"#pragma once\n"}
    keys = {cpp_build.build_key(*inputs, headers=other) for other in (edited, moved)}
    assert key not in keys and len(keys) == 2
    # Each header's length is hashed with it: bytes moved from one header to the next still count.
    one_way, other_way = {"a.h": b"12", "b.h": b"3"}, {"a.h": b"1", "b.h": b"23"}
    assert cpp_build.build_key(*inputs, headers=one_way) != cpp_build.build_key(*inputs, headers=other_way)


def test_local_headers_follows_quoted_includes_under_the_root(tmp_path: Path) -> None:
    (tmp_path / "cpu_common").mkdir()
    (tmp_path / "cpu_common" / "isa.h").write_text('#pragma once\n#include "cpu_common/util.h"\n#include <atomic>\n')
    (tmp_path / "cpu_common" / "util.h").write_text('#pragma once\n  #  include "cpu_common/isa.h"\n')
    (tmp_path / "outside.h").write_text("// not under the root's cpu_common, but under the root\n")
    source = b'#include <torch/extension.h>\n#include "cpu_common/isa.h"\n#include "missing.h"\n#include "../x.h"\n'
    source += f'#include "{tmp_path / "outside.h"}"\n'.encode()  # absolute: the compiler finds it, not a copy
    headers = cpp_build.local_headers(source, tmp_path)
    assert headers == {
        "cpu_common/isa.h": (tmp_path / "cpu_common" / "isa.h").read_bytes(),
        "cpu_common/util.h": (tmp_path / "cpu_common" / "util.h").read_bytes(),
    }
    assert cpp_build.local_headers(b'// #include "outside.h" in a comment\n', tmp_path) == {}


def test_an_edited_header_gets_its_own_build_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    (tmp_path / "cpu_common").mkdir()
    header = tmp_path / "cpu_common" / "isa.h"
    header.write_text("#pragma once\n")
    source = tmp_path / "kernel.cpp"
    source.write_text('#include "cpu_common/isa.h"\n')
    extension = CppExtension("tokenmill_test", source, ["-O3"], "test kernels", include_root=tmp_path)
    directory = extension.build_directory(source.read_bytes())
    header.write_text("#pragma once\n// edited\n")
    assert extension.build_directory(source.read_bytes()) != directory


def test_two_clones_share_one_build_directory_and_an_edit_gets_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    sources = []
    for clone in ("a", "b"):
        source = tmp_path / clone / "kernel.cpp"
        source.parent.mkdir()
        source.write_text("// the same kernel\n")
        sources.append(source)
    first, second = (CppExtension("tokenmill_test", source, ["-O3"], "test kernels") for source in sources)
    directory = first.build_directory(sources[0].read_bytes())
    assert directory == second.build_directory(sources[1].read_bytes())  # keyed by bytes, not by path
    assert directory.parent == tmp_path / "cache" and directory.name.startswith("tokenmill_test-")
    sources[1].write_text("// an edited kernel\n")
    assert second.build_directory(sources[1].read_bytes()) != directory
    flagged = CppExtension("tokenmill_test", sources[0], ["-O2"], "test kernels")
    assert flagged.build_directory(sources[0].read_bytes()) != directory


def test_the_build_directory_does_not_depend_on_sysconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.11's ``sysconfig`` fills its variables on first use without a lock: the background builds of a
    start, reading it at once, got ``None`` for SOABI now and then and built again under another key. The key
    reads the interpreter's extension suffix instead, so a half-filled ``sysconfig`` changes nothing."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cpp"
    source.write_text("// a kernel\n")
    extension = CppExtension("tokenmill_test", source, ["-O3"], "test kernels")
    directory = extension.build_directory(source.read_bytes())
    assert cpp_build._python_abi() == sysconfig.get_config_var("SOABI")  # the same key as before: builds kept
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: None)  # what a racing thread saw
    assert extension.build_directory(source.read_bytes()) == directory


def test_the_default_build_root_is_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``TORCH_EXTENSIONS_DIR`` the builds go where torch's own would, found without importing
    ``torch.utils.cpp_extension`` (and setuptools), in a process that has not imported them."""
    code = (
        "import sys; from tokenmill_kernels import cpp_build; root = cpp_build._default_build_root(); "
        "assert 'torch.utils.cpp_extension' not in sys.modules; print(root)"
    )
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == cpp_build._cpp_extension().get_default_build_root()


def test_a_build_logs_its_start_and_end_and_a_cached_load_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The message comes before torch's build, and not when the built library is already there;
    torch's ``load`` is replaced, so no compiler runs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    source = tmp_path / "kernel.cpp"
    source.write_text("// a kernel\n")
    calls = []

    def fake_load(
        name: str, sources: list[str], build_directory: str, extra_ldflags: list[str], **_: object
    ) -> ModuleType:
        calls.append((name, sources, build_directory))
        extra_ldflags.append("-ltorch")  # as torch does to the list it is given
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return ModuleType(name)

    monkeypatch.setattr(cpp_build._cpp_extension(), "load", fake_load)
    monkeypatch.setattr(CppExtension, "missing", lambda self: [])
    caplog.set_level(logging.DEBUG, logger=cpp_build.__name__)

    CppExtension("tokenmill_test", source, ["-O3"], "test kernels").load()
    (name, compiled, build_directory), *_ = calls
    assert compiled == [str(Path(build_directory) / "kernel.cpp")]  # the copy, not this clone's file
    assert (Path(build_directory) / "kernel.cpp").read_text() == "// a kernel\n"
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 2 and infos[0].startswith("building tokenmill's test kernels (first start only) in ")
    assert infos[1].startswith("built tokenmill's test kernels in ")  # the time it took, not an estimate

    caplog.clear()
    imported = []
    monkeypatch.setattr(
        cpp_build, "_import_library", lambda name, library: imported.append(library) or ModuleType(name)
    )
    CppExtension("tokenmill_test", source, ["-O3"], "test kernels").load()  # a new process: built already
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    # The library imported as it is, without torch's loader (and its ninja run); the first load changed nothing the
    # key depends on.
    assert len(calls) == 1 and imported == [Path(build_directory) / "tokenmill_test.so"]
    # torch's lock file, left by a killed build: not a library to import; the next build removes it, or torch's
    # loader would wait on it forever.
    (Path(build_directory) / "lock").write_text("")
    CppExtension("tokenmill_test", source, ["-O3"], "test kernels").load()
    assert len(calls) == 2 and len(imported) == 1
    assert not (Path(build_directory) / "lock").exists()
    assert any(r.levelno == logging.WARNING and "did not finish" in r.getMessage() for r in caplog.records)


def test_a_live_build_in_another_process_is_waited_for_and_its_lock_file_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the build lock is building: ``load`` waits for it, leaves torch's lock file alone
    meanwhile, and imports what it built without building again."""
    calls: list[str] = []

    def fake_load(name: str, build_directory: str, **_: object) -> ModuleType:
        calls.append(name)
        return ModuleType(name)

    extension = _extension_built_by(fake_load, tmp_path, monkeypatch)
    directory = extension.build_directory(extension.source.read_bytes())
    directory.mkdir(parents=True)
    imported = []
    monkeypatch.setattr(
        cpp_build, "_import_library", lambda name, library: imported.append(library) or ModuleType(name)
    )
    # The other process: a child holding the flock while its torch lock file stands.
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_BUILD_LOCK, str(directory), cpp_build._BUILD_LOCK],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        loader = threading.Thread(target=extension.load)
        loader.start()
        time.sleep(0.5)
        assert loader.is_alive() and (directory / "lock").exists() and not calls
        (directory / "tokenmill_test.so").write_bytes(b"")  # the other build's result
        (directory / "lock").unlink()
        assert holder.stdin is not None
        holder.stdin.close()  # the child exits, and the kernel drops its flock
        loader.join(timeout=10)
        assert not loader.is_alive()
    finally:
        holder.kill()
        holder.wait()
    assert not calls and imported == [directory / "tokenmill_test.so"]


_HOLD_BUILD_LOCK = """
import fcntl, pathlib, sys
directory = pathlib.Path(sys.argv[1])
lock = open(directory / sys.argv[2], "a")
fcntl.flock(lock, fcntl.LOCK_EX)
(directory / "lock").write_text("")
print("locked", flush=True)
sys.stdin.read()
"""


def test_prepared_extensions_build_side_by_side_and_load_waits_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``prepare`` returns at once; two prepared builds run at the same time (each waits for the other to start
    before it finishes); ``load`` waits for its own, logs while it waits, and builds nothing twice."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_build, "_WAIT_LOG_SECONDS", 0.05)
    both_started = threading.Barrier(2, timeout=10)
    calls = []

    def fake_load(name: str, build_directory: str, **_: object) -> ModuleType:
        calls.append(name)
        both_started.wait()  # raises BrokenBarrierError if the builds ran one after the other
        time.sleep(0.2)
        return ModuleType(name)

    monkeypatch.setattr(cpp_build._cpp_extension(), "load", fake_load)
    monkeypatch.setattr(CppExtension, "missing", lambda self: [])
    caplog.set_level(logging.INFO, logger=cpp_build.__name__)
    extensions = []
    for name in ("tokenmill_a", "tokenmill_b"):
        (tmp_path / f"{name}.cpp").write_text(f"// {name}\n")
        extensions.append(CppExtension(name, tmp_path / f"{name}.cpp", ["-O3"], f"{name} kernels"))
    started = time.monotonic()
    for extension in extensions:
        extension.prepare()
        extension.prepare()  # once is enough
    assert time.monotonic() - started < 0.15
    assert [extension.load().__name__ for extension in extensions] == ["tokenmill_a", "tokenmill_b"]
    assert sorted(calls) == ["tokenmill_a", "tokenmill_b"]
    assert any(r.getMessage().startswith("still building tokenmill's tokenmill_a kernels") for r in caplog.records)


def test_the_wait_message_counts_from_the_builds_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A build prepared 0.3 s before ``load`` waits for it has run 0.3 s by the first message, not 0.05 s."""
    monkeypatch.setattr(cpp_build, "_WAIT_LOG_SECONDS", 0.05)
    extension = _extension_built_by(lambda name, **_: time.sleep(0.6) or ModuleType(name), tmp_path, monkeypatch)
    caplog.set_level(logging.INFO, logger=cpp_build.__name__)
    extension.prepare()
    time.sleep(0.3)
    extension.load()
    waited = [r.args[1] for r in caplog.records if r.getMessage().startswith("still building")]
    assert waited and waited[0] >= 0.3


def _extension_built_by(
    fake_load: Callable[..., ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> CppExtension:
    """An extension of one source whose builds call ``fake_load`` in place of torch's, on a machine lacking nothing."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_build._cpp_extension(), "load", fake_load)
    monkeypatch.setattr(CppExtension, "missing", lambda self: [])
    (tmp_path / "kernel.cpp").write_text("// a kernel\n")
    return CppExtension("tokenmill_test", tmp_path / "kernel.cpp", ["-O3"], "test kernels")


def test_prepare_during_the_build_returns_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build holds the extension's lock until it ends: a second prepare() (the int4 quantizer's int8 output
    projection prepares the same extension) must not wait for it."""
    building, release = threading.Event(), threading.Event()

    def fake_load(name: str, **_: object) -> ModuleType:
        building.set()
        release.wait(10)
        return ModuleType(name)

    extension = _extension_built_by(fake_load, tmp_path, monkeypatch)
    extension.prepare()
    assert building.wait(10)
    started = time.monotonic()
    extension.prepare()
    waited = time.monotonic() - started
    release.set()
    assert waited < 1.0
    assert extension.load().__name__ == "tokenmill_test"


def test_a_build_that_fails_in_the_background_is_raised_by_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts = []
    tried_in_background = threading.Event()

    def fake_load(**_: object) -> ModuleType:
        attempts.append(1)
        tried_in_background.set()
        raise RuntimeError("Error building extension 'tokenmill_test'")

    extension = _extension_built_by(fake_load, tmp_path, monkeypatch)
    extension.prepare()
    assert tried_in_background.wait(10)
    with pytest.raises(RuntimeError, match="Error building extension"):
        extension.load()
    assert len(attempts) == 2  # the background try, then the caller's own


def test_a_build_compiles_copies_of_its_headers_on_an_include_path_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's ``load`` is replaced: what it is given names only the build directory, which holds the copies."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    (tmp_path / "cpu_common").mkdir()
    (tmp_path / "cpu_common" / "isa.h").write_text("// the shared header\n")
    source = tmp_path / "kernel.cpp"
    source.write_text('#include "cpu_common/isa.h"\n')
    calls = []

    def fake_load(name: str, build_directory: str, extra_include_paths: list[str] | None, **_: object) -> ModuleType:
        calls.append((build_directory, extra_include_paths))
        return ModuleType(name)

    monkeypatch.setattr(cpp_build._cpp_extension(), "load", fake_load)
    monkeypatch.setattr(CppExtension, "missing", lambda self: [])
    CppExtension("tokenmill_test", source, ["-O3"], "test kernels", include_root=tmp_path).load()
    [(build_directory, include_paths)] = calls
    assert include_paths == [str(Path(build_directory) / "include")]
    assert (Path(build_directory) / "include" / "cpu_common" / "isa.h").read_text() == "// the shared header\n"

    plain = tmp_path / "plain.cpp"
    plain.write_text("// includes nothing of ours\n")
    CppExtension("tokenmill_plain", plain, [], "test kernels", include_root=tmp_path).load()
    assert calls[1][1] is None and not (Path(calls[1][0]) / "include").exists()


ZEN3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})  # AVX2 only
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}  # no AVX-VNNI, no AMX
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


def test_variant_flags_leave_out_what_the_cpu_lacks() -> None:
    off = "-DTOKENMILL_BUILD_{}=0".format
    assert cpp_build.variant_flags(ZEN3) == [off("AVX_VNNI"), off("AVX512"), off("AVX512_VNNI"), off("AMX")]
    assert cpp_build.variant_flags(ZEN4) == [off("AVX_VNNI"), off("AMX")]
    assert cpp_build.variant_flags(ZEN4 - {"avx512dq"}) == [off("AVX_VNNI"), off("AVX512"), off("AMX")]
    assert cpp_build.variant_flags(SAPPHIRE_RAPIDS) == []
    assert cpp_build.variant_flags(None) == []  # unknown: every variant, and the run-time checks choose


def test_an_extension_with_variants_builds_those_the_cpu_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source that includes ``cpu_common/isa.h`` is compiled with the CPU's ``variant_flags``, in a directory of
    their own; one that does not is compiled as it was."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    (tmp_path / "cpu_common").mkdir()
    (tmp_path / "cpu_common" / "isa.h").write_text("#pragma once\n")
    (tmp_path / "variants.cpp").write_text('#include "cpu_common/isa.h"\n')
    (tmp_path / "plain.cpp").write_text("// no variants\n")
    calls = {}

    def fake_load(name: str, build_directory: str, extra_cflags: list[str], **_: object) -> ModuleType:
        calls[name] = (build_directory, extra_cflags)
        return ModuleType(name)

    monkeypatch.setattr(cpp_build._cpp_extension(), "load", fake_load)
    monkeypatch.setattr(CppExtension, "missing", lambda self: [])
    directories = {}
    for cpu in (ZEN3, SAPPHIRE_RAPIDS):
        monkeypatch.setattr(cpp_build, "cpu_flags", lambda cpu=cpu: cpu)
        for name in ("variants", "plain"):
            extension = CppExtension(name, tmp_path / f"{name}.cpp", ["-O3"], "test kernels", include_root=tmp_path)
            extension.load()
            directories[cpu, name] = calls[name][0]
            flags = calls[name][1]
            assert flags[0] == "-O3" and flags[-1] == "-fopenmp"
            expected = cpp_build.variant_flags(cpu) if name == "variants" else []
            assert flags[1:-1] == expected
            assert extension.build_directory((tmp_path / f"{name}.cpp").read_bytes()) == Path(calls[name][0])
    assert directories[ZEN3, "variants"] != directories[SAPPHIRE_RAPIDS, "variants"]
    assert directories[ZEN3, "plain"] == directories[SAPPHIRE_RAPIDS, "plain"]


def test_the_isa_calls_go_to_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """``supported_isas``, ``isa`` and ``set_isa`` are the compiled module's (``tokenmill::IsaChoice::def``), with
    their results as Python lists and strings; the module's ``ValueError`` reaches the caller."""
    chosen = ["avx512"]

    def set_isa(name: str) -> None:
        if name not in ("auto", "avx2", "avx512"):
            raise ValueError(f'isa must be "auto" or one this CPU supports (avx2, avx512), got "{name}"')
        chosen[0] = "avx512" if name == "auto" else name

    module = ModuleType("tokenmill_fake")
    module.supported_isas = lambda: ("avx2", "avx512")  # type: ignore[attr-defined]
    module.isa = lambda: chosen[0]  # type: ignore[attr-defined]
    module.set_isa = set_isa  # type: ignore[attr-defined]
    extension = CppExtension("tokenmill_fake", Path("unused.cpp"), [], "test kernels")
    monkeypatch.setattr(extension, "_module", module)
    assert extension.supported_isas() == ["avx2", "avx512"]
    extension.set_isa("avx2")
    assert extension.isa() == "avx2"
    with pytest.raises(ValueError, match='got "sse2"'):
        extension.set_isa("sse2")
    assert extension.isa() == "avx2"


def test_prepare_imports_setuptools_before_its_thread_starts(tmp_path: Path) -> None:
    # In a fresh interpreter: the background thread must not be the one importing setuptools (it inserts and
    # removes a sys.meta_path finder, and a concurrent import on the main thread can miss the path finder).
    (tmp_path / "unused.cpp").write_text("// never built\n")
    code = """
import sys, threading
from pathlib import Path
from tokenmill_kernels import cpp_build
seen = []
start = threading.Thread.start
def recording_start(self):
    seen.append("setuptools" in sys.modules)
    start(self)
threading.Thread.start = recording_start
cpp_build.CppExtension.missing = lambda self: []
cpp_build.CppExtension._load_in_background = lambda self: None
cpp_build.CppExtension("tokenmill_never_built", Path("unused.cpp"), [], "test kernels").prepare()
print(seen)
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                            env=env)  # fmt: skip
    assert result.stdout.strip() == "[True]", result.stdout + result.stderr
