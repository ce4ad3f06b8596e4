"""The collectives of ``TensorParallelGroup`` between two real processes: shared memory for small CPU
tensors, gloo for the rest, and a peer that dies mid-collective."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tokenmill.parallel import shm

pytestmark = pytest.mark.multiproc

# Each rank: join the group, then all-reduce and gather a small tensor (shared memory) and a large one (gloo),
# printing what it got as JSON. With "die", rank 1 exits instead of joining the second collective.
_RANK_SCRIPT = """
import json, os, sys, torch
from tokenmill.parallel import shm
from tokenmill.parallel.group import connect, tcp_store
rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = tcp_store("127.0.0.1", port, 2, is_master=rank == 0)
if rank == 0:
    print(store.port, flush=True)
group = connect(rank, 2, store, torch.device("cpu"))
small = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) + 0.1
large = torch.full((shm.SLOT_BYTES // 4 + 1,), float(rank + 1))
result = {"has_channel": group.channel is not None}
result["small_sum"] = group.all_reduce(small.clone()).tolist()
result["small_gather"] = group.gather_last_dim(small.clone()).tolist()
if mode == "die":
    if rank == 1:
        os._exit(0)
    try:
        group.all_reduce(torch.ones(3))  # shared memory: rank 0 waits for a peer that is gone
    except RuntimeError as exc:
        result["error"] = str(exc)
    print(json.dumps(result), flush=True)
    sys.exit(0)
try:
    result["large_sum"] = group.all_reduce(large.clone())[:3].tolist()
    result["large_gather_shape"] = list(group.gather_last_dim(large.clone()[None]).shape)
    result["after"] = group.all_reduce(torch.ones(3)).tolist()
finally:
    print(json.dumps(result), flush=True)
"""


def _run(mode: str) -> list[dict]:
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, "0", "0", mode], stdout=subprocess.PIPE, text=True)
    assert rank0.stdout is not None
    port = rank0.stdout.readline().strip()
    rank1 = subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, "1", port, mode], stdout=subprocess.PIPE, text=True)
    outputs = [rank0.communicate(timeout=120)[0], rank1.communicate(timeout=120)[0]]
    return [json.loads(output.strip().splitlines()[-1]) if output.strip() else {} for output in outputs]


def test_collectives_over_shared_memory_and_gloo() -> None:
    rank0, rank1 = _run("ok")
    assert rank0["has_channel"] and rank1["has_channel"]
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    mine, theirs = base + 0.1, base * 2 + 0.1
    for result in (rank0, rank1):
        torch.testing.assert_close(torch.tensor(result["small_sum"]), mine + theirs)
        assert result["large_sum"] == [3.0, 3.0, 3.0]  # over gloo: the tensor is larger than a slot
        assert result["after"] == [2.0, 2.0, 2.0]  # shared memory again, after a gloo collective
    assert rank0["small_sum"] == rank1["small_sum"]  # both ranks add in rank order: bitwise equal
    # Rank 0 gets both halves side by side; the other rank keeps its own.
    torch.testing.assert_close(torch.tensor(rank0["small_gather"]), torch.cat([mine, theirs], dim=-1))
    torch.testing.assert_close(torch.tensor(rank1["small_gather"]), theirs)
    assert rank0["large_gather_shape"] == [1, 2 * (shm.SLOT_BYTES // 4 + 1)]


def test_a_dead_peer_fails_the_collective() -> None:
    """A rank waiting in shared memory for a peer that exited raises (instead of spinning for the timeout)."""
    rank0, _ = _run("die")
    assert "is gone" in rank0["error"]
