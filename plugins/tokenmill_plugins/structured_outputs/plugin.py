"""Registers the llguidance backend as ``guidance`` (vLLM's name) and ``llguidance`` (registration only)."""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register


@hookimpl
def tokenmill_register_structured_outputs_backends(register: Register) -> None:
    path = "tokenmill_plugins.structured_outputs.guidance:GuidanceBackend"
    register("guidance", path)
    register("llguidance", path)
