"""``zmq-push`` and ``zmq-pull``: the default KV connector of disaggregated prefill, as a pair of KV tiers.

A KV connector moves a prompt's KV blocks from a prefill engine to a decode
engine. To each engine it looks like a KV tier, so it needs no interface of its
own and another transport plugs in the same way (a ``KVTier`` pair):

- on the prefill engine, ``zmq-push`` is a ``completion`` tier: when a request
  finishes, the engine hands it every full block it computed, and the tier
  sends each, with its hash and the engine's KV fingerprint, down a ZeroMQ PUSH
  socket connected to ``path`` (an address: ``ipc:///run/kv.sock``,
  ``tcp://decode-host:5600``). It keeps nothing, so it never hits;
- on the decode engine, ``zmq-pull`` binds a PULL socket at the same address
  and keeps what arrives in host memory (least recently used evicted past its
  capacity). It is a ``none`` tier: this engine never writes to it. A prefix
  lookup finds the blocks there like in any tier; blocks of another
  fingerprint (another model) are rejected and counted.

``tokenmill serve --disaggregated-prefill`` sets both up; docs/kv_cache.md#disaggregated-prefill.
The tcp transport is unauthenticated: keep it on a trusted network.
"""

from __future__ import annotations

import logging
import os
from typing import ClassVar

import safetensors.torch
import torch
import zmq

from tokenmill.kv_cache.tier import KVTier, WritePolicy
from tokenmill_plugins.kv_tiers.cpu import CPUKVTier

logger = logging.getLogger(__name__)

#: Blocks queued for sending before a store is dropped (counted in ``rejected``) rather than block the engine.
SEND_HIGH_WATER_MARK = 4096


class ZmqPushKVTier(KVTier):
    """The sending end: every block the engine stores is sent to the decode engine at ``path``."""

    name: ClassVar[str] = "zmq-push"
    default_write: ClassVar[WritePolicy] = "completion"
    takes_path: ClassVar[bool] = True

    def __init__(self, capacity_bytes: int, fingerprint: str = "", *, path: str) -> None:
        super().__init__(capacity_bytes, fingerprint)
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 5000)  # at close, give queued blocks 5 s to leave
        self._socket.connect(path)

    def contains(self, block_hash: bytes) -> bool:
        return False  # it keeps nothing: every finished request's blocks are sent

    def store(self, block_hash: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        data = safetensors.torch.save({"kv": block.detach().to("cpu").contiguous()})  # dtype and shape travel too
        try:
            self._socket.send_multipart([self.fingerprint.encode(), block_hash, data], flags=zmq.NOBLOCK)
        except zmq.Again:  # the decode engine is not keeping up (or not there): it will compute these itself
            self.stats.rejected += 1
            return []
        self.stats.bytes_written += block.numel() * block.element_size()
        return []

    def fetch(self, block_hash: bytes) -> torch.Tensor | None:
        self.stats.misses += 1
        return None

    def close(self) -> None:
        self._socket.close()


class ZmqPullKVTier(CPUKVTier):
    """The receiving end: blocks sent to ``path`` by a prefill engine, in host memory within ``capacity_bytes``."""

    name: ClassVar[str] = "zmq-pull"
    default_write: ClassVar[WritePolicy] = "none"
    takes_path: ClassVar[bool] = True

    def __init__(self, capacity_bytes: int, fingerprint: str = "", *, path: str) -> None:
        super().__init__(capacity_bytes, fingerprint)
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        if path.startswith("ipc://"):
            os.makedirs(os.path.dirname(path.removeprefix("ipc://")) or ".", exist_ok=True)
        self._socket.bind(path)

    def _drain(self) -> None:
        """Take every block that has arrived, without waiting."""
        while True:
            try:
                frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                fingerprint, block_hash, data = frames
                if fingerprint.decode() != self.fingerprint:
                    raise ValueError("a block of another model or KV layout (fingerprint differs)")
                block = safetensors.torch.load(data)["kv"]
            except Exception as exc:  # malformed (safetensors' own errors included) or foreign: never used
                self.stats.rejected += 1
                logger.debug("zmq-pull: dropping a malformed or foreign block: %s", exc)
                continue
            super().store(block_hash, block)

    def contains(self, block_hash: bytes) -> bool:
        self._drain()
        return super().contains(block_hash)

    def fetch(self, block_hash: bytes) -> torch.Tensor | None:
        self._drain()
        return super().fetch(block_hash)

    def close(self) -> None:
        super().close()
        self._socket.close()
