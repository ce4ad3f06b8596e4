"""The ZeroMQ KV connector: blocks pushed by a prefill engine arrive bit-exact at the decode engine's tier."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tokenmill_plugins.kv_tiers.zmq_connector import ZmqPullKVTier, ZmqPushKVTier


def _arrived(tier: ZmqPullKVTier, block_hash: bytes, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tier.contains(block_hash):
            return True
        time.sleep(0.01)
    return False


def test_pushed_blocks_arrive_bit_exact_and_foreign_ones_are_rejected(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/kv.sock"
    pull = ZmqPullKVTier(capacity_bytes=1 << 20, fingerprint="model-a", path=address)
    push = ZmqPushKVTier(capacity_bytes=1 << 20, fingerprint="model-a", path=address)
    foreign = ZmqPushKVTier(capacity_bytes=1 << 20, fingerprint="model-b", path=address)
    try:
        blocks = {
            b"f16": torch.randn(2, 2, 4, 1, 8).half(),
            b"bf16": torch.randn(2, 2, 4, 1, 8).bfloat16(),
            b"f32": torch.randn(2, 2, 4, 1, 8),
        }
        for block_hash, block in blocks.items():
            assert push.store(block_hash, block) == []
            assert not push.contains(block_hash) and push.fetch(block_hash) is None  # it keeps nothing
        for block_hash, block in blocks.items():
            assert _arrived(pull, block_hash)
            got = pull.fetch(block_hash)
            assert got is not None and got.dtype == block.dtype and got.shape == block.shape
            assert torch.equal(got.view(torch.uint8), block.view(torch.uint8))
        foreign.store(b"other", torch.zeros(2, 2, 4, 1, 8))
        assert not _arrived(pull, b"other", timeout_s=0.5)
        assert pull.stats.rejected == 1
        assert push.stats.bytes_written == sum(b.numel() * b.element_size() for b in blocks.values())
    finally:
        for tier in (push, foreign, pull):
            tier.close()
