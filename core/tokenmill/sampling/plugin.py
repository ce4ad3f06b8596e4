"""Registers the built-in sampler and logits processors (no torch imported here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl

#: The processors that implement ``SamplingParams`` fields: the engine always builds them, before the ones
#: ``sampler.logits_processors`` adds.
BUILTIN_LOGITS_PROCESSORS: tuple[str, ...] = ("logit_bias", "min_tokens")


@hookimpl
def tokenmill_register_samplers(register: Register) -> None:
    register("torch", "tokenmill.sampling.sampler:TorchSampler")


@hookimpl
def tokenmill_register_logits_processors(register: Register) -> None:
    register("logit_bias", "tokenmill.sampling.logits_processor:LogitBiasLogitsProcessor")
    register("min_tokens", "tokenmill.sampling.logits_processor:MinTokensLogitsProcessor")
