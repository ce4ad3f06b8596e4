"""Environment variables tokenmill reads. No other module reads ``os.environ``.

Each variable is declared once here with its type, default and meaning;
``tokenmill config show`` and the docs list them from this table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    description: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {exc}") from None


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _parse_list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


TOKENMILL_CACHE_DIR: EnvVar[Path] = EnvVar(
    "TOKENMILL_CACHE_DIR",
    Path,
    Path("~/.cache/tokenmill"),
    "Where `tokenmill pull` stores downloaded models.",
)
TOKENMILL_WEIGHT_CACHE: EnvVar[bool] = EnvVar(
    "TOKENMILL_WEIGHT_CACHE",
    _parse_bool,
    True,
    "When true, a quantized model's repacked weights are cached after the first load, so later starts skip "
    "the repacking; set 0 to always load from the checkpoint.",
)
TOKENMILL_WEIGHT_CACHE_DIR: EnvVar[Path | None] = EnvVar(
    "TOKENMILL_WEIGHT_CACHE_DIR",
    Path,
    None,
    "Where the weight cache lives; unset is the `weights` folder of TOKENMILL_CACHE_DIR. Safe to delete.",
)
TOKENMILL_PLUGINS: EnvVar[tuple[str, ...] | None] = EnvVar(
    "TOKENMILL_PLUGINS",
    _parse_list,
    None,
    "Comma-separated allowlist of entry-point plugins to load; others are skipped.",
)
TOKENMILL_DISABLE_PLUGIN_AUTOLOAD: EnvVar[bool] = EnvVar(
    "TOKENMILL_DISABLE_PLUGIN_AUTOLOAD",
    _parse_bool,
    False,
    "When true, no entry-point plugin is loaded (built-in plugins still are).",
)
TOKENMILL_LOG_LEVEL: EnvVar[str] = EnvVar(
    "TOKENMILL_LOG_LEVEL", str.upper, "INFO", "Log level of the `tokenmill` command."
)


def _parse_dense_cpu_matmul(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("kernels", "onednn", "torch"):
        raise ValueError("expected kernels, onednn or torch")
    return value


TOKENMILL_DENSE_CPU_MATMUL: EnvVar[str] = EnvVar(
    "TOKENMILL_DENSE_CPU_MATMUL",
    _parse_dense_cpu_matmul,
    "kernels",
    "How dense float32 linear layers multiply on the CPU: `kernels` (the layer kernels' own dense matmul: the "
    "`cpu` kernels read a weight packed in panels once for up to 12 rows; layer kernels without one leave it to "
    "oneDNN), `onednn` (weights packed for oneDNN) or `torch` (`F.linear`, MKL: 2-3x slower on AMD CPUs).",
)
TOKENMILL_CPU_ISA: EnvVar[str] = EnvVar(
    "TOKENMILL_CPU_ISA",
    str.lower,
    "auto",
    "Caps the instruction set of the CPU kernels that come in variants (the int4/int8 and dense float32 matmuls, "
    "paged attention), for the process and the engines it starts: `avx2`, `avx_vnni`, `avx512`, `avx512_vnni16` or "
    "`amx` runs each kernel's best variant at or below that level, as on a CPU that has nothing above it (`avx_vnni` "
    "is below `avx512`); `auto` the best the CPU has. Read by the kernels as they load "
    "(`tokenmill_kernels.cpu_isa`); `tokenmill bench isa` compares the levels.",
)
RAY_ADDRESS: EnvVar[str | None] = EnvVar(
    "RAY_ADDRESS",
    str,
    None,
    "Ray's own variable: with `--backend ray` and no `--ray-address`, the Ray cluster to place engines on.",
)

ALL_ENV_VARS: tuple[EnvVar, ...] = (
    TOKENMILL_CACHE_DIR,
    TOKENMILL_WEIGHT_CACHE,
    TOKENMILL_WEIGHT_CACHE_DIR,
    TOKENMILL_PLUGINS,
    TOKENMILL_DISABLE_PLUGIN_AUTOLOAD,
    TOKENMILL_LOG_LEVEL,
    TOKENMILL_DENSE_CPU_MATMUL,
    TOKENMILL_CPU_ISA,
    RAY_ADDRESS,
)
