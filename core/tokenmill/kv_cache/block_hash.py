"""Chained hashes of full KV blocks: the keys of the prefix cache.

The hash of block ``i`` of a sequence is a digest of the hash of block ``i - 1``
and the ``block_size`` token ids of block ``i``, so one hash names the whole
prefix up to the end of that block, not just the block's own tokens. Block 0
chains off a root hash made from the salts: ``hash_salt`` names the model (its
path and dtype, anything that changes the K/V values) and ``cache_salt`` names
an adapter or tenant. Different salts give disjoint hash chains, so nothing is
shared across them.

The format is fixed and process-independent (blake2b, explicit little-endian
int32 token bytes, no Python ``hash()``), because other processes compute the
same hashes: a prefix-aware router in the front end, a KV tier on disk. Change
``_PERSON`` if the format ever changes, so old stored hashes can never match.

Format (all digests are blake2b, 32 bytes, personalised with ``_PERSON``)::

    root  = H(u64le(len(m)) + m + cs)   m = hash_salt as UTF-8
                                         cs = b"\\x00" if cache_salt is None
                                              else b"\\x01" + u64le(len(c)) + c  (c = cache_salt as UTF-8)
    h[0]  = H(root + int32le(tokens of block 0))
    h[i]  = H(h[i - 1] + int32le(tokens of block i))
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Iterator, Sequence

logger = logging.getLogger(__name__)

#: Bytes in every block hash.
HASH_SIZE = 32
# blake2b personalisation (at most 16 bytes): a domain tag and format version.
_PERSON = b"tokenmill-kv-v1"

__all__ = ["HASH_SIZE", "block_hashes", "hash_block", "iter_block_hashes", "root_hash"]


def root_hash(hash_salt: str = "", cache_salt: str | None = None) -> bytes:
    """The parent hash of a sequence's first block, for this model and adapter/tenant.

    Called by the KV cache manager once per prefix lookup and once per request
    when its first blocks are cached, and by routers in other processes.
    """
    model = hash_salt.encode()
    data = len(model).to_bytes(8, "little") + model
    if cache_salt is None:
        data += b"\x00"
    else:
        # The tag byte keeps "no salt" apart from the empty salt "".
        tenant = cache_salt.encode()
        data += b"\x01" + len(tenant).to_bytes(8, "little") + tenant
    return hashlib.blake2b(data, digest_size=HASH_SIZE, person=_PERSON).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block whose predecessor hashes to ``parent_hash``.

    Called by the KV cache manager once per full block looked up or cached (per
    step), and by anything that extends a chain one block at a time. Token ids
    must fit in int32 (ValueError otherwise).
    """
    if len(parent_hash) != HASH_SIZE:
        raise ValueError(f"parent_hash must be {HASH_SIZE} bytes (root_hash or hash_block), got {len(parent_hash)}")
    h = hashlib.blake2b(parent_hash, digest_size=HASH_SIZE, person=_PERSON)
    try:
        h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    except struct.error as e:
        raise ValueError(f"token ids must be int32 integers: {e}") from None
    return h.digest()


def iter_block_hashes(
    token_ids: Sequence[int], block_size: int, hash_salt: str = "", cache_salt: str | None = None
) -> Iterator[bytes]:
    """Yield the chained hash of each full block of ``token_ids``, lazily.

    A caller that stops at the first block it does not know (a prefix lookup)
    hashes only the blocks it looks at. The trailing partial block has no hash.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = root_hash(hash_salt, cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        yield parent


def block_hashes(
    token_ids: Sequence[int], block_size: int, hash_salt: str = "", cache_salt: str | None = None
) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids`` (``len(token_ids) // block_size`` of them).

    The public entry point for other processes (a prefix-aware router computes
    these per incoming request and compares them with what each engine caches).
    Pass the same ``hash_salt`` and ``block_size`` as the engine, or nothing matches.
    """
    return list(iter_block_hashes(token_ids, block_size, hash_salt, cache_salt))
