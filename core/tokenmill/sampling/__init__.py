"""Sampling: the sampler interface and its torch implementation, and logits processors."""
