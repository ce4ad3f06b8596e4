"""Registers the built-in KV cache manager (no torch imported here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_kv_cache_managers(register: Register) -> None:
    register("paged", "tokenmill.kv_cache.manager:PagedKVCacheManager")
