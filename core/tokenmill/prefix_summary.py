"""What each engine's prefix cache holds, as the front end's routers see it.

Each engine reports its prefix cache's changes the way vLLM's KV events do
(``BlockStored``/``BlockRemoved``), compacted: with every stats message, the
blocks its cache gained and lost since the previous message to that front end,
net, each named by the first ``PREFIX_KEY_SIZE`` bytes of its chained block
hash (``tokenmill.kv_cache.block_hash``). Because block hashes chain, one key
names a whole prefix, so the front end's mirror answers "how many leading blocks
of this prompt does engine i hold" with one set lookup per block.

- ``PrefixSummaryFeed`` runs in the engine process: it folds the cache's deltas
  into a mirror of the cache and into one pending delta per connection, and
  hands each message its connection's delta, or a full snapshot after a
  ``Hello``.
- ``PrefixCacheSummary`` runs in the front end, one per engine: it applies the
  messages in order, notices a missed one (a gap in ``prefix_cache_seq``: the
  caller then says ``Hello`` again and gets a snapshot), and also remembers for a
  while the prefixes of requests routed to the engine that it has not reported
  yet, as SGLang's cache-aware router does with its approximate tree, so a burst
  of requests sharing a new prefix follows the first one instead of scattering
  before the engine has computed it.

Neither imports torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from tokenmill.messages import PREFIX_KEY_SIZE, EngineStatsMessage

logger = logging.getLogger(__name__)

#: Seconds a routed request's prefix counts as held by its engine before the engine reports it.
ROUTED_PREFIX_TTL_S = 30.0

__all__ = ["PREFIX_KEY_SIZE", "ROUTED_PREFIX_TTL_S", "PrefixCacheSummary", "PrefixSummaryFeed", "prefix_keys"]


def prefix_keys(block_hashes: Sequence[bytes]) -> list[bytes]:
    """The summary's keys of full block hashes (their first ``PREFIX_KEY_SIZE`` bytes)."""
    return [block_hash[:PREFIX_KEY_SIZE] for block_hash in block_hashes]


def _join(keys: Iterable[bytes]) -> bytes:
    return b"".join(keys)


def _split(data: bytes) -> list[bytes]:
    if len(data) % PREFIX_KEY_SIZE:
        raise ValueError(f"a prefix cache summary of {len(data)} bytes is not a whole number of keys")
    return [data[start : start + PREFIX_KEY_SIZE] for start in range(0, len(data), PREFIX_KEY_SIZE)]


class _Pending:
    __slots__ = ("changes", "is_reset", "seq")

    def __init__(self) -> None:
        self.changes: dict[bytes, bool] = {}  # key -> True gained / False lost, net since the last message
        self.is_reset = True  # the next message carries a full snapshot
        self.seq = 0


class PrefixSummaryFeed:
    """The engine process's side: each connection's summary of the prefix cache.

    ``update`` once with the cache's delta before each message; ``take`` per message, for its connection;
    ``reset`` when a connection says ``Hello``. O(keys changed) per call, plus O(keys held) for a snapshot.
    """

    def __init__(self) -> None:
        self._held: set[bytes] = set()
        self._peers: dict[bytes, _Pending] = {}

    @property
    def num_keys(self) -> int:
        return len(self._held)

    def reset(self, peer: bytes) -> None:
        """The next message to ``peer`` carries a full snapshot (it connected, or asked again)."""
        pending = self._peers.setdefault(peer, _Pending())
        pending.is_reset = True
        pending.changes.clear()

    def update(self, added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        """Fold the prefix cache's net change (full block hashes) into the mirror and every connection's delta."""
        if not added and not removed:
            return
        gained = prefix_keys(added)
        lost = prefix_keys(removed)
        self._held.difference_update(lost)
        self._held.update(gained)
        for pending in self._peers.values():
            if pending.is_reset:
                continue  # its snapshot, taken later, has these
            changes = pending.changes
            for key in lost:
                if changes.pop(key, None) is None:  # (gained since the last message: no net change)
                    changes[key] = False
            for key in gained:
                if changes.pop(key, None) is None:
                    changes[key] = True

    def take(self, peer: bytes) -> tuple[int, bool, bytes, bytes]:
        """``(seq, is_reset, added, removed)`` for the next message to ``peer``: its sequence number, and the
        keys gained and lost since its last message (or, when ``is_reset``, every key held) concatenated."""
        pending = self._peers.get(peer)
        if pending is None:
            pending = self._peers[peer] = _Pending()
        pending.seq += 1
        if pending.is_reset:
            pending.is_reset = False
            pending.changes.clear()
            return pending.seq, True, _join(self._held), b""
        changes, pending.changes = pending.changes, {}
        added = _join(key for key, gained in changes.items() if gained)
        removed = _join(key for key, gained in changes.items() if not gained)
        return pending.seq, False, added, removed


class PrefixCacheSummary:
    """The front end's mirror of one engine's prefix cache, from its stats messages.

    Call ``apply`` with each stats message in order; it returns False when a message was missed (ask the
    engine for a snapshot with ``Hello``; until one arrives the mirror keeps what it had). ``clear`` after
    the connection is lost (a restarted engine's cache is empty). ``note_routed`` after routing a request
    to this engine; ``num_matching_blocks`` when routing the next one.
    """

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self._seq: int | None = None  # the last message's number; None: waiting for a snapshot
        self._routed: dict[bytes, float] = {}  # key -> when it stops counting, unless the engine reports it

    @property
    def is_synced(self) -> bool:
        return self._seq is not None

    def clear(self) -> None:
        self.keys.clear()
        self._routed.clear()
        self._seq = None

    def apply(self, stats: EngineStatsMessage) -> bool:
        """Apply one stats message; False when one before it is missing (ask for a snapshot)."""
        if stats.prefix_cache_reset:
            self.keys = set(_split(stats.prefix_cache_added))
            self._seq = stats.prefix_cache_seq
            return True
        if self._seq is None:
            return True  # a snapshot was asked for; deltas until it arrives are relative to nothing known
        if stats.prefix_cache_seq != self._seq + 1:
            if stats.prefix_cache_seq == 0:
                return True  # an engine that reports no summary
            logger.warning("prefix cache summary: message %d after %d; asking for a snapshot",
                           stats.prefix_cache_seq, self._seq)  # fmt: skip
            self._seq = None
            return False
        self._seq = stats.prefix_cache_seq
        if stats.prefix_cache_removed:
            self.keys.difference_update(_split(stats.prefix_cache_removed))
        if stats.prefix_cache_added:
            added = _split(stats.prefix_cache_added)
            self.keys.update(added)
            if self._routed:
                for key in added:
                    self._routed.pop(key, None)
        return True

    def note_routed(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """A request with these prefix keys went to this engine: count them as held for a while."""
        if not keys:
            return
        now = time.monotonic() if now is None else now
        if len(self._routed) > 4 * len(self.keys) + 4096:  # bounded: drop the expired ones
            self._routed = {key: until for key, until in self._routed.items() if until > now}
        until = now + ROUTED_PREFIX_TTL_S
        for key in keys:
            if key not in self.keys:
                self._routed[key] = until

    def num_matching_blocks(self, keys: Sequence[bytes], now: float | None = None) -> int:
        """How many leading ``keys`` (a prompt's, first block first) the engine holds, or was sent lately."""
        held, routed = self.keys, self._routed
        if not routed:
            for position, key in enumerate(keys):
                if key not in held:
                    return position
            return len(keys)
        now = time.monotonic() if now is None else now
        for position, key in enumerate(keys):
            if key not in held and routed.get(key, 0.0) <= now:
                return position
        return len(keys)
