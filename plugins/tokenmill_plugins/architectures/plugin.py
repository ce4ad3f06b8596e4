"""Registers the architectures of this plugin (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl

#: Hugging Face architecture name -> the class serving it.
ARCHITECTURES = {
    "Gemma2ForCausalLM": "tokenmill_plugins.architectures.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "tokenmill_plugins.architectures.gemma:GemmaForCausalLM",
    "Phi3ForCausalLM": "tokenmill_plugins.architectures.phi3:Phi3ForCausalLM",
    "Qwen3MoeForCausalLM": "tokenmill_plugins.architectures.moe:MoEForCausalLM",
    "Qwen2MoeForCausalLM": "tokenmill_plugins.architectures.moe:MoEForCausalLM",
    "MixtralForCausalLM": "tokenmill_plugins.architectures.moe:MoEForCausalLM",
    "OlmoeForCausalLM": "tokenmill_plugins.architectures.olmoe:OlmoeForCausalLM",
    # The fallback for every other architecture (model.model_impl).
    "TransformersForCausalLM": "tokenmill_plugins.architectures.transformers_fallback:TransformersForCausalLM",
}


@hookimpl
def tokenmill_register_architectures(register: Register) -> None:
    for name, import_path in ARCHITECTURES.items():
        register(name, import_path)
