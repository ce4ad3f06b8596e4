"""``SharedMemoryChannel``: all-reduce and gather of small CPU tensors between the shards of one host.

gloo moves every collective through a TCP loopback socket, far slower than the small tensors need, and
a sharded layer makes two of them. Shards on one host can instead meet in a shared
memory segment (SGLang and vLLM's CPU backends do the same): each rank copies its tensor into its own
slot, publishes a sequence number in its flag, waits until every rank has published the same number,
and reads the others' slots. Every rank adds the slots in rank order, so all ranks hold bitwise equal
sums. Slots are double-buffered: a rank writes a buffer again two collectives later, by which time
every other rank has passed the collective in between, so it has finished reading.

Ordering relies on x86's total store order (a slot's bytes are stored before its flag and loaded after
it); ``is_supported`` says whether this machine has it. A rank waiting for a peer that died notices
within milliseconds (it checks the peers' processes while it waits) and raises ``RuntimeError``.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy
import torch

#: Bytes of one rank's slot: a tensor larger than this goes over gloo instead. 4 MiB holds the hidden
#: states of 256 tokens at hidden size 4096, or one decode step's logits of 16 requests over 64k vocab.
SLOT_BYTES = 4 * 2**20
_FLAG_STRIDE = 8  # int64s between two ranks' flags: each flag on a cache line of its own
_SPINS_BEFORE_YIELD = 64


def is_supported() -> bool:
    """Whether this machine orders stores as the channel needs (x86) and has a shared-memory filesystem."""
    return platform.machine().lower() in ("x86_64", "amd64") and Path("/dev/shm").is_dir()


def segment_bytes(size: int) -> int:
    return size * _FLAG_STRIDE * 8 + 2 * size * SLOT_BYTES


class SharedMemoryChannel:
    """One rank's view of the segment at ``path`` (created and sized by rank 0 before the others map it)."""

    def __init__(self, path: str, rank: int, size: int, peer_pids: list[int], timeout_s: float) -> None:
        self.path = path
        self.rank = rank
        self.size = size
        self.peer_pids = [pid for r, pid in enumerate(peer_pids) if r != rank]
        self.timeout_s = timeout_s
        segment = torch.from_file(path, shared=True, size=segment_bytes(size), dtype=torch.uint8)
        num_flag_bytes = size * _FLAG_STRIDE * 8
        self._flags = segment[:num_flag_bytes].numpy().view(numpy.int64)[::_FLAG_STRIDE]  # [size], shared
        self._slots = segment[num_flag_bytes:].view(2, size, SLOT_BYTES)  # [buffer, rank, bytes]
        self._seq = int(self._flags[rank])

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous, CPU, ``fits``) over the ranks, in place."""
        slots = self._exchange(tensor)
        tensor.copy_(slots[0])
        for other in slots[1:]:
            tensor.add_(other)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all) concatenated along the last dimension, in rank order."""
        return torch.cat(self._exchange(tensor), dim=-1)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``tensor`` in this rank's slot, wait for every rank's, and return views of all slots."""
        assert self.fits(tensor) and tensor.is_contiguous(), "the caller checks fits() and passes contiguous tensors"
        self._seq += 1
        buffer = self._slots[self._seq % 2]
        num_bytes = tensor.numel() * tensor.element_size()
        buffer[self.rank, :num_bytes].copy_(tensor.view(-1).view(torch.uint8))
        self._flags[self.rank] = self._seq  # after the slot's bytes (x86 keeps stores in order)
        self._wait(self._seq)
        return [buffer[r, :num_bytes].view(tensor.dtype).view(tensor.shape) for r in range(self.size)]

    def _wait(self, seq: int) -> None:
        flags = self._flags
        spins = 0
        deadline = None
        while (flags < seq).any():
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # let the peer run: on a busy machine it may share this core
            if spins % 1024 == 0:  # every millisecond or so
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise RuntimeError(
                        f"shared-memory collective {seq}: peers did not arrive in {self.timeout_s:.0f} s"
                    )
                for pid in self.peer_pids:
                    if not _is_running(pid):
                        raise RuntimeError(f"shared-memory collective {seq}: shard process {pid} is gone")


def _is_running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"
