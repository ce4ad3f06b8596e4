"""Tiny random models for tests, built in memory from named configs and seeded.

Hugging Face initialises biases to zero and norm weights to one, which would
let a missing bias or norm go unnoticed; ``make_hf_model`` perturbs every
parameter so each one changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_BASE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=1024,
)

#: name -> (transformers config class name, config overrides)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_theta": 500000.0,
            # A short original context makes every frequency band (kept, interpolated, scaled) occur.
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral-tiny": ("MistralConfig", {"sliding_window": 8}),
    "qwen2-tiny": ("Qwen2Config", {}),
    "qwen2-sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3-tiny": ("Qwen3Config", {"head_dim": 32}),
}


def make_hf_model(name: str, seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """A transformers model for ``TINY_CONFIGS[name]``, float32, eval mode, every parameter perturbed."""
    import transformers

    config_class_name, overrides = TINY_CONFIGS[name]
    config_class = getattr(transformers, config_class_name)
    architecture = config_class_name.replace("Config", "ForCausalLM")
    config = config_class(**{**_BASE, **overrides, **config_overrides}, architectures=[architecture])
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)._from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in param_name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(0.08 * torch.randn_like(param))
    return model.float().eval()


def save_hf_model(
    name: str, directory: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any
) -> torch.nn.Module:
    """Build ``name`` and save it as a Hugging Face directory (safetensors); returns the model."""
    model = make_hf_model(name, seed, **config_overrides)
    model.to(dtype).save_pretrained(directory)
    return model.float()


def make_engine(model_dir: Path, **sections: dict[str, Any]):  # type: ignore[no-untyped-def]
    """An in-process ``EngineCore`` on CPU with tiny defaults (block_size 4, 256 blocks)."""
    from tokenmill.config import load_config
    from tokenmill.engine import EngineCore

    overrides: dict[str, Any] = {
        "model": {"model": str(model_dir)},
        "device": {"device": "cpu"},
        "cache": {"block_size": 4, "num_kv_blocks": 256},
    }
    for section, values in sections.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    return EngineCore(load_config(overrides=overrides))


def run_to_completion(engine, requests) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Add ``EngineCoreRequest``s, step until all finish; returns each request's generated token ids."""
    tokens: dict[str, list[int]] = {}
    for request in requests:
        engine.add_request(request)
        tokens[request.request_id] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def make_scheduler(**overrides: Any):  # type: ignore[no-untyped-def]
    """A ``Scheduler`` over a real ``KVCacheManager`` with tiny numbers: block_size 4, 32 blocks,
    a 16-token step budget and at most 8 running requests. Pure Python: no model."""
    from tokenmill.kv_cache.manager import KVCacheManager
    from tokenmill.scheduler import Scheduler

    settings: dict[str, Any] = dict(
        num_blocks=32, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=8
    )
    settings.update(overrides)
    kv_cache = KVCacheManager(settings["num_blocks"], settings["block_size"], settings["enable_prefix_caching"])
    return Scheduler(kv_cache, settings["max_num_batched_tokens"], settings["max_num_seqs"])


def make_requests(n: int, prompt_len: int = 8, max_tokens: int = 4, **fields: Any) -> list:
    """``n`` greedy requests with distinct prompts, arriving in order."""
    from tokenmill.request import Request
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [
        Request(
            request_id=f"r{i}",
            prompt_token_ids=[100 * (i + 1) + t for t in range(prompt_len)],
            params=params,
            eos_token_ids=(),
            max_model_len=1024,
            arrival_time=float(i),
            **fields,
        )
        for i in range(n)
    ]
