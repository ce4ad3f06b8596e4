"""The ``disk`` KV tier: the tier contract, bit-exact blocks across restarts, damaged files, I/O faults."""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenmill_plugins.kv_tiers import disk
from tokenmill_plugins.kv_tiers.disk import DiskKVTier

from tokenmill.testing import check_kv_tier

SHAPE = (2, 2, 4, 2, 8)  # [num_layers, 2, block_size, num_kv_heads, head_dim]: 256 elements
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
MakeTier = Callable[..., DiskKVTier]


def _block(i: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    block = torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(dtype)  # [2, 2, 4, 2, 8]
    flat = block.view(-1)
    # Values a lossy round trip would change: signed zero, infinities, a NaN, a subnormal.
    flat[:5] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan"), torch.finfo(dtype).tiny / 4])
    return block


def _hash(i: int) -> bytes:
    return bytes([i]) * 16


def _nbytes(block: torch.Tensor) -> int:
    return block.numel() * block.element_size()


def _bit_equal(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.dtype == b.dtype and torch.equal(a.view(BITS[b.dtype]), b.view(BITS[b.dtype]))


@pytest.fixture
def make_tier(tmp_path: Path) -> Iterator[MakeTier]:
    """Tiers on ``tmp_path`` (fingerprint ``m``, room for 8 float16 blocks unless told), closed at the end."""
    tiers: list[DiskKVTier] = []

    def make(capacity_bytes: int = 8 * _nbytes(_block(0)), fingerprint: str = "m") -> DiskKVTier:
        tiers.append(DiskKVTier(capacity_bytes=capacity_bytes, fingerprint=fingerprint, path=tmp_path))
        return tiers[-1]

    yield make
    for tier in tiers:
        tier.close()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every file write until the event is set (set at the end, so a failing test cannot hang)."""
    opened = threading.Event()
    write_file = disk._write_file

    def held(path: str, data: bytes) -> None:
        assert opened.wait(timeout=30)
        write_file(path, data)

    monkeypatch.setattr(disk, "_write_file", held)
    yield opened
    opened.set()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_disk_tier_passes_the_kv_tier_conformance_check(tmp_path: Path, dtype: torch.dtype) -> None:
    check_kv_tier(functools.partial(DiskKVTier, path=tmp_path), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_blocks_round_trip_bit_exactly_across_a_restart(make_tier: MakeTier, dtype: torch.dtype) -> None:
    blocks = [_block(i, dtype) for i in range(3)]
    tier = make_tier()
    for i, block in enumerate(blocks):
        reused = block.clone()
        tier.store(_hash(i), reused)
        reused.fill_(7)  # the caller reuses its buffer once store returns
    assert all(_bit_equal(tier.fetch(_hash(i)), block) for i, block in enumerate(blocks))
    tier.close()

    restarted = make_tier()
    assert all(restarted.contains(_hash(i)) for i in range(3))
    assert all(_bit_equal(restarted.fetch(_hash(i)), block) for i, block in enumerate(blocks))
    assert (restarted.stats.hits, restarted.stats.misses, restarted.stats.rejected) == (3, 0, 0)
    assert restarted.stats.bytes_read == sum(_nbytes(b) for b in blocks)
    assert restarted.num_bytes == sum(_nbytes(b) for b in blocks)  # read blocks count their K/V bytes


def test_another_fingerprint_on_the_same_path_sees_none_of_them(make_tier: MakeTier) -> None:
    tier = make_tier(fingerprint="model-a")
    tier.store(_hash(1), _block(1))
    tier.close()

    other = make_tier(fingerprint="model-b")
    assert not other.contains(_hash(1)) and other.fetch(_hash(1)) is None
    assert other.num_bytes == 0
    other.close()
    assert make_tier(fingerprint="model-a").contains(_hash(1))  # and it left them alone


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # the last byte of the payload
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign"])
def test_a_damaged_or_foreign_file_is_rejected_and_deleted(make_tier: MakeTier, tmp_path: Path, damage: str) -> None:
    tier = make_tier()
    tier.store(_hash(1), _block(1))
    tier.store(_hash(2), _block(2))
    tier.flush()
    path = tier.block_path(_hash(1))
    if damage == "corrupt":
        _corrupt(path)
    elif damage == "truncated":
        _truncate(path)
    else:  # a valid block of another model, under this model's name for it
        foreign = DiskKVTier(capacity_bytes=1 << 20, fingerprint="other", path=tmp_path / "elsewhere")
        foreign.store(_hash(1), _block(1))
        foreign.close()
        shutil.copyfile(foreign.block_path(_hash(1)), path)

    assert tier.contains(_hash(1))
    assert tier.fetch(_hash(1)) is None
    assert (tier.stats.rejected, tier.stats.errors, tier.stats.misses) == (1, 0, 1)
    assert not tier.contains(_hash(1))
    assert _bit_equal(tier.fetch(_hash(2)), _block(2))  # the others are unharmed
    tier.close()
    assert not path.exists()


def test_a_removed_directory_fails_reads_and_heals_on_the_next_write(
    make_tier: MakeTier, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier()
    tier.store(_hash(1), _block(1))
    tier.store(_hash(2), _block(2))
    tier.flush()
    shutil.rmtree(tmp_path)

    with caplog.at_level(logging.WARNING, logger=disk.__name__):
        assert tier.fetch(_hash(1)) is None and tier.fetch(_hash(2)) is None
        assert tier.stats.errors == 2 and not tier.contains(_hash(1)) and not tier.contains(_hash(2))
        tier.store(_hash(3), _block(3))  # recreates the directory
        tier.flush()
    assert [r.getMessage().count(os.strerror(errno.ENOENT)) for r in caplog.records] == [1]  # logged once
    assert tier.block_path(_hash(3)).exists() and tier.stats.errors == 2
    assert _bit_equal(tier.fetch(_hash(3)), _block(3))


def test_failing_writes_forget_their_blocks_warn_once_per_errno_and_recover(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier()
    failure: list[int] = []  # the errno the next writes fail with, if any
    write_file = disk._write_file

    def failing(path: str, data: bytes) -> None:
        if failure:
            raise OSError(failure[0], os.strerror(failure[0]), path)
        write_file(path, data)

    monkeypatch.setattr(disk, "_write_file", failing)
    with caplog.at_level(logging.WARNING, logger=disk.__name__):
        for i, code in [(1, errno.ENOSPC), (2, errno.ENOSPC), (3, errno.EROFS), (4, errno.EROFS)]:
            failure[:] = [code]
            assert tier.store(_hash(i), _block(i)) == []  # never raises, never blocks
            tier.flush()
        failure.clear()
        tier.store(_hash(5), _block(5))
        tier.flush()

    assert tier.stats.errors == 4
    assert not any(tier.contains(_hash(i)) for i in range(1, 5))
    assert all(tier.fetch(_hash(i)) is None for i in range(1, 5))
    assert not any(tier.block_path(_hash(i)).exists() for i in range(1, 5))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert os.strerror(errno.ENOSPC) in warnings[0] and os.strerror(errno.EROFS) in warnings[1]
    assert tier.block_path(_hash(5)).exists() and _bit_equal(tier.fetch(_hash(5)), _block(5))
    assert tier.num_bytes == _nbytes(_block(5))


def test_past_capacity_the_least_recently_used_file_is_deleted(make_tier: MakeTier) -> None:
    tier = make_tier(capacity_bytes=3 * _nbytes(_block(0)))
    for i in range(3):
        tier.store(_hash(i), _block(i))
    tier.flush()
    assert tier.fetch(_hash(0)) is not None  # block 1 is now the least recently used

    assert tier.store(_hash(3), _block(3)) == []  # a disk tier passes nothing on
    tier.close()

    assert [tier.block_path(_hash(i)).exists() for i in range(4)] == [True, False, True, True]
    assert not tier.contains(_hash(1)) and tier.num_bytes == tier.capacity_bytes


def test_a_block_larger_than_the_capacity_is_refused(make_tier: MakeTier) -> None:
    tier = make_tier(capacity_bytes=_nbytes(_block(0)) - 1)
    assert tier.store(_hash(1), _block(1)) == [] and not tier.contains(_hash(1))
    assert tier.stats.rejected == 1


def test_a_restart_over_capacity_keeps_the_most_recently_used_blocks(make_tier: MakeTier) -> None:
    # 4 KiB blocks, so a file's header (a few hundred bytes, counted until the block is read) is small beside it.
    big = [torch.full((2, 2, 4, 2, 32), float(i)) for i in range(5)]  # float32: 4096 bytes each
    tier = make_tier(capacity_bytes=10 * 4096)
    for i, block in enumerate(big):
        tier.store(_hash(i), block)
    tier.close()
    for i in range(5):
        os.utime(tier.block_path(_hash(i)), (1_000_000 + i, 1_000_000 + i))  # written in order, long ago
    leftover = tier.block_path(_hash(0)).with_name("interrupted.tmp")
    leftover.write_bytes(b"half a block")
    os.utime(leftover, (1_000_000, 1_000_000))  # a crashed writer's, long ago
    in_progress = tier.block_path(_hash(1)).with_name("another-engine-writing.tmp")
    in_progress.write_bytes(b"a block being written right now")

    reader = make_tier(capacity_bytes=10 * 4096)
    assert _bit_equal(reader.fetch(_hash(0)), big[0])  # a hit: block 0 becomes the most recent, on disk too
    reader.close()
    small = make_tier(capacity_bytes=5 * 4096 // 2)  # room for two and a half

    assert [small.contains(_hash(i)) for i in range(5)] == [True, False, False, False, True]
    assert _bit_equal(small.fetch(_hash(4)), big[4])
    small.close()
    assert [tier.block_path(_hash(i)).exists() for i in range(5)] == [True, False, False, False, True]
    assert not leftover.exists()
    assert in_progress.exists()  # a fresh temporary file may be a live engine's on the same directory


def test_a_stored_block_is_served_before_its_file_is_written(make_tier: MakeTier, gate: threading.Event) -> None:
    tier = make_tier()
    block = _block(1)
    tier.store(_hash(1), block)

    assert not tier.block_path(_hash(1)).exists()  # the writer is held by the gate
    assert tier.contains(_hash(1)) and _bit_equal(tier.fetch(_hash(1)), block)
    gate.set()
    tier.close()
    assert tier.block_path(_hash(1)).exists()
    assert _bit_equal(make_tier().fetch(_hash(1)), block)


def test_stores_past_the_pending_limit_are_dropped_not_waited_for(
    make_tier: MakeTier, gate: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk, "MAX_PENDING_BYTES", 2 * _nbytes(_block(0)))
    tier = make_tier()
    for i in range(3):
        assert tier.store(_hash(i), _block(i)) == []  # returns although nothing is written yet

    assert tier.stats.rejected == 1 and [tier.contains(_hash(i)) for i in range(3)] == [True, True, False]
    gate.set()
    tier.close()
    assert [tier.block_path(_hash(i)).exists() for i in range(3)] == [True, True, False]


def test_a_process_that_exits_without_close_still_writes_its_queue(tmp_path: Path) -> None:
    script = (
        "import torch\n"
        "from tokenmill_plugins.kv_tiers.disk import DiskKVTier\n"
        f"tier = DiskKVTier(capacity_bytes=1 << 20, fingerprint='m', path={str(tmp_path)!r})\n"
        "for i in range(20):\n"
        "    tier.store(bytes([i]) * 16, torch.full((2, 2, 4, 2, 8), float(i)))\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)

    tier = DiskKVTier(capacity_bytes=1 << 20, fingerprint="m", path=tmp_path)
    assert all(tier.contains(_hash(i)) for i in range(20))
    assert _bit_equal(tier.fetch(_hash(19)), torch.full(SHAPE, 19.0))
    tier.close()


def test_prefetch_reads_in_the_background_and_says_when_the_blocks_are_in_memory(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    for i in range(3):
        tier.store(_hash(i), _block(i))
    tier.close()
    reader = make_tier()
    released = threading.Event()
    read = reader._read

    def slow_read(block_hash: bytes) -> torch.Tensor | None:
        released.wait(5)
        return read(block_hash)

    monkeypatch.setattr(reader, "_read", slow_read)
    hashes = [_hash(i) for i in range(3)]
    assert reader.prefetch(hashes) is False  # reading has started, nothing is in memory yet
    assert reader.prefetch(hashes) is False  # asking again starts no second read
    released.set()
    deadline = time.monotonic() + 5
    while not reader.prefetch(hashes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.prefetch(hashes)
    monkeypatch.setattr(reader, "_read", lambda block_hash: pytest.fail("fetch read the file again"))
    assert all(_bit_equal(reader.fetch(_hash(i)), _block(i)) for i in range(3))
    assert reader.stats.hits == 3 and reader.stats.bytes_read == 3 * _nbytes(_block(0))


def test_a_block_that_fails_its_check_while_prefetched_is_forgotten(make_tier: MakeTier) -> None:
    tier = make_tier()
    tier.store(_hash(0), _block(0))
    tier.close()
    path = tier.block_path(_hash(0))
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    reader = make_tier()
    deadline = time.monotonic() + 5
    while not reader.prefetch([_hash(0)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not reader.contains(_hash(0)) and reader.fetch(_hash(0)) is None
    assert reader.stats.rejected == 1
