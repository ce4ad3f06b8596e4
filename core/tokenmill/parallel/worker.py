"""A tensor-parallel worker process: shard ``rank`` of a replica's model, driven by rank 0 over its stdin.

It reads a ``ShardStart`` (config, rank, where the group's store is), loads its shard of the model
(joining the group on the way), reads a ``ShardSetup`` (the KV cache's size), and then runs each
``ShardStep``'s forward and each ``ShardCopyBlocks`` until ``ShardStop`` or the end of its stdin (rank 0
is gone). Logs go to the engine's stderr, labelled with the shard.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import struct
import sys
from typing import BinaryIO

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the engine) dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed stdin still ends the worker
        pass


def _read_frame(stream: BinaryIO) -> bytes | None:
    """The next length-prefixed frame, or None at the end of the stream."""
    header = stream.read(4)
    if len(header) < 4:
        return None
    (length,) = struct.unpack("<I", header)
    frame = stream.read(length)
    return frame if len(frame) == length else None


def run_shard_worker_process() -> None:
    """Entry point of a worker process (started by ``tokenmill.parallel.shards.ShardWorkers``)."""
    import msgspec

    from tokenmill.config import EngineConfig
    from tokenmill.messages import ShardCopyBlocks, ShardSetup, ShardStart, ShardStep, ShardStop
    from tokenmill.model_loader import load_model
    from tokenmill.model_runner import ModelRunner
    from tokenmill.parallel.group import TensorParallelGroup, connect, tcp_store
    from tokenmill.plugin_manager import FRONT_END_SLOTS, resolve_plugins
    from tokenmill.step_batch import SequenceChunk
    from tokenmill.transport.serde import decode_to_shard

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the engine's to handle; it stops us
    stream = sys.stdin.buffer
    frame = _read_frame(stream)
    if frame is None:
        return
    start = decode_to_shard(frame)
    assert isinstance(start, ShardStart)
    rank = start.rank
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s shard {rank}: %(message)s")
    _set_process_title(f"tokenmill-shard-{rank}")
    config = msgspec.convert(start.config, EngineConfig)
    size = config.parallel.tensor_parallel_size
    plugins = resolve_plugins(config, skip=FRONT_END_SLOTS)

    import torch

    def join(device: torch.device) -> TensorParallelGroup:
        store = tcp_store(start.store_host, start.store_port, size, is_master=False)
        stores.append(store)  # alive as long as the group
        if device.type == "cuda":
            torch.cuda.set_device(rank)
        store.set(f"tokenmill/joined/{rank}", "1")
        return connect(rank, size, store, device)

    stores: list[object] = []
    loaded = load_model(config, plugins, join)
    frame = _read_frame(stream)
    if frame is None:
        return
    setup = decode_to_shard(frame)
    assert isinstance(setup, ShardSetup)
    runner = ModelRunner(loaded, setup.num_blocks, setup.block_size)
    logger.info("shard %d of %d ready", rank, size)
    while (frame := _read_frame(stream)) is not None:
        message = decode_to_shard(frame)
        if isinstance(message, ShardStep):
            chunks = [
                SequenceChunk(c.token_ids, c.num_computed_tokens, c.block_ids, c.draft_parents) for c in message.chunks
            ]
            runner.execute(chunks, message.all_logits, message.logits_indices)
        elif isinstance(message, ShardCopyBlocks):
            runner.copy_blocks(message.copies)
        elif isinstance(message, ShardStop):
            break


def _set_process_title(title: str) -> None:
    try:
        import setproctitle  # type: ignore[import-not-found]

        setproctitle.setproctitle(title)
    except ImportError:
        pass
