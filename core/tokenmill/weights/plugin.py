"""Registers the built-in weight formats (registration only: no torch import here).

Order matters: with no ``model.weight_format`` set, the first format whose
``can_load`` accepts the path reads it.
"""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_weight_formats(register: Register) -> None:
    register("safetensors", "tokenmill.weights.safetensors_format:SafetensorsFormat")
    register("gguf", "tokenmill.weights.gguf_format:GGUFFormat")
