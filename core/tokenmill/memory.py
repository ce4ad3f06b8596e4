"""How much memory there is, and how many KV blocks a budget buys."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tokenmill.attention.kv_quant import kv_row_size
from tokenmill.config.cache import CacheConfig, parse_memory

logger = logging.getLogger(__name__)

_CPU_AUTO_FRACTION = 0.25
_CPU_AUTO_CAP = 4 * 2**30
_GPU_AUTO_FRACTION = 0.9


@dataclass(frozen=True)
class CacheLayout:
    """The KV cache as sized at start-up (a result, never written back into the config)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_kv_cache(
    config: CacheConfig,
    device: torch.device,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> CacheLayout:
    """Size the KV cache from the config's budget. Raises ValueError when it cannot hold one block.

    A block's bytes are what the cache tensors hold: a quantized ``dtype`` (``fp8``, ``int8``) counts its
    per-row scales too, so a budget holds about twice the tokens of float16, not exactly twice."""
    element_size = torch.empty((), dtype=dtype).element_size()
    row_bytes = kv_row_size(head_dim, dtype) * element_size  # one token's K (or V) for one KV head
    bytes_per_block = 2 * num_layers * config.block_size * num_kv_heads * row_bytes
    if config.num_kv_blocks is not None:
        return CacheLayout(config.num_kv_blocks, config.block_size, bytes_per_block)
    if config.kv_cache_memory == "auto":
        free = available_memory(device)
        budget = (
            int(free * _GPU_AUTO_FRACTION)
            if device.type == "cuda"
            else min(int(free * _CPU_AUTO_FRACTION), _CPU_AUTO_CAP)
        )
    else:
        size, fraction = parse_memory(config.kv_cache_memory)
        budget = size if size is not None else int(available_memory(device) * (fraction or 0))
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"cache.kv_cache_memory={config.kv_cache_memory!r} gives {budget} bytes, less than one KV block "
            f"({bytes_per_block} bytes); raise it or lower cache.block_size"
        )
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, config.block_size, budget / 2**20)
    return CacheLayout(num_blocks, config.block_size, bytes_per_block)
