"""Registers the built-in KV tiers (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register


@hookimpl
def tokenmill_register_kv_tiers(register: Register) -> None:
    register("cpu", "tokenmill_plugins.kv_tiers.cpu:CPUKVTier")
    register("disk", "tokenmill_plugins.kv_tiers.disk:DiskKVTier")
    register("zmq-push", "tokenmill_plugins.kv_tiers.zmq_connector:ZmqPushKVTier")
    register("zmq-pull", "tokenmill_plugins.kv_tiers.zmq_connector:ZmqPullKVTier")
