"""Chained block hashes: what they depend on, their exact format, and stability across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from tokenmill.kv_cache import block_hashes, hash_block, iter_block_hashes, root_hash

TOKENS = list(range(100, 110))  # two full blocks of 4 and a partial one


def test_one_hash_per_full_block() -> None:
    assert len(block_hashes(TOKENS, 4)) == 2
    assert len(block_hashes(TOKENS[:8], 4)) == 2
    assert block_hashes(TOKENS[:3], 4) == []
    assert len(set(block_hashes(TOKENS, 2))) == 5


def test_hash_chains_over_the_whole_prefix() -> None:
    base = block_hashes(TOKENS[:8], 4)
    changed_first = block_hashes([0] + TOKENS[1:8], 4)
    changed_second = block_hashes(TOKENS[:4] + [0] + TOKENS[5:8], 4)
    # A change in block 0 changes every later hash, even where the block's own tokens are equal.
    assert changed_first[0] != base[0] and changed_first[1] != base[1]
    assert changed_second[0] == base[0] and changed_second[1] != base[1]
    # Equal tokens at different places hash differently.
    repeated = block_hashes([7, 7, 7, 7] * 2, 4)
    assert repeated[0] != repeated[1]


def test_salts_give_disjoint_chains() -> None:
    variants = [
        block_hashes(TOKENS, 4),
        block_hashes(TOKENS, 4, hash_salt="llama-3-8b:bf16"),
        block_hashes(TOKENS, 4, hash_salt="llama-3-8b:fp8"),
        block_hashes(TOKENS, 4, cache_salt=""),
        block_hashes(TOKENS, 4, cache_salt="tenant-a"),
        block_hashes(TOKENS, 4, hash_salt="llama-3-8b:bf16", cache_salt="tenant-a"),
    ]
    all_hashes = [h for hashes in variants for h in hashes]
    assert len(set(all_hashes)) == len(all_hashes)
    # Salts are length-prefixed, so moving characters between them cannot collide.
    assert root_hash("ab", "c") != root_hash("a", "bc")


def test_matches_the_documented_format() -> None:
    """The format other processes reimplement; written out here with hashlib alone."""

    def digest(data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=32, person=b"tokenmill-kv-v1").digest()

    model, tenant = b"m", b"t"
    root = digest(len(model).to_bytes(8, "little") + model + b"\x01" + len(tenant).to_bytes(8, "little") + tenant)
    first = digest(root + b"".join(t.to_bytes(4, "little", signed=True) for t in [1, 2, -3, 4]))
    second = digest(first + b"".join(t.to_bytes(4, "little", signed=True) for t in [5, 6, 7, 8]))
    assert block_hashes([1, 2, -3, 4, 5, 6, 7, 8, 9], 4, "m", "t") == [first, second]
    unsalted_root = digest((0).to_bytes(8, "little") + b"\x00")
    assert root_hash() == unsalted_root


def test_stable_across_processes() -> None:
    code = (
        "from tokenmill.kv_cache import block_hashes\nprint(block_hashes(list(range(100, 110)), 4, 'm', 't')[-1].hex())"
    )
    outputs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        outputs.add(result.stdout.strip())
    assert outputs == {block_hashes(TOKENS, 4, "m", "t")[-1].hex()}


def test_iter_is_lazy_and_agrees() -> None:
    hashes = iter_block_hashes(TOKENS, 4)
    assert next(hashes) == block_hashes(TOKENS, 4)[0]
    assert hash_block(root_hash(), TOKENS[:4]) == block_hashes(TOKENS, 4)[0]


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(TOKENS, 0)
    with pytest.raises(ValueError, match="int32"):
        block_hashes([2**31, 0, 0, 0], 4)
    with pytest.raises(ValueError, match="32 bytes"):
        hash_block(b"short", [1, 2, 3, 4])
