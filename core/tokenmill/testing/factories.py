"""Tiny random models, engines, schedulers and requests for tests, built in memory and seeded.

Hugging Face initialises biases to zero and norm weights to one, which would
let a missing bias or norm go unnoticed; ``make_hf_model`` perturbs every
parameter so each one changes the logits. ``transformers`` (a test-only
dependency) is imported only when a model is built, and nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tokenmill.engine import EngineCore
    from tokenmill.messages import EngineCoreRequest
    from tokenmill.plugin_manager import PluginSystem
    from tokenmill.request import Request
    from tokenmill.scheduler import Scheduler

__all__ = [
    "TINY_CONFIGS",
    "make_engine",
    "make_hf_model",
    "make_requests",
    "make_scheduler",
    "run_to_completion",
    "save_hf_model",
    "save_tiny_model",
    "save_tiny_tokenizer",
]

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
    # Scores and logits capped low enough that the caps change them; an 8-token window on even layers.
    "gemma2-tiny": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
    ),
    # A local rope base for the sliding layer, a linearly scaled global one.
    "gemma3-tiny": (
        "Gemma3TextConfig",
        {
            "architectures": ["Gemma3ForCausalLM"],
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        },
    ),
    # 8 experts, top 2, every other layer sparse in qwen3-moe; a shared expert behind a sigmoid gate in qwen2-moe.
    "qwen3-moe-tiny": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2-moe-tiny": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
    "mixtral-tiny": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # q/k norms over the whole projection, q/k/v clipped low enough that the clip changes them.
    "olmoe-tiny": (
        "OlmoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "clip_qkv": 0.5, "eos_token_id": 2},
    ),
    # No native plugin: these run through the transformers fallback. Granite's multipliers all differ from one.
    "granite-tiny": (
        "GraniteConfig",
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 1.5,
        },
    ),
    "olmo2-tiny": ("Olmo2Config", {"pad_token_id": 0, "eos_token_id": 2}),
    "phi3-tiny": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    # Phi-4-mini's shape: half of each head rotates, LongRoPE with a context extended 2x (its attention factor
    # scales cos and sin); the test prompts stay inside the original context, where the short factors apply.
    "phi3-longrope": (
        "Phi3Config",
        {
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "original_max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 512,
                "short_factor": [1.0, 1.3, 1.9, 2.6],
                "long_factor": [1.5, 2.5, 4.0, 8.0],
            },
        },
    ),
}

#: The tiny tokenizer's special tokens; ids 0, 1 and 2.
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_hf_model(name: str, seed: int = 0, **config_overrides: Any) -> torch.nn.Module:
    """A transformers model for ``TINY_CONFIGS[name]``, float32, eval mode, every parameter perturbed."""
    import torch
    import transformers

    config_class_name, overrides = TINY_CONFIGS[name]
    config_class = getattr(transformers, config_class_name)
    settings = {**_BASE, **overrides, **config_overrides}
    architecture = settings.pop("architectures", [config_class_name.replace("Config", "ForCausalLM")])[0]
    config = config_class(**settings, architectures=[architecture])
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
    name: str, directory: Path, seed: int = 0, dtype: torch.dtype | None = None, **config_overrides: Any
) -> torch.nn.Module:
    """Build ``name`` and save it as a Hugging Face directory (safetensors, ``dtype``, float32 by default);
    returns the model in float32."""
    import torch

    model: Any = make_hf_model(name, seed, **config_overrides)  # a transformers PreTrainedModel
    model.to(dtype or torch.float32).save_pretrained(directory)
    return model.float()


def save_tiny_tokenizer(directory: Path, vocab_size: int = 512) -> None:
    """Write a byte-level BPE tokenizer of exactly ``vocab_size`` ids into ``directory`` (``tokenizer.json``
    and ``tokenizer_config.json`` with a ChatML template), so a tiny model serves text without a download.

    Ids 0-2 are ``<|endoftext|>`` (padding), ``<|im_start|>`` and ``<|im_end|>`` (EOS), then the 256 bytes, then
    two-letter merges of lowercase letters and spaces until the vocabulary is full.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS)}
    vocab.update({token: len(_SPECIAL_TOKENS) + i for i, token in enumerate(alphabet)})
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"]  # "Ġ" stands for a space
    merges: list[tuple[str, str]] = []
    for first in letters:
        for second in letters:
            if len(vocab) >= vocab_size:
                break
            merges.append((first, second))
            vocab[first + second] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is outside the tiny tokenizer's range 259..{3 + 256 + 27 * 27}")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    # EOS is <|im_end|> (id 2), the id transformers' tiny configs also name as eos_token_id.
    config = {"eos_token": _SPECIAL_TOKENS[2], "pad_token": _SPECIAL_TOKENS[0], "chat_template": _CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def save_tiny_model(directory: Path, name: str = "llama-tiny", seed: int = 0, **config_overrides: Any) -> Path:
    """A tiny random model with its own tokenizer, saved as a Hugging Face directory that ``tokenmill serve``
    and ``make_engine`` load as is; returns ``directory``."""
    save_hf_model(name, directory, seed, **config_overrides)
    save_tiny_tokenizer(directory, {**_BASE, **TINY_CONFIGS[name][1], **config_overrides}["vocab_size"])
    return directory


def make_engine(model_dir: Path, plugin_system: PluginSystem | None = None, **sections: dict[str, Any]) -> EngineCore:
    """An in-process ``EngineCore`` on CPU with tiny defaults (block_size 4, 256 blocks); each keyword is a
    config section to merge over them (``make_engine(path, scheduler={"policy": "priority"})``;
    ``plugins={"NAME": {...}}`` sets a plugin's options).

    :param plugin_system: a plugin system to build from (the ``plugin_manager`` fixture's, with plugin objects that
        are not installed); its selections and ``[plugins.NAME]`` options are checked against the config
        first, as at start-up. Default: the installed plugins.
    """
    from tokenmill.config import load_config
    from tokenmill.engine import EngineCore

    overrides: dict[str, Any] = {
        "model": {"model": str(model_dir)},
        "device": {"device": "cpu"},
        "cache": {"block_size": 4, "num_kv_blocks": 256},
    }
    for section, values in sections.items():
        overrides[section] = {**overrides[section], **values} if isinstance(overrides.get(section), dict) else values
    config = load_config(overrides=overrides)
    if plugin_system is not None:
        plugin_system.check_config(config)
    return EngineCore(config, plugin_system)


def run_to_completion(engine: EngineCore, requests: Iterable[EngineCoreRequest]) -> dict[str, list[int]]:
    """Add ``EngineCoreRequest``s, step until all finish; returns each request's generated token ids."""
    tokens: dict[str, list[int]] = {}
    for request in requests:
        engine.add_request(request)
        tokens[request.request_id] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def make_scheduler(policy: str | type[Scheduler] = "fcfs", **overrides: Any) -> Scheduler:
    """A scheduler (``policy``: a registered name or a ``Scheduler`` subclass) over a real
    ``PagedKVCacheManager`` with tiny numbers: block_size 4, 32 blocks, a 16-token step budget and at most
    8 running requests. Pure Python: no model. The KV cache manager is ``scheduler.kv_cache``."""
    from tokenmill.kv_cache.manager import PagedKVCacheManager

    settings: dict[str, Any] = dict(
        num_blocks=32, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=8
    )
    unknown = set(overrides) - set(settings)
    if unknown:
        raise TypeError(f"make_scheduler got unknown settings {sorted(unknown)}; allowed: {sorted(settings)}")
    settings.update(overrides)
    kv_cache = PagedKVCacheManager(settings["num_blocks"], settings["block_size"], settings["enable_prefix_caching"])
    limits = dict(max_num_batched_tokens=settings["max_num_batched_tokens"], max_num_seqs=settings["max_num_seqs"])
    if not isinstance(policy, str):
        return policy(kv_cache, **limits)  # type: ignore[call-arg]  # concrete policies take these
    from tokenmill.plugin_manager import Slot, load_plugins

    # Built through the plugin system, so a plugin's policy gets its options as the engine would give them.
    return load_plugins().create(Slot.SCHEDULER, policy, kv_cache, **limits)


def make_requests(n: int, prompt_len: int = 8, max_tokens: int = 4, **fields: Any) -> list[Request]:
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
