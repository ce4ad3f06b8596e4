"""Registers the built-in attention backend (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_attention_backends(register: Register) -> None:
    register("torch", "tokenmill.attention.torch_backend:TorchAttentionBackend")
