"""Whether this machine can build and run the CPU kernels, read from the machine, not from the kernels.

The CPU kernel tests skip only where this says the machine lacks something. Where it has an AVX2 CPU (with FMA
and F16C), a C++ compiler and ninja, they run: a kernel package that wrongly reports itself unavailable fails
them instead of skipping them unseen. ``tests/conftest.py`` also fails the run when any test skipped for want of
the kernels (its reason says it needs AVX2, or names a compiler or a toolchain) on such a machine.
"""

from __future__ import annotations

import os
import shutil

import pytest
from tokenmill_kernels.cpp_build import cpu_flags


def cpu_kernels_missing() -> str | None:
    """What the machine lacks for the CPU kernels, in words; None when it has everything."""
    flags = cpu_flags()
    if flags is None:
        return "/proc/cpuinfo is unreadable"
    lacking = [flag for flag in ("avx2", "fma", "f16c") if flag not in flags]
    if lacking:
        return f"the CPU lacks {', '.join(lacking)}"
    for tool in (os.environ.get("CXX", "c++"), "ninja"):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH"
    return None


_MISSING = cpu_kernels_missing()
needs_cpu_kernels = pytest.mark.skipif(_MISSING is not None, reason=f"the CPU kernels need what is missing: {_MISSING}")
