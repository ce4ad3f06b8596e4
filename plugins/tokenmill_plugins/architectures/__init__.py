"""Architectures plugin: Gemma 2 and 3 (text), Phi-3 / Phi-4, and the mixtures of experts Qwen3-MoE, Mixtral and
OLMoE, each built from the core's Llama-family parts and building blocks; and ``transformers``, the fallback that
runs any other decoder through transformers' own model class on tokenmill's paged KV cache."""
