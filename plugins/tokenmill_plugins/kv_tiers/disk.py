"""``disk``: KV blocks in a local directory, so a restarted engine finds the prefixes it computed before.

Layout: one directory per KV fingerprint (model files, dtypes, block geometry: computed by the
engine), so blocks of other models never meet, fanned out by the first two hex digits of the hash::

    <path>/<fingerprint or "default">/<hash[:2]>/<block hash hex>.safetensors

(a fingerprint that is not a plain file name is replaced by a digest of it).

Each file is a safetensors file holding one tensor ``"kv"`` and the metadata ``format``
(``tokenmill-kv-block``), ``version`` (``1``), ``fingerprint``, ``block_hash`` (hex) and ``checksum``
(BLAKE2b-128 hex of the dtype and shape, then the tensor's raw bytes). A file is written to a temporary
name in the same directory and renamed over the real one, so a crash never leaves a half file under a
real name; there is no fsync, so after a power loss the checksum is what catches a damaged file.

Writes are asynchronous: the tier is ``completion`` by default (it takes every computed block, not only
evictions) and the engine loop must not wait for a disk. ``store`` copies the block and queues it for one
writer thread; until it lands, ``fetch`` serves the queued copy. At most ``min(capacity, 256 MiB)`` wait
in the queue: a store past that is dropped (``stats.rejected``) rather than blocking the engine. A process
that exits without ``close`` still writes its queue (an ``atexit`` flush).

Faults never reach the engine: a write that fails (disk full, read-only, directory removed) counts in
``stats.errors``, its block is forgotten (recomputed when next needed), and the error is logged once per
errno; directories are recreated before each write, so a removed one heals. A file that fails its checks
on ``fetch`` (corrupt, truncated, another fingerprint's) counts in ``stats.rejected`` and is deleted.

Restart: the constructor lists the fingerprint's directory (names, sizes and modification times only, no
reads), rebuilds the LRU order from the times (a hit touches its file, so recency survives a restart) and
deletes the oldest files past the capacity and temporary files left by a crash (older than 10 minutes).
``capacity_bytes`` counts K/V bytes, as for the other tiers; a block found by the scan counts at its file
size (a few hundred bytes more) until it is first read. Engines sharing one directory (data parallel) share
its blocks, but each enforces the capacity on its own view: give each engine its own directory to bound
the total, or accept that one may evict (and the other then miss, counting an error) what the other wrote.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import safetensors.torch
import torch

from tokenmill.kv_cache.tier import KVTier, WritePolicy

logger = logging.getLogger(__name__)

#: Most bytes of blocks waiting for the writer (further capped by the capacity).
MAX_PENDING_BYTES = 256 << 20
#: Most bytes of blocks read ahead and not yet fetched (their request may have left meanwhile).
MAX_READ_AHEAD_BYTES = 256 << 20
_FORMAT = "tokenmill-kv-block"
_VERSION = "1"
_SUFFIX = ".safetensors"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 600.0  # a temporary file this old is a crashed writer's, not a live one's
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")

# The writer thread's work: write a queued block, delete an evicted or rejected file, touch a hit file.
_Op = tuple[str, bytes, torch.Tensor | None]


class _Rejected(Exception):
    """A file that is not a valid block of this tier (the message says why)."""


def _write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file in the same directory, then a rename),
    creating the directory first so a removed one heals."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _checksum(block: torch.Tensor) -> str:
    """BLAKE2b-128 of the dtype, the shape and the raw bytes: a flipped bit anywhere in them shows."""
    digest = hashlib.blake2b(f"{block.dtype}:{list(block.shape)}:".encode(), digest_size=16)
    digest.update(block.contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _directory_name(fingerprint: str) -> str:
    """The fingerprint itself when it is a plain file name (the engine's is hex), else a digest of it."""
    if not fingerprint:
        return "default"
    if _SAFE_NAME.fullmatch(fingerprint) and fingerprint not in (".", ".."):
        return fingerprint
    return "fp-" + hashlib.blake2b(fingerprint.encode(), digest_size=16).hexdigest()


def _close_at_exit(tier_ref: weakref.ref[DiskKVTier]) -> None:
    tier = tier_ref()
    if tier is not None:
        tier.close()


class DiskKVTier(KVTier):
    """Blocks as safetensors files under ``path``, least recently used deleted first past ``capacity_bytes``;
    written by a background thread."""

    name: ClassVar[str] = "disk"
    default_write: ClassVar[WritePolicy] = "completion"
    takes_path: ClassVar[bool] = True

    def __init__(self, capacity_bytes: int, fingerprint: str = "", *, path: str | os.PathLike[str]) -> None:
        super().__init__(capacity_bytes, fingerprint)
        self.directory = Path(path).expanduser() / _directory_name(fingerprint)
        self._lock = threading.Lock()  # guards the index, pending, stats and the warned errnos
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # hash -> bytes, LRU first
        self._num_bytes = 0
        self._pending: dict[bytes, torch.Tensor] = {}  # blocks queued or being written
        self._pending_bytes = 0
        self._max_pending_bytes = min(capacity_bytes, MAX_PENDING_BYTES)
        self._warned: set[object] = set()  # error kinds (errnos) logged already
        self._queue: queue.Queue[_Op | None] = queue.Queue()
        # Blocks read ahead for a request about to be admitted (``prefetch``), until fetched; oldest first.
        self._read_ahead: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self._read_ahead_bytes = 0
        self._reading: set[bytes] = set()
        self._readers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="tokenmill-kv-disk-read")
        self._closed = False
        self._scan()
        self._writer = threading.Thread(target=self._run_writer, name="tokenmill-kv-disk-writer", daemon=True)
        self._writer.start()
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))  # a weakref: exit keeps nothing alive
        atexit.register(self._at_exit)

    @property
    def num_bytes(self) -> int:
        """Bytes of the blocks held now (on disk or queued)."""
        return self._num_bytes

    def block_path(self, block_hash: bytes) -> Path:
        """Where the block stored under ``block_hash`` lives (or would)."""
        name = block_hash.hex()
        return self.directory / name[:2] / f"{name}{_SUFFIX}"

    def contains(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    def store(self, block_hash: bytes, block: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        size = block.numel() * block.element_size()
        with self._lock:
            if size > self.capacity_bytes or self._closed:
                self.stats.rejected += 1
                return []
            if block_hash in self._index:  # equal hashes mean equal contents: nothing to write
                self._index.move_to_end(block_hash)
                return []
            victims, total, freed_pending = [], self._num_bytes + size, 0
            for old_hash, old_size in self._index.items():  # least recently used first
                if total <= self.capacity_bytes:
                    break
                victims.append(old_hash)
                total -= old_size
                freed_pending += old_size if old_hash in self._pending else 0
            if self._pending_bytes - freed_pending + size > self._max_pending_bytes:
                self.stats.rejected += 1  # the writer is behind: drop the block rather than wait
                return []
        copy = torch.empty(block.shape, dtype=block.dtype)  # the caller reuses ``block`` once this returns
        copy.copy_(block)
        with self._lock:
            for old_hash in victims:
                self._forget(old_hash)
            self._index[block_hash] = size
            self._num_bytes += size
            self._pending[block_hash] = copy
            self._pending_bytes += size
        for old_hash in victims:
            self._queue.put(("delete", old_hash, None))
        self._queue.put(("write", block_hash, copy))
        return []  # evicted blocks are deleted, not passed on

    def prefetch(self, block_hashes: Sequence[bytes]) -> bool:
        """Read the blocks not in memory in the background (two reader threads); True once all are."""
        to_read = []
        with self._lock:
            for block_hash in block_hashes:
                if block_hash not in self._index or block_hash in self._pending or block_hash in self._read_ahead:
                    continue  # gone (fetch will say so), or in memory already
                if block_hash not in self._reading and not self._closed:
                    self._reading.add(block_hash)
                    to_read.append(block_hash)
            ready = not any(h in self._reading for h in block_hashes)
        for block_hash in to_read:
            self._readers.submit(self._read_in_background, block_hash)
        return ready

    def fetch(self, block_hash: bytes) -> torch.Tensor | None:
        with self._lock:
            if block_hash not in self._index:
                self.stats.misses += 1
                return None
            self._index.move_to_end(block_hash)
            block = self._pending.get(block_hash)
            if block is None and (block := self._read_ahead.pop(block_hash, None)) is not None:
                self._read_ahead_bytes -= block.numel() * block.element_size()
            if block is not None:
                self.stats.hits += 1
                self.stats.bytes_read += block.numel() * block.element_size()
                return block
        block = self._read(block_hash)
        if block is None:
            return None
        size = block.numel() * block.element_size()
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += size
        return block

    def _read_in_background(self, block_hash: bytes) -> None:
        block = None
        try:
            block = self._read(block_hash)
        finally:
            with self._lock:
                self._reading.discard(block_hash)
                if block is not None and block_hash in self._index:
                    self._read_ahead[block_hash] = block
                    self._read_ahead_bytes += block.numel() * block.element_size()
                    while self._read_ahead_bytes > MAX_READ_AHEAD_BYTES:  # read for a request that left
                        _, old = self._read_ahead.popitem(last=False)
                        self._read_ahead_bytes -= old.numel() * old.element_size()

    def _read(self, block_hash: bytes) -> torch.Tensor | None:
        """Read and check the block's file (any thread); None, counted and forgotten, if it fails."""
        try:
            with open(self.block_path(block_hash), "rb") as file:
                data = file.read()
            block = self._parse(data, block_hash)
        except OSError as error:
            with self._lock:
                self._forget(block_hash)
                self.stats.errors += 1
                self.stats.misses += 1
            self._warn_once(error.errno, "reading a block", error)
            return None
        except Exception as error:  # corrupt, truncated or foreign: never serve it
            with self._lock:
                self._forget(block_hash)
                self.stats.rejected += 1
                self.stats.misses += 1
            logger.debug("disk KV tier: rejected %s: %s", self.block_path(block_hash), error)
            self._submit(("delete", block_hash, None))
            return None
        size = block.numel() * block.element_size()
        with self._lock:
            if block_hash in self._index:  # a block found by the scan counted at its file size until now
                self._num_bytes += size - self._index[block_hash]
                self._index[block_hash] = size
        self._submit(("touch", block_hash, None))
        return block

    def flush(self) -> None:
        """Wait until every block stored so far is written (or has failed)."""
        if not self._closed:
            self._queue.join()

    def close(self) -> None:
        """Write the queued blocks and stop the writer; later stores are refused. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._queue.put(None)
        self._writer.join()
        atexit.unregister(self._at_exit)

    # Called with the lock held.

    def _forget(self, block_hash: bytes) -> None:
        """Drop ``block_hash`` from the index (and the queue, if waiting)."""
        size = self._index.pop(block_hash, None)
        if size is not None:
            self._num_bytes -= size
        if self._pending.pop(block_hash, None) is not None and size is not None:
            self._pending_bytes -= size
        read_ahead = self._read_ahead.pop(block_hash, None)
        if read_ahead is not None:
            self._read_ahead_bytes -= read_ahead.numel() * read_ahead.element_size()

    # Called without the lock.

    def _submit(self, op: _Op) -> None:
        if not self._closed:
            self._queue.put(op)

    def _warn_once(self, kind: object, what: str, error: Exception) -> None:
        """Log ``error`` the first time an error of this ``kind`` (an errno) happens: a full disk fails every
        write, and one line says it as well as thousands."""
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        logger.warning(
            "disk KV tier %s: %s failed: %s; affected blocks will be recomputed (logged once per error kind)",
            self.directory, what, error,
        )  # fmt: skip

    def _parse(self, data: bytes, block_hash: bytes) -> torch.Tensor:
        """The block in ``data`` after checking it is one of ours; raises ``_Rejected`` (or safetensors' error)."""
        header_len = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
        if not 0 <= header_len <= len(data) - 8:
            raise _Rejected("truncated header")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
        tensors = safetensors.torch.load(data)
        expected = {"format": _FORMAT, "version": _VERSION, "fingerprint": self.fingerprint,
                    "block_hash": block_hash.hex()}  # fmt: skip
        wrong = [key for key, value in expected.items() if metadata.get(key) != value]
        if wrong:
            raise _Rejected(f"metadata {wrong} differ")
        block = tensors.get("kv")
        if block is None or len(tensors) != 1:
            raise _Rejected(f"tensors {sorted(tensors)}, expected ['kv']")
        if metadata.get("checksum") != _checksum(block):
            raise _Rejected("checksum mismatch")
        return block

    def _scan(self) -> None:
        """Rebuild the index from the files already there, oldest first; delete leftovers and the excess."""
        found: list[tuple[float, str, bytes, int]] = []
        leftovers: list[str] = []
        try:
            with os.scandir(self.directory) as fan_out:
                subdirs = [entry.path for entry in fan_out if entry.is_dir(follow_symlinks=False)]
            for subdir in subdirs:
                with contextlib.suppress(FileNotFoundError), os.scandir(subdir) as entries:
                    for entry in entries:
                        if entry.name.endswith(_TMP_SUFFIX):
                            # Another live engine on the same directory may be writing it: only old ones are left over.
                            with contextlib.suppress(OSError):
                                if time.time() - entry.stat().st_mtime > _STALE_TMP_S:
                                    leftovers.append(entry.path)
                            continue
                        stem = entry.name.removesuffix(_SUFFIX)
                        if stem == entry.name or stem[:2] != os.path.basename(subdir) or not entry.is_file():
                            continue
                        try:
                            block_hash = bytes.fromhex(stem)
                            stat = entry.stat()  # one stat call, no read
                        except (ValueError, OSError):
                            continue  # not a block's name, or gone since it was listed
                        found.append((stat.st_mtime, stem, block_hash, stat.st_size))
        except FileNotFoundError:
            pass  # a new directory: created on the first write
        except OSError as error:
            self.stats.errors += 1
            self._warn_once(error.errno, "listing the directory", error)
        for *_, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._num_bytes += size
        excess: list[str] = []
        while self._num_bytes > self.capacity_bytes:
            block_hash, size = self._index.popitem(last=False)
            self._num_bytes -= size
            excess.append(str(self.block_path(block_hash)))
        for path in leftovers + excess:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _run_writer(self) -> None:
        while True:
            op = self._queue.get()
            try:
                if op is None:
                    return
                kind, block_hash, block = op
                if kind == "write" and block is not None:
                    self._write(block_hash, block)
                elif kind == "delete":
                    self._delete(block_hash)
                elif kind == "touch":  # the file's time is its recency after a restart
                    with contextlib.suppress(OSError):
                        os.utime(self.block_path(block_hash))
            except Exception:  # keep the writer alive whatever happens
                logger.exception("disk KV tier %s: the writer failed", self.directory)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, block: torch.Tensor) -> None:
        with self._lock:
            if self._pending.get(block_hash) is not block:
                return  # evicted (or evicted and stored again) before its turn
        size = block.numel() * block.element_size()
        try:
            data = safetensors.torch.save({"kv": block}, metadata={
                "format": _FORMAT, "version": _VERSION, "fingerprint": self.fingerprint,
                "block_hash": block_hash.hex(), "checksum": _checksum(block),
            })  # fmt: skip
            _write_file(str(self.block_path(block_hash)), data)
        except Exception as error:  # an OSError (disk full, read-only, ...) or a block safetensors refuses
            kind = error.errno if isinstance(error, OSError) else type(error).__name__
            with self._lock:
                if self._pending.get(block_hash) is block:
                    self._forget(block_hash)  # recomputed when next needed
                if isinstance(error, OSError):
                    self.stats.errors += 1
                else:
                    self.stats.rejected += 1
            self._warn_once(kind, "writing a block", error)
            return
        with self._lock:
            if self._pending.get(block_hash) is block:
                del self._pending[block_hash]
                self._pending_bytes -= size
            self.stats.bytes_written += size

    def _delete(self, block_hash: bytes) -> None:
        try:
            os.unlink(self.block_path(block_hash))
        except FileNotFoundError:
            pass
        except OSError as error:
            with self._lock:
                self.stats.errors += 1
            self._warn_once(error.errno, "deleting a block", error)
