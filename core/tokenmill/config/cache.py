"""The paged KV cache: block geometry, memory budget, prefix caching."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from tokenmill.config.base import ConfigSection, PositiveInt, describe

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}  # fmt: skip


def parse_memory(text: str) -> tuple[int | None, float | None]:
    """``"2GiB"`` -> (bytes, None); ``"0.3"`` -> (None, fraction). Raises ValueError otherwise."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"expected a size like '2GiB' or '512MiB', or a fraction like '0.3', got {text!r}")
    number, unit = float(match[1]), match[2]
    if unit is None:
        if not 0 < number <= 1:
            raise ValueError(f"a fraction must be in (0, 1], got {text!r}; add a unit (e.g. 'GiB') for a size")
        return None, number
    return int(number * _UNITS[unit.lower()]), None


class KVTierConfig(ConfigSection, frozen=True):
    """One KV tier below the device cache: a ``[[kv_tiers]]`` table, or ``--kv-tier NAME:CAPACITY[:PATH]``."""

    name: Annotated[str, describe("The KV tier plugin: 'cpu', 'disk', or one a plugin registers.")]
    capacity: Annotated[str, describe("Bytes the tier may hold, as a size: '4GiB', '512MiB'.")]
    path: Annotated[
        str | None,
        describe("Where the tier keeps its blocks, for tiers that take one ('disk': a directory)."),
    ] = None
    write: Annotated[
        Literal["eviction", "completion", "none"] | None,
        describe(
            "When blocks are written to the tier: 'eviction' (blocks the level above evicts) or 'completion' "
            "(every full block of a request when it leaves the engine), or 'none' (only read: a KV connector's "
            "receiving end). Unset: the tier's default ('cpu': eviction, 'disk': completion)."
        ),
    ] = None

    def __post_init__(self) -> None:
        what = f"kv_tiers entry {self.name!r}: capacity"
        capacity_bytes, _ = _size(self.capacity, what)
        if capacity_bytes is None:
            raise ValueError(f"{what} must be a size such as '4GiB', not a fraction (got {self.capacity!r})")

    @property
    def capacity_bytes(self) -> int:
        capacity_bytes, _ = parse_memory(self.capacity)
        assert capacity_bytes is not None  # checked in __post_init__
        return capacity_bytes


def _size(text: str, what: str) -> tuple[int | None, float | None]:
    try:
        return parse_memory(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None


def kv_tier_entry(entry: str) -> dict[str, str]:
    """``"disk:20GiB:/var/cache/kv"`` (the ``--kv-tier`` form) -> the ``[[kv_tiers]]`` table it stands for.
    Raises ValueError naming the entry when it is not ``NAME:CAPACITY[:PATH]``."""
    name, _, rest = entry.partition(":")
    capacity, _, path = rest.partition(":")
    if not name or not capacity:
        raise ValueError(f"kv_tiers entry {entry!r} must be 'NAME:CAPACITY[:PATH]', such as 'cpu:4GiB'")
    return {"name": name, "capacity": capacity, **({"path": path} if path else {})}


class CacheConfig(ConfigSection, frozen=True):
    block_size: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=256)],
        describe("Tokens per KV cache block: a power of two from 1 to 256."),
    ] = 16
    kv_cache_memory: Annotated[
        str,
        describe(
            "Memory for the KV cache: a size ('2GiB', '512MiB') or a fraction of the memory free after the "
            "model is loaded ('0.3'). 'auto' is 0.9 of free GPU memory, or on CPU a quarter of available RAM "
            "capped at 4GiB."
        ),
    ] = "auto"
    num_kv_blocks: Annotated[
        PositiveInt | None,
        describe("Exact number of KV blocks, overriding kv_cache_memory (tests, reproducible benchmarks)."),
    ] = None
    kv_cache_dtype: Annotated[
        Literal["auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "int8"],
        describe(
            "What the KV cache stores. 'auto' is the model's dtype, except float16 for a float32 model with "
            "quantized weights (such as the default GGUF model) when the attention backend supports it: half the "
            "memory per token and half the reads per decode step. 'fp8' (= 'fp8_e4m3', float8 e4m3) and 'int8' "
            "store one byte per value plus a float32 scale per token and KV head (docs/kv_cache.md): about half of "
            "float16's bytes, so about 1.9x the cached tokens in the same memory; the 'cpu', 'torch' and 'triton' "
            "backends store them. Attention still computes in the model's dtype."
        ),
    ] = "auto"
    enable_prefix_caching: Annotated[
        bool,
        describe("Reuse the KV blocks of identical prompt prefixes across requests."),
    ] = True
    kv_cache_manager: Annotated[
        str,
        describe("KV cache manager plugin by name: blocks, block tables and the prefix cache ('paged' is built in)."),
    ] = "paged"

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        if self.kv_cache_memory != "auto":
            try:
                parse_memory(self.kv_cache_memory)
            except ValueError as exc:
                raise ValueError(f"kv_cache_memory: {exc}") from None
