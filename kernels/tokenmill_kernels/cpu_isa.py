"""The instruction-set levels of the CPU kernels' variants, and ``TOKENMILL_CPU_ISA``, which caps them per process.

The extensions with variants (``quant_matmul``, ``paged_attention``, ``dense_matmul``; see ``cpu_common/isa.h``)
name them after what they need: ``avx2``, ``avx_vnni``, ``avx512``, ``avx512_vnni16``, ``amx`` (AVX-512 with VNNI and
AMX's int8 tiles, the int4 matmul's at many rows). A *level* is one of those
names, and stands for a CPU that has it and nothing above it: at level L each extension runs the best variant it
has at or below L (:func:`variant_for_level`). ``avx_vnni`` (VNNI on 256-bit vectors) is below ``avx512``, as on
CPUs that have AVX-VNNI and no AVX-512 (Alder Lake, Arrow Lake); ``avx512_vnni16`` is AVX-512 with VNNI. So at
``avx_vnni`` the int4 matmul runs ``avx_vnni`` and attention and the dense matmul run ``avx2``; at ``avx512`` the
int4 matmul and the others run ``avx512``.

``TOKENMILL_CPU_ISA=LEVEL`` in a process's environment applies a level to every extension as it loads
(:func:`apply_level_from_env`, called by ``cpp_build.CppExtension.load``): a server's engine processes inherit it,
which is how ``tokenmill bench isa`` runs a server at each level. Unset or ``auto`` leaves the best variant. The
kernels import nothing of tokenmill's, so they read it here; ``tokenmill.envs`` lists it with the others.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

__all__ = ["ISA_LEVELS", "ISA_LEVEL_ENV", "apply_level_from_env", "variant_for_level"]

#: The levels, lowest first. A variant whose name is not here runs at no level, only as the best (``auto``).
ISA_LEVELS = ("avx2", "avx_vnni", "avx512", "avx512_vnni16", "amx")
ISA_LEVEL_ENV = "TOKENMILL_CPU_ISA"


def variant_for_level(supported: Sequence[str], level: str) -> str:
    """The variant of ``supported`` (an extension's ``supported_isas()``, ``"avx2"`` first) that runs at ``level``:
    the highest one at or below it, else the first. ``ValueError`` for a level not in :data:`ISA_LEVELS`."""
    if level not in ISA_LEVELS:
        raise ValueError(f"{ISA_LEVEL_ENV}={level!r} is invalid: expected auto or one of {', '.join(ISA_LEVELS)}")
    allowed = ISA_LEVELS[: ISA_LEVELS.index(level) + 1]
    known = [name for name in supported if name in allowed]
    return max(known, key=ISA_LEVELS.index) if known else supported[0]


def apply_level_from_env(module: ModuleType) -> None:
    """Run ``module``'s (a loaded extension's) variant for the level ``TOKENMILL_CPU_ISA`` names, if it has variants
    and the variable is set to something other than ``auto``. ``ValueError`` for an unknown level."""
    level = os.environ.get(ISA_LEVEL_ENV, "").strip().lower()
    if level in ("", "auto") or not hasattr(module, "set_isa"):
        return
    module.set_isa(variant_for_level(list(module.supported_isas()), level))
