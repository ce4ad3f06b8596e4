"""Registers the built-in sampler and logits processors (no torch imported here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_samplers(register: Register) -> None:
    register("torch", "tokenmill.sampling.sampler:TorchSampler")


@hookimpl
def tokenmill_register_logits_processors(register: Register) -> None:
    register("logit_bias", "tokenmill.sampling.logits_processor:LogitBiasLogitsProcessor")
    register("min_tokens", "tokenmill.sampling.logits_processor:MinTokensLogitsProcessor")
