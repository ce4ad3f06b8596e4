"""What ``CppExtension`` checks before it builds: the CPU features the kernels need."""

from __future__ import annotations

from pathlib import Path

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
