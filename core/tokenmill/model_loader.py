"""Turning a config into a model with weights: every plugin slot resolved by name.

The model is built on the meta device (no memory), materialised empty on the
target device, then filled tensor by tensor from the weight format's stream,
so peak memory stays near the model's own size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import EngineConfig
from tokenmill.host_memory import keep_freed_heap, move_to_huge_pages
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.fused_experts import FusedExperts, UsesFusedExperts, install_fused_experts
from tokenmill.layers.kernels import LayerKernels, install_layer_kernels
from tokenmill.layers.quantizer import Quantizer
from tokenmill.lora.kernels import LoRAKernels
from tokenmill.model_files import resolve_model
from tokenmill.models.architecture import ArchitectureConfig
from tokenmill.models.base import CausalLM
from tokenmill.models.catalog import FALLBACK_ARCHITECTURE
from tokenmill.parallel.group import TensorParallelGroup, single_process_group
from tokenmill.parallel.sharding import TensorParallelError, check_shardable, shard_num_threads
from tokenmill.plugin_manager import PluginError, PluginSystem, Registry, Slot, resolve_plugins
from tokenmill.weights.cache import load_model_weights
from tokenmill.weights.format import WeightFormat, WeightsError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    arch: ArchitectureConfig
    attention: AttentionBackend
    device: torch.device
    dtype: torch.dtype
    path: Path
    max_model_len: int
    kv_cache_dtype: torch.dtype  # what the KV cache stores; attention computes in ``dtype``
    #: The tensor-parallel shards this model is one of (size 1: the whole model).
    tp: TensorParallelGroup = field(default_factory=single_process_group)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this shard computes and caches."""
        return self.arch.num_kv_heads // self.tp.size


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PluginError("device.device='cuda' but torch sees no CUDA GPU; use device='cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, arch: ArchitectureConfig, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32  # CPUs without bf16 units run bf16 matmuls two orders of magnitude slower
    checkpoint = _DTYPES.get(arch.torch_dtype or "")
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_kv_cache_dtype(
    name: str, dtype: torch.dtype, attention: AttentionBackend, quantizer: Quantizer
) -> torch.dtype:
    """The KV cache's storage dtype for ``cache.kv_cache_dtype``.

    ``"auto"`` is the model's dtype, except that a float32 model with quantized linears stores
    float16 when its attention backend can: the quantized model is approximate already, and half
    the bytes per cached token is twice the tokens in the same memory and half the reads per
    decode step (llama.cpp's default too). Float models stay exact. ``"fp8"`` (``"fp8_e4m3"``) and
    ``"int8"``, vLLM's names, store one-byte codes with a scale per token and KV head
    (``tokenmill.attention.kv_quant``): about half of float16's bytes, for backends that declare them."""
    if name == "auto":
        if dtype == torch.float32 and not quantizer.is_dense and torch.float16 in attention.kv_cache_dtypes:
            return torch.float16
        return dtype
    dtypes = {**_DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
    kv_cache_dtype = dtypes[name]
    if kv_cache_dtype != dtype and kv_cache_dtype not in attention.kv_cache_dtypes:
        names = {value: key for key, value in reversed(dtypes.items())}  # float8_e4m3fn -> "fp8"
        supported = ", ".join(names[d] for d in (dtype, *attention.kv_cache_dtypes) if d in names)
        raise PluginError(
            f"cache.kv_cache_dtype={name!r}: attention backend {attention.name!r} stores only {supported} "
            f"for this {str(dtype).removeprefix('torch.')} model; choose one of those or another attention.backend"
        )
    return kv_cache_dtype


def _quantization_config(hf_config: Mapping[str, Any], path: Path) -> Mapping[str, Any] | None:
    """The checkpoint's ``quantization_config``, or None for a float checkpoint or a GGUF file (whose weight
    format reports its block type there, read as ``ArchitectureConfig.stored_weight_type``)."""
    quantization_config = hf_config.get("quantization_config")
    if quantization_config is None:
        return None
    if not isinstance(quantization_config, Mapping):
        raise WeightsError(f"{path}: quantization_config is a {type(quantization_config).__name__}, not an object")
    return None if quantization_config.get("quant_method") == "gguf" else quantization_config


def select_architecture(name: str, model_impl: str, plugins: PluginSystem) -> tuple[str, type[CausalLM]]:
    """The registered name and class that run architecture ``name``: its native plugin's, or for ``model_impl``
    ``"transformers"`` (and ``"auto"`` when no plugin registers ``name``) the transformers fallback's, logged."""
    names = plugins.registry.names(Slot.ARCHITECTURE)
    is_native = name in names and name != FALLBACK_ARCHITECTURE
    if model_impl == "tokenmill" or (model_impl == "auto" and is_native) or FALLBACK_ARCHITECTURE not in names:
        if model_impl == "transformers" and FALLBACK_ARCHITECTURE not in names:
            raise PluginError(
                f"model.model_impl='transformers' needs the {FALLBACK_ARCHITECTURE} architecture (plugin "
                "'architectures'), which is not installed"
            )
        return name, plugins.load(Slot.ARCHITECTURE, name)
    if model_impl == "auto":
        logger.info("architecture %s has no native plugin: running it through %s", name, FALLBACK_ARCHITECTURE)
    return FALLBACK_ARCHITECTURE, plugins.load(Slot.ARCHITECTURE, FALLBACK_ARCHITECTURE)


def select_weight_format(path: Path, plugins: PluginSystem, name: str | None) -> WeightFormat:
    """The named format, or the first registered one that recognises ``path``."""
    if name is not None:
        return plugins.create(Slot.WEIGHT_FORMAT, name)
    for registration in plugins.registry.registrations(Slot.WEIGHT_FORMAT):
        weight_format: WeightFormat = plugins.create(Slot.WEIGHT_FORMAT, registration.name)
        if weight_format.can_load(path):
            return weight_format
    names = ", ".join(plugins.registry.names(Slot.WEIGHT_FORMAT))
    raise WeightsError(f"{path}: no installed weight format recognises it (installed: {names})")


def _loadable(registry: Registry, slot: Slot) -> list[tuple[str, Any]]:
    """``(name, class)`` of every implementation registered in ``slot`` that imports; "auto" skips (and logs)
    broken ones."""
    loaded = []
    for registration in registry.registrations(slot):
        try:
            loaded.append((registration.name, registry.load(slot, registration.name)))
        except PluginError as exc:
            logger.warning("skipping %s %r for 'auto': %s", slot.value, registration.name, exc)
    return loaded


def _load_for_device(registry: Registry, slot: Slot, name: str, device: torch.device, setting: str) -> Any:
    """The class registered as ``name``, refused with the setting to change if it does not run on ``device``."""
    implementation = registry.load(slot, name)
    if device.type not in implementation.supported_devices:
        raise PluginError(
            f"{slot.value} {name!r} does not run on {device.type}; it supports "
            f"{', '.join(implementation.supported_devices)} ({setting})"
        )
    return implementation


def _select_by_priority(
    plugins: PluginSystem, slot: Slot, name: str, device: torch.device, setting: str, selectable: Callable[[Any], bool]
) -> Any:
    """The implementation named in ``slot``, built, or for ``"auto"`` the one with the highest ``auto_priority``
    among those ``selectable`` says ``auto`` may pick (the built-in ``torch`` ones always may, so there is always
    a candidate)."""
    if name == "auto":
        candidates = [(n, cls) for n, cls in _loadable(plugins.registry, slot) if selectable(cls)]
        best_name, best_class = max(candidates, key=lambda c: c[1].auto_priority)
        return plugins.instantiate(slot, best_name, best_class)
    implementation = _load_for_device(plugins.registry, slot, name, device, setting)
    return plugins.instantiate(slot, name, implementation)


def select_attention_backend(
    name: str, device: torch.device, plugins: PluginSystem, head_dim: int, needs_logits_soft_cap: bool = False
) -> AttentionBackend:
    """The named backend, or for ``"auto"`` the one with the highest priority among those that may be picked for
    a model of ``head_dim`` on ``device`` (``AttentionBackend.auto_selectable``) and, for a model whose attention
    caps its scores, that apply the cap (``supports_logits_soft_cap``)."""
    backend: AttentionBackend = _select_by_priority(
        plugins, Slot.ATTENTION_BACKEND, name, device, "attention.backend",
        lambda cls: cls.auto_selectable(device, head_dim)
        and (cls.supports_logits_soft_cap or not needs_logits_soft_cap),
    )  # fmt: skip
    if needs_logits_soft_cap and not backend.supports_logits_soft_cap:
        capable = [n for n, cls in _loadable(plugins.registry, Slot.ATTENTION_BACKEND) if cls.supports_logits_soft_cap]
        raise PluginError(
            f"attention.backend={name!r} does not cap attention scores, which this model needs "
            f"(attn_logit_softcapping); use 'auto' or one of: {', '.join(capable)}"
        )
    return backend


def select_layer_kernels(name: str, device: torch.device, plugins: PluginSystem) -> LayerKernels:
    """The named layer kernels, or for ``"auto"`` those with the highest priority among the ones that may be
    picked on ``device`` (``LayerKernels.auto_selectable``)."""
    return _select_by_priority(
        plugins, Slot.LAYER_KERNEL, name, device, "model.layer_kernels", lambda cls: cls.auto_selectable(device)
    )


def select_fused_experts(name: str, device: torch.device, plugins: PluginSystem, lora: bool = False) -> FusedExperts:
    """The named fused-experts kernels, or for ``"auto"`` those with the highest priority among the ones that may be
    picked on ``device`` (``FusedExperts.auto_selectable``) and, with LoRA enabled (``lora``), that run adapters
    on the experts (``supports_lora``) where any does."""
    candidates = [cls for _, cls in _loadable(plugins.registry, Slot.FUSED_EXPERT) if cls.auto_selectable(device)]
    lora_only = lora and any(cls.supports_lora for cls in candidates)
    return _select_by_priority(
        plugins, Slot.FUSED_EXPERT, name, device, "model.fused_experts",
        lambda cls: cls.auto_selectable(device) and (cls.supports_lora or not lora_only),
    )  # fmt: skip


def select_lora_kernels(name: str, device: torch.device, plugins: PluginSystem) -> LoRAKernels:
    """The named LoRA kernels, or for ``"auto"`` those with the highest priority among the ones that may be picked
    on ``device`` (``LoRAKernels.auto_selectable``)."""
    return _select_by_priority(
        plugins, Slot.LORA_KERNEL, name, device, "lora.lora_kernels", lambda cls: cls.auto_selectable(device)
    )


def select_quantizer(
    name: str,
    arch: ArchitectureConfig,
    device: torch.device,
    plugins: PluginSystem,
    quantization_config: Mapping[str, Any] | None = None,
) -> Quantizer:
    """The named quantizer, or for ``"auto"`` the available one that holds the checkpoint's weights exactly on
    this device, else one that holds them within its own rounding (``near_lossless_for``), else ``"none"``.

    A checkpoint quantized by another tool (its config's ``quantization_config``) is read by a quantizer whose
    ``quant_methods`` names its ``quant_method``, configured from it; any other choice, an unknown method or a
    variant the quantizer lacks is a one-line ``PluginError`` before anything loads."""
    if quantization_config is not None:
        return _select_checkpoint_quantizer(name, device, plugins, quantization_config)
    if name != "auto":
        implementation = _load_for_device(plugins.registry, Slot.QUANTIZER, name, device, "model.quantization")
        if getattr(implementation, "quant_methods", ()):
            methods = ", ".join(implementation.quant_methods)
            raise PluginError(
                f"model.quantization={name!r} reads checkpoints quantized with {methods}, "
                "and this checkpoint has no quantization_config; use 'auto', 'none', 'int8' or 'int4'"
            )
        return plugins.instantiate(Slot.QUANTIZER, name, implementation)
    loadable = _loadable(plugins.registry, Slot.QUANTIZER) if arch.stored_weight_type else []
    for exact in (True, False):
        candidates = [
            (quantizer_name, quantizer_class)
            for quantizer_name, quantizer_class in loadable
            if arch.stored_weight_type in (quantizer_class.lossless_for if exact else quantizer_class.near_lossless_for)
            and device.type in quantizer_class.supported_devices
            and quantizer_class.is_available()
        ]
        if candidates:
            best_name, best_class = max(candidates, key=lambda c: c[1].auto_priority)
            return plugins.instantiate(Slot.QUANTIZER, best_name, best_class)
    return plugins.create(Slot.QUANTIZER, "none")


def _select_checkpoint_quantizer(
    name: str, device: torch.device, plugins: PluginSystem, quantization_config: Mapping[str, Any]
) -> Quantizer:
    method = quantization_config.get("quant_method")
    readers = [(n, c) for n, c in _loadable(plugins.registry, Slot.QUANTIZER) if getattr(c, "quant_methods", ())]
    supported = ", ".join(sorted({m for _, c in readers for m in c.quant_methods})) or "none installed"
    matching = [(n, c) for n, c in readers if method in c.quant_methods]
    if not matching:
        raise PluginError(
            f"the checkpoint is quantized with quant_method {method!r}, which no installed quantizer reads "
            f"(supported: {supported})"
        )
    if name == "auto":
        usable = [(n, c) for n, c in matching if device.type in c.supported_devices and c.is_available()]
        if not usable:
            names = ", ".join(n for n, _ in matching)
            raise PluginError(f"quantizer {names} reads {method!r} checkpoints but does not run on {device.type} here")
        name, implementation = max(usable, key=lambda c: c[1].auto_priority)
    elif name not in (n for n, _ in matching):
        raise PluginError(
            f"model.quantization={name!r} cannot run this checkpoint, quantized with {method!r}; "
            f"use 'auto' or {', '.join(repr(n) for n, _ in matching)}"
        )
    else:
        implementation = _load_for_device(plugins.registry, Slot.QUANTIZER, name, device, "model.quantization")
    quantizer: Quantizer = plugins.instantiate(Slot.QUANTIZER, name, implementation)
    try:
        quantizer.configure(quantization_config)
    except ValueError as exc:
        raise PluginError(f"cannot run this {method} checkpoint: {exc}") from exc
    return quantizer


def materialize_empty(model: nn.Module, device: torch.device) -> None:
    """Give every parameter and buffer of a model built on the meta device uninitialised storage on ``device``,
    in place; a tensor shared by several modules stays shared. What ``nn.Module.to_empty`` does, without its
    first call's detour through torch's reference implementations, which imports sympy (0.3-0.5 s of every
    start)."""
    materialized: dict[int, torch.Tensor] = {}

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in materialized:
            materialized[id(tensor)] = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        return materialized[id(tensor)]

    parameters: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                if id(param) not in parameters:
                    parameters[id(param)] = nn.Parameter(empty(param), requires_grad=param.requires_grad)
                module._parameters[name] = parameters[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = empty(buffer)


def _streamed_weights(model: nn.Module) -> list[torch.Tensor]:
    """The tensors each decode step reads whole: all the model's but the embedding's (a token reads one row of
    it), unless the output projection is the tied embedding itself (no ``lm_head`` of its own)."""
    embedding_is_head = getattr(model, "lm_head", None) is None
    return [
        tensor
        for module in model.modules()
        if embedding_is_head or not isinstance(module, VocabParallelEmbedding)
        for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False))
    ]


def load_model(
    config: EngineConfig,
    plugins: PluginSystem | None = None,
    connect: Callable[[torch.device], TensorParallelGroup] | None = None,
) -> LoadedModel:
    """Build the configured model on its device and load its weights.

    With ``parallel.tensor_parallel_size`` > 1, ``connect`` joins this process to the replica's shards once the
    model is known to split (``check_shardable``: a one-line ``TensorParallelError`` otherwise, before any
    weight is read or worker started); only this shard's part of the model is built and loaded."""
    plugins = plugins if plugins is not None else resolve_plugins(config)
    path = resolve_model(config.model.model)
    weight_format = select_weight_format(path, plugins, config.model.weight_format)
    hf_config = weight_format.read_config(path)
    architectures = hf_config.get("architectures") or [""]
    implementation, model_class = select_architecture(str(architectures[0]), config.model.model_impl, plugins)
    # The fallback runs what tokenmill's own layers would refuse (another rope scaling, activation).
    arch = ArchitectureConfig.from_hf_config(hf_config, lenient=implementation == FALLBACK_ARCHITECTURE)
    device = resolve_device(config.device.device)
    attention = select_attention_backend(
        config.attention.backend, device, plugins, arch.head_dim, arch.attention_logits_soft_cap is not None
    )
    layer_kernels = select_layer_kernels(config.model.layer_kernels, device, plugins)
    quantizer = select_quantizer(
        config.model.quantization, arch, device, plugins, _quantization_config(hf_config, path)
    )
    tp = single_process_group()
    tp_size = config.parallel.tensor_parallel_size
    if tp_size > 1:
        if connect is None:  # a tool that loads the model into this process alone (eval, quantize, bench linears)
            raise TensorParallelError(
                f"parallel.tensor_parallel_size={tp_size}: this command loads the whole model in one process; "
                "run it with tensor_parallel_size = 1"
            )
        expert_parallel = config.parallel.enable_expert_parallel
        check_shardable(arch, tp_size, model_class, quantizer, device, expert_parallel)
        tp = replace(connect(device), expert_parallel=expert_parallel)
        if device.type == "cuda":
            device = torch.device("cuda", tp.rank)
    if config.device.num_threads is not None:
        torch.set_num_threads(config.device.num_threads)
    elif tp_size > 1 and device.type == "cpu":
        torch.set_num_threads(shard_num_threads(tp_size))
    dtype = resolve_dtype(config.model.dtype, arch, device)
    kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, attention, quantizer)  # before loading
    max_model_len = config.model.max_model_len or arch.max_position_embeddings
    logger.info(
        "loading %s%s (%s, %s) from %s on %s as %s, KV cache %s, attention %s, layer kernels %s",
        arch.architecture,
        f" shard {tp.rank} of {tp.size}{' (experts whole)' if tp.expert_parallel else ''}" if tp.size > 1 else "",
        weight_format.name,
        quantizer.name,
        path,
        device,
        dtype,
        kv_cache_dtype,
        attention.name,
        layer_kernels.name,
    )
    max_position = max(max_model_len, arch.max_position_embeddings)
    with torch.device("meta"):
        # Only a sharded model's constructor gets ``tp``: an architecture plugin without it is refused above.
        model = model_class(arch, attention, quantizer, dtype, max_position, **({"tp": tp} if tp.size > 1 else {}))
    materialize_empty(model, device)
    install_layer_kernels(model, layer_kernels)
    model.fused_decoder = layer_kernels.fused_decoder(model, attention)
    if any(isinstance(module, UsesFusedExperts) for module in model.modules()):
        fused_experts = select_fused_experts(config.model.fused_experts, device, plugins, config.lora.enable_lora)
        logger.info("mixture-of-experts layers run on fused experts %s", fused_experts.name)
        install_fused_experts(model, fused_experts)
    # A warm start reads the repacked weights.
    load_model_weights(model, path, weight_format, dtype, device, (tp.rank, tp.size), tp.expert_parallel)
    if device.type == "cpu":  # before anything views the weights (host_memory)
        started = time.monotonic()
        moved = move_to_huge_pages(_streamed_weights(model))
        if moved:
            logger.info("weights moved into huge pages (%.0f MB) in %.2f s", moved / 1e6, time.monotonic() - started)
        keep_freed_heap()
    model.eval()
    return LoadedModel(model, arch, attention, device, dtype, path, max_model_len, kv_cache_dtype, tp)
