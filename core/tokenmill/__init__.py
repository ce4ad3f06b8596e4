"""tokenmill: a plugin-based LLM inference runtime.

Plugin authors import from here only. Names whose modules need torch are
imported lazily, so a process that never touches them (the API front end)
never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from tokenmill.hookspecs import hookimpl

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY_EXPORTS: dict[str, str] = {
    "AttentionBackend": "tokenmill.attention.backend",
    "AttentionLayerSpec": "tokenmill.attention.backend",
    "AttentionMetadata": "tokenmill.attention.backend",
    "CausalLM": "tokenmill.models.base",
    "EngineConfig": "tokenmill.config",
    "EngineCore": "tokenmill.engine",
    "CompletionOutput": "tokenmill.outputs",
    "IncrementalDetokenizer": "tokenmill.tokenizer",
    "LLM": "tokenmill.llm",
    "LoadedTensor": "tokenmill.weights.format",
    "ArchitectureConfig": "tokenmill.models.architecture",
    "block_hashes": "tokenmill.kv_cache.block_hash",
    "ModelConfig": "tokenmill.config",
    "PluginError": "tokenmill.plugin_manager",
    "Quantizer": "tokenmill.layers.quantizer",
    "RequestOutput": "tokenmill.outputs",
    "SamplingParams": "tokenmill.sampling_params",
    "Sampler": "tokenmill.sampler",
    "SamplingMetadata": "tokenmill.sampler",
    "Tokenizer": "tokenmill.tokenizer",
    "WeightFormat": "tokenmill.weights.format",
    "WeightsError": "tokenmill.weights.format",
}

__all__ = ["__version__", "hookimpl", *_LAZY_EXPORTS]


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
