"""``TensorParallelGroup``: one replica's shards and the collectives the sharded model calls.

Each shard is a process with a rank in ``0..size-1``; rank 0 is the engine process. The group is a
``torch.distributed`` process group of its own (gloo on CPU, NCCL on GPU), built from a store rather
than through ``init_process_group``, so a process may hold several engines (tests, offline use) and
nothing global is set. CPU shards (always on one host) also share a memory segment through which the
small collectives of decode steps go (``tokenmill.parallel.shm``); larger tensors, and every collective
on GPUs, go through the process group.
"""

from __future__ import annotations

import datetime
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.parallel import shm

logger = logging.getLogger(__name__)

#: How long a collective waits for the other shards. A shard is at most one layer behind another, so this
#: only bounds how long a hung (not dead: a dead peer fails at once) shard stalls the others.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place among a replica's shards; called by the model in every forward."""

    rank: int
    size: int
    #: A c10d backend (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) used directly; None when size is 1.
    process_group: Any
    #: CPU shards on one host: small tensors meet in shared memory instead of gloo's loopback socket.
    channel: shm.SharedMemoryChannel | None = None
    #: Mixture-of-experts layers hold whole experts, split round-robin over the shards, instead of a slice of
    #: every expert (``parallel.enable_expert_parallel``).
    expert_parallel: bool = False

    @property
    def is_driver(self) -> bool:
        """Whether this shard samples (rank 0: it gets the gathered logits)."""
        return self.rank == 0

    def shard_range(self, total: int) -> tuple[int, int]:
        """The ``[start, end)`` of this rank's equal share of ``total`` (which the size divides)."""
        assert total % self.size == 0, f"{total} does not split into {self.size} shards"
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def local_experts(self, num_experts: int) -> range:
        """The ids of the experts this shard holds whole: every ``size``-th from ``rank`` with expert parallelism
        (expert ``e`` is on shard ``e % size``, its ``e // size``-th), all of them (each sliced) without it."""
        return range(self.rank, num_experts, self.size) if self.expert_parallel else range(num_experts)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the shards, in place; returns it (row-parallel outputs, the embedding)."""
        if self.channel is not None and self.channel.fits(tensor) and tensor.is_contiguous():
            return self.channel.all_reduce(tensor)
        if self.process_group is not None:
            self.process_group.allreduce([tensor]).wait()
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """The shards' ``tensor`` concatenated along the last dimension, on rank 0 (vocab-parallel logits).
        Other ranks get their own shard back: nothing samples there."""
        if self.process_group is None:
            return tensor
        tensor = tensor.contiguous()
        if self.channel is not None and self.channel.fits(tensor):
            gathered = self.channel.gather_last_dim(tensor)
            return gathered if self.is_driver else tensor
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.is_driver else []
        self.process_group.gather(outputs, [tensor], options).wait()
        return torch.cat(outputs[0], dim=-1) if self.is_driver else tensor


def single_process_group() -> TensorParallelGroup:
    """The group of an unsharded model: every collective is a no-op."""
    return TensorParallelGroup(rank=0, size=1, process_group=None)


def connect(
    rank: int,
    size: int,
    store: Any,
    device: torch.device,
    timeout: datetime.timedelta = COLLECTIVE_TIMEOUT,
) -> TensorParallelGroup:
    """Join the replica's group through ``store`` (rank 0 hosts it): gloo on CPU, NCCL on GPU. Blocks until
    every rank has joined, then runs one collective, so a bad setup fails here rather than in the first step."""
    if device.type == "cuda":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("this torch build has no NCCL; tensor parallelism on GPUs needs it")
        process_group: Any = nccl(store, rank, size)
    else:
        process_group = dist.ProcessGroupGloo(store, rank, size, timeout)
    group = TensorParallelGroup(rank=rank, size=size, process_group=process_group)
    group.all_reduce(torch.zeros(1, device=device))
    if device.type == "cpu":
        channel = _open_channel(rank, size, store, timeout)
        group.all_reduce(torch.zeros(1, device=device))  # every rank has mapped the segment, or none uses it
        if rank == 0 and channel is not None:
            os.unlink(channel.path)  # gone from the filesystem now: nothing is left behind, however we exit
        group = TensorParallelGroup(rank=rank, size=size, process_group=process_group, channel=channel)
    return group


def _open_channel(rank: int, size: int, store: Any, timeout: datetime.timedelta) -> shm.SharedMemoryChannel | None:
    """Rank 0 creates the shared-memory segment and names it in the store; every rank maps it. None (gloo for
    every collective) where the machine does not support it or the segment cannot be made."""
    store.set(f"tokenmill/pid/{rank}", str(os.getpid()))
    if rank == 0:
        path = ""
        if shm.is_supported():
            candidate = f"/dev/shm/tokenmill-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            try:
                with open(candidate, "wb") as segment:
                    segment.truncate(shm.segment_bytes(size))
                path = candidate
            except OSError as exc:
                logger.warning(
                    "tensor parallelism: no shared-memory segment (%s); every collective goes over gloo", exc
                )
        store.set("tokenmill/shm", path)
    path = store.get("tokenmill/shm").decode()
    if not path:
        return None
    pids = [int(store.get(f"tokenmill/pid/{r}")) for r in range(size)]
    return shm.SharedMemoryChannel(path, rank, size, pids, timeout.total_seconds())


def tcp_store(
    host: str, port: int, size: int, is_master: bool, timeout: datetime.timedelta = COLLECTIVE_TIMEOUT
) -> Any:
    """The store the shards meet at: rank 0 hosts it (``port`` 0 picks a free one, read back as ``.port``)."""
    store_class: Any = getattr(dist, "TCPStore")  # noqa: B009  (not in torch's type stubs' exports)
    return store_class(host, port, size, is_master=is_master, timeout=timeout, wait_for_workers=False)
