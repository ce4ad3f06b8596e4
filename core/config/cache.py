"""The paged KV cache's geometry."""

from __future__ import annotations

from typing import Annotated

import msgspec

from tokenmill.config.base import ConfigSection, describe


class CacheConfig(ConfigSection):
    block_size: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=256)],
        describe("Tokens per KV cache block: a power of two from 1 to 256."),
    ] = 16

    def __post_init__(self) -> None:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two (8, 16, 32, ...), got {self.block_size}")
