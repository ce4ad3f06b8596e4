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


def kv_tier_spec(entry: str) -> tuple[str, int]:
    """``"cpu:4GiB"`` -> ("cpu", bytes). Raises ValueError naming the entry otherwise."""
    name, _, capacity = entry.partition(":")
    try:
        capacity_bytes, _ = parse_memory(capacity) if capacity else (None, None)
    except ValueError:
        capacity_bytes = None
    if not name or capacity_bytes is None:
        raise ValueError(f"kv_tiers entry {entry!r} must be 'NAME:CAPACITY' with a size, such as 'cpu:4GiB'")
    return name, capacity_bytes


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
        Literal["auto", "float32", "float16", "bfloat16"],
        describe(
            "What the KV cache stores. 'auto' is the model's dtype, except float16 for a float32 model with "
            "quantized weights (such as the default GGUF model) when the attention backend supports it: half the "
            "memory per token and half the reads per decode step. Attention still computes in the model's dtype."
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
    kv_tiers: Annotated[
        list[str],
        describe(
            "KV tier plugins below the device cache, nearest first, each 'NAME:CAPACITY' (e.g. 'cpu:4GiB'): "
            "blocks evicted from the device are written to the first; a prefix that misses on the device is "
            "loaded from the tiers instead of recomputed.",
            flag="--kv-tier",
        ),
    ] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
        for tier in self.kv_tiers:
            kv_tier_spec(tier)  # raises naming the entry
        if self.kv_cache_memory != "auto":
            try:
                parse_memory(self.kv_cache_memory)
            except ValueError as exc:
                raise ValueError(f"kv_cache_memory: {exc}") from None
