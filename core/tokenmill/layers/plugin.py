"""Registers the built-in quantizer ``none`` (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_quantizers(register: Register) -> None:
    register("none", "tokenmill.layers.dense:DenseQuantizer")
