"""The built-in KV tiers: ``cpu`` (host memory) and ``disk`` (a local directory that survives restarts).

Selected by ``kv_tiers`` (``--kv-tier cpu:4GiB --kv-tier disk:20GiB:/var/cache/tokenmill/kv``); the
interface and the write policies are in ``tokenmill.kv_cache.tier``.
"""
