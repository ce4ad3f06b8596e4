"""Registers the xgrammar backend as ``xgrammar`` (registration only: xgrammar, which imports torch, loads only
when selected)."""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register


@hookimpl
def tokenmill_register_structured_outputs_backends(register: Register) -> None:
    register("xgrammar", "tokenmill_plugins.structured_outputs.xgrammar_backend:XgrammarBackend")
