"""Registers the weight-only quantizers ``int8`` and ``int4`` (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register


@hookimpl
def tokenmill_register_quantizers(register: Register) -> None:
    register("int8", "tokenmill_plugins.quant.weight_only:Int8Quantizer")
    register("int4", "tokenmill_plugins.quant.weight_only:Int4Quantizer")
