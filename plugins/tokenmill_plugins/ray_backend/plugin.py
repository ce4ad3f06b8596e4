"""Registers the engine backend ``ray`` (registration only: neither Ray nor torch is imported here)."""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register


@hookimpl
def tokenmill_register_engine_backends(register: Register) -> None:
    register("ray", "tokenmill_plugins.ray_backend.backend:RayEngineBackend")
