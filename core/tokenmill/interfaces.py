"""Every interface a plugin can implement, from one public module.

Each slot of the runtime has an interface here, a registration hook in
``tokenmill.hookspecs`` and at least one built-in implementation registered
through that same hook (``tokenmill plugins`` lists them all):

========================  ==============================  ======================================
slot                      interface                       built in
========================  ==============================  ======================================
``architecture``          ``CausalLM``                    Llama, Mistral, Qwen2, Qwen3; plugin ``architectures``: ...
``weight_format``         ``WeightFormat``                ``safetensors``, ``gguf``
``quantizer``             ``Quantizer``                   ``none``, ``int8``, ``int4``
``attention_backend``     ``AttentionBackend``            ``torch``, ``cpu``, ``triton``, ``cuda``
``layer_kernel``          ``LayerKernels``                ``torch``; plugin ``layer_kernels``: ``cpu``, ``triton``
``fused_expert``          ``FusedExperts``                ``torch``
``scheduler``             ``Scheduler``                   ``fcfs``, ``priority``
``kv_cache_manager``      ``KVCacheManager``              ``paged``
``sampler``               ``Sampler``                     ``torch``
``logits_processor``      ``LogitsProcessor``             ``logit_bias``, ``min_tokens``
``speculator``            ``Speculator``                  ``ngram``, ``draft_model``, ``medusa``
``kv_tier``               ``KVTier``                      ``cpu``, ``disk``, ``zmq-push``, ``zmq-pull``
``router``                ``Router``                      ``round_robin``; plugin ``routers``: ``least_loaded``, ...
``transport``             ``Transport``                   ``zmq``
``engine_backend``        ``EngineBackend``               ``local`` (core, no plugin); plugin ``ray_backend``: ``ray``
``structured_outputs_backend`` ``StructuredOutputBackend``  plugin ``structured_outputs``: ``guidance``; ``xgrammar``
``lora_kernel``           ``LoRAKernels``                 ``torch``
``tool_parser``           ``ToolParser``                  plugin ``parsers``: ``hermes``, ``llama3_json``, ``mistral``
``reasoning_parser``      ``ReasoningParser``             plugin ``parsers``: ``deepseek_r1``, ``qwen3``
========================  ==============================  ======================================

Names are imported on first use, so a front-end process that imports a
router's interface never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill._lazy import lazy_getattr

if TYPE_CHECKING:
    pass

#: name -> module that defines it.
_EXPORTS: dict[str, str] = {
    "ArchitectureConfig": "tokenmill.models.architecture",
    "AttentionBackend": "tokenmill.attention.backend",
    "AttentionLayerSpec": "tokenmill.attention.backend",
    "AttentionMetadata": "tokenmill.attention.backend",
    "BoundLoRA": "tokenmill.lora.kernels",
    "CausalLM": "tokenmill.models.base",
    "DraftTokens": "tokenmill.scheduler",
    "EngineBackend": "tokenmill.engine_backend",
    "EngineEndpoint": "tokenmill.transport.base",
    "EngineProcess": "tokenmill.engine_client",
    "EngineState": "tokenmill.routing",
    "ExtractedToolCalls": "tokenmill.parsers.tool_parser",
    "FrontendConnection": "tokenmill.transport.base",
    "FusedDecoder": "tokenmill.layers.kernels",
    "FusedExperts": "tokenmill.layers.fused_experts",
    "KVCacheManager": "tokenmill.kv_cache.manager",
    "KVTier": "tokenmill.kv_cache.tier",
    "KVTierStats": "tokenmill.kv_cache.tier",
    "MemoryKVTier": "tokenmill.kv_cache.memory_tier",
    "LayerKernels": "tokenmill.layers.kernels",
    "LoadedTensor": "tokenmill.weights.format",
    "LoRABatch": "tokenmill.lora.kernels",
    "LoRAKernels": "tokenmill.lora.kernels",
    "LogitsProcessor": "tokenmill.sampling.logits_processor",
    "ModelRunnerOutput": "tokenmill.scheduler",
    "PartialToolCalls": "tokenmill.parsers.tool_parser",
    "PrefixMatch": "tokenmill.kv_cache.manager",
    "Proposal": "tokenmill.speculative.speculator",
    "Quantizer": "tokenmill.layers.quantizer",
    "ReasoningParser": "tokenmill.parsers.reasoning_parser",
    "Router": "tokenmill.routing",
    "Sampler": "tokenmill.sampling.sampler",
    "SamplerOutput": "tokenmill.sampling.sampler",
    "SamplingMetadata": "tokenmill.sampling.sampler",
    "SamplingRow": "tokenmill.sampling.logits_processor",
    "ScheduledRequest": "tokenmill.scheduler",
    "Scheduler": "tokenmill.scheduler",
    "SchedulerOutput": "tokenmill.scheduler",
    "SlotAllocation": "tokenmill.kv_cache.manager",
    "SpeculationInput": "tokenmill.speculative.speculator",
    "SpeculatorContext": "tokenmill.speculative.speculator",
    "ToolCall": "tokenmill.parsers.tool_parser",
    "ToolParser": "tokenmill.parsers.tool_parser",
    "StructuredOutputBackend": "tokenmill.structured_output.backend",
    "StructuredOutputGrammar": "tokenmill.structured_output.backend",
    "Speculator": "tokenmill.speculative.speculator",
    "Transport": "tokenmill.transport.base",
    "TransportSecurity": "tokenmill.transport.base",
    "WeightFormat": "tokenmill.weights.format",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
