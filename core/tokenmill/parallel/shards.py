"""Rank 0's side of a tensor-parallel replica: the worker processes, and the runner that drives them.

The engine process is rank 0 and runs shard 0 itself; shards 1..N-1 each run in a worker process
(``tokenmill.parallel.worker``) that it starts. The engine tells the workers what to run over their
stdin (length-prefixed msgspec frames: ``ShardStep`` per step, ``ShardCopyBlocks`` for copy-on-write),
then runs the same forward; the collectives inside the model keep the shards in step, and the
logits are gathered on rank 0, where the sampler runs. Nothing comes back over the pipes.

Lifetimes: a worker exits when its stdin closes (the engine exited, however it died), and the kernel
kills it when the engine process dies (``PR_SET_PDEATHSIG``). The engine checks its workers before
every step, and a collective with a dead shard fails at once; either way the step raises a one-line
``TensorParallelError`` naming the shard, which stops the engine (a front end then restarts it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from typing import IO

import msgspec
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine_launcher import describe_exit
from tokenmill.messages import ShardChunk, ShardCopyBlocks, ShardSetup, ShardStart, ShardStep, ShardStop
from tokenmill.model_loader import LoadedModel
from tokenmill.model_runner import ModelRunner
from tokenmill.parallel.group import COLLECTIVE_TIMEOUT, TensorParallelGroup, connect, tcp_store
from tokenmill.parallel.sharding import TensorParallelError
from tokenmill.step_batch import SequenceChunk
from tokenmill.transport.serde import encode

logger = logging.getLogger(__name__)

#: In the command line of every worker process (``ps``, ``pgrep -f``).
PROCESS_LABEL = "tokenmill-shard"
_BOOTSTRAP = (
    "import os, sys; sys.path[:] = sys.argv[2].split(os.pathsep); "
    "from tokenmill.parallel.worker import run_shard_worker_process; run_shard_worker_process()"
)
_STOP_TIMEOUT_S = 5.0


def write_frame(stream: IO[bytes] | None, message: msgspec.Struct) -> None:
    """One message on a worker's stdin: its length (4 bytes, little-endian), then its msgpack bytes."""
    assert stream is not None, "workers are started with a pipe on stdin"
    frame = encode(message)
    stream.write(struct.pack("<I", len(frame)) + frame)
    stream.flush()


class ShardWorkers:
    """The worker processes of shards 1..size-1, started by rank 0 while it loads the model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.parallel.tensor_parallel_size
        self._popens: list[subprocess.Popen[bytes]] = []
        self._store: object = None  # rank 0 hosts the store the group was built from; kept for the group's life
        self._finalizer = weakref.finalize(self, _stop_all, self._popens)

    def connect(self, device: torch.device) -> TensorParallelGroup:
        """Start the workers and join them in one group (``load_model``'s ``connect``); blocks until all joined,
        raising ``TensorParallelError`` if a worker exits first."""
        store = tcp_store("127.0.0.1", 0, self.size, is_master=True)
        self._store = store
        config_data = self.config.to_dict()
        for rank in range(1, self.size):
            command = [sys.executable, "-c", _BOOTSTRAP, f"{PROCESS_LABEL}-{rank}", os.pathsep.join(sys.path)]
            popen = subprocess.Popen(command, stdin=subprocess.PIPE)
            self._popens.append(popen)
            try:
                write_frame(popen.stdin, ShardStart(config_data, rank, "127.0.0.1", store.port))
            except OSError:  # it died at once; the wait below says how
                pass
        # A worker that dies before it joins would leave the group's constructor waiting: watch them meanwhile.
        keys = [f"tokenmill/joined/{rank}" for rank in range(1, self.size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel workers did not join within {COLLECTIVE_TIMEOUT.total_seconds():.0f} s"
                )
            time.sleep(0.01)
        group = connect(0, self.size, store, device)
        logger.info("tensor parallelism: %d shards, workers %s", self.size, [p.pid for p in self._popens])
        return group

    def send(self, message: msgspec.Struct) -> None:
        """Send every worker ``message``; ``TensorParallelError`` if one is gone."""
        for rank, popen in enumerate(self._popens, start=1):
            try:
                write_frame(popen.stdin, message)
            except OSError:
                self.check_alive()
                raise TensorParallelError(f"tensor-parallel shard {rank} (pid {popen.pid}) stopped reading") from None

    def check_alive(self) -> None:
        """Raise ``TensorParallelError`` naming the first worker that exited. Cheap (one waitpid each)."""
        for rank, popen in enumerate(self._popens, start=1):
            if popen.poll() is not None:
                raise TensorParallelError(
                    f"tensor-parallel shard {rank} (pid {popen.pid}) {describe_exit(popen.returncode)}; "
                    "the engine cannot run without it"
                )

    @property
    def pids(self) -> list[int]:
        return [popen.pid for popen in self._popens]

    def stop(self) -> None:
        """Ask the workers to exit, wait a little, then kill what is left; reaps them all. Idempotent."""
        self._finalizer()


def _stop_all(popens: list[subprocess.Popen[bytes]]) -> None:
    for popen in popens:
        if popen.poll() is None and popen.stdin is not None:
            try:
                write_frame(popen.stdin, ShardStop())
                popen.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for popen in popens:
        try:
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


class ShardedModelRunner(ModelRunner):
    """Rank 0's model runner over a sharded model: each call is sent to the workers, then run here; the
    collectives in the forward keep the shards together. Its cache holds shard 0's KV heads."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, workers: ShardWorkers) -> None:
        self.workers = workers
        workers.send(ShardSetup(num_blocks, block_size))
        super().__init__(loaded, num_blocks, block_size)

    # Both execute and execute_with_hidden run _hidden (the forward) and then _logits (the gather of logits).
    def _hidden(
        self,
        chunks: list[SequenceChunk],
        all_logits: bool,
        logits_indices: list[int] | None,
        device_input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # The workers get token ids from the chunks: no input ids on the device (async scheduling is off here).
        assert device_input_ids is None, "tensor parallelism runs without async scheduling"
        self.workers.check_alive()
        shard_chunks = [ShardChunk(c.token_ids, c.num_computed_tokens, c.block_ids, c.draft_parents) for c in chunks]
        self.workers.send(ShardStep(shard_chunks, logits_indices, all_logits))
        with self._shard_failures():
            return super()._hidden(chunks, all_logits, logits_indices)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._shard_failures():
            return super()._logits(hidden)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.workers.send(ShardCopyBlocks(copies))
        super().copy_blocks(copies)

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        raise TensorParallelError("KV tiers do not run with tensor_parallel_size > 1")

    def write_blocks(self, blocks: list[tuple[int, torch.Tensor]]) -> None:
        raise TensorParallelError("KV tiers do not run with tensor_parallel_size > 1")

    @contextlib.contextmanager
    def _shard_failures(self) -> Iterator[None]:
        """Turn a collective's failure (gloo, NCCL) into the shard's death, when that is what it was."""
        try:
            yield
        except RuntimeError as exc:
            deadline = time.monotonic() + 1.0  # the peer's socket closes as its process exits: let it finish dying
            while time.monotonic() < deadline:
                try:
                    self.workers.check_alive()
                except TensorParallelError as dead:
                    raise dead from exc
                time.sleep(0.02)
            raise
