"""The runner's KV cache on CPU: zeroed, and resident before the first request (issue 18: a pool mapped
page by page under load made RSS grow like a leak)."""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest
import torch

from tests.smaps import mapping_fields
from tokenmill.testing.factories import make_engine


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The share of the pages under ``tensor`` that are in RAM now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = tensor.data_ptr() + tensor.nbytes - start
    num_pages = -(-length // mmap.PAGESIZE)
    pages = ctypes.create_string_buffer(num_pages)
    if libc.mincore(start, length, pages) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in pages.raw) / num_pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")
def test_kv_cache_reads_as_zeros_and_is_resident_only_where_used(tiny_model_dir: Path) -> None:
    """A start costs no time for the pool's size: its pages are mapped as blocks are first written (the warm-up
    writes a slot of block 0), and the untouched rest reads as zeros."""
    engine = make_engine(tiny_model_dir, cache={"block_size": 4, "num_kv_blocks": 65536})
    caches = engine.executor.runner.kv_caches
    assert sum(cache.nbytes for cache in caches) >= 48 * 2**20  # many pages, most of them never used by a block
    assert all(_resident_fraction(cache) < 0.25 for cache in caches)  # before reading them: reads map zero pages
    assert all(not cache[:, 1:].any() and cache.device == torch.device("cpu") for cache in caches)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps as Linux has it")
def test_kv_cache_asks_for_no_huge_pages(tiny_model_dir: Path) -> None:
    """Under ``MADV_HUGEPAGE`` each first write of a 2 MiB region took about 7 ms on the VMs we measure on (0.4 s
    of the warm-up on the default model); the cache's mappings carry no ``hg`` flag."""
    engine = make_engine(tiny_model_dir, cache={"block_size": 4, "num_kv_blocks": 65536})
    assert all("hg" not in mapping_fields(cache)["VmFlags"] for cache in engine.executor.runner.kv_caches)
