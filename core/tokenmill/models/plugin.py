"""Registers the built-in architectures (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl

#: Hugging Face architecture names served by the one Llama-family implementation.
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@hookimpl
def tokenmill_register_architectures(register: Register) -> None:
    for name in LLAMA_FAMILY:
        register(name, "tokenmill.models.llama:LlamaForCausalLM")
