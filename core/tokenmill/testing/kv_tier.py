"""``DictKVTier``: the smallest correct KV tier, in memory; the reference ``check_kv_tier`` is tested with."""

from __future__ import annotations

from typing import ClassVar

from tokenmill.kv_cache.memory_tier import MemoryKVTier


class DictKVTier(MemoryKVTier):
    """Blocks in an ordered dict, least recently used first; evicts from the front past capacity."""

    name: ClassVar[str] = "dict"
