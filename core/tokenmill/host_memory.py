"""Host memory for what decode streams: a CPU model's weights and adapter slots in transparent huge pages, and
mappings of their own for the KV pool.

A decode step reads every weight once. Through 4 KiB pages the default model's 97 MB of streamed weights span about
24,000 pages a token, far more than the TLB holds, and each miss costs a page walk (two-dimensional under a
hypervisor, where most CPU inference runs). In 2 MiB pages they are about 50. So once a CPU model is loaded, its
streamed weights move into one private anonymous mapping advised ``MADV_HUGEPAGE`` (``move_to_huge_pages``), and
the LoRA slots are made in one such mapping (``anonymous_bytes``). Linux honours the advice when THP is
``madvise`` or ``always`` (the usual defaults); under ``never`` nothing moves. Figures: docs/benchmarks.md,
"Weights and adapter slots in huge pages".

The activations a step allocates come from malloc. glibc returns large blocks to the OS when they are freed (a
block over its mmap threshold is unmapped; free memory at the heap's top over its trim threshold is trimmed), so
each prompt chunk's tens of megabytes of activations were faulted in and zeroed again by the kernel at every
step. ``keep_freed_heap`` raises both thresholds once a CPU model is loaded: freed activations stay in the heap for
the next step, and the process keeps the heap its largest step needed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import torch

HUGE_PAGE_BYTES = 2 << 20
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MADV_DONTNEED = 4
# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap and go back to it, and this much free memory may stay at its top.
HEAP_KEEP_BYTES = 1 << 30
# The highest mmap threshold some glibc releases accept on 64-bit machines (HEAP_MAX_SIZE / 2); 1 GiB is refused there.
_OLD_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
# Set by a user who tunes glibc's malloc: keep_freed_heap leaves it alone.
_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def huge_pages_available() -> bool:
    """Whether Linux gives transparent huge pages to a mapping advised ``MADV_HUGEPAGE``."""
    try:
        setting = _THP_SETTING.read_text()
    except OSError:  # not Linux, or no THP
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in setting


def keep_freed_heap() -> bool:
    """Make glibc's malloc keep freed blocks of up to ``HEAP_KEEP_BYTES`` for reuse rather than unmapping or
    trimming them; True when it did. A no-op (False) without glibc, or where the environment already tunes malloc
    (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``)."""
    if any(name in os.environ for name in _MALLOC_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # The trim threshold alone would be worse than neither: setting either stops glibc from raising its mmap
    # threshold as blocks are freed, so it goes only with a raised mmap threshold.
    if not (mallopt(_M_MMAP_THRESHOLD, HEAP_KEEP_BYTES) or mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MMAP_THRESHOLD_MAX)):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, HEAP_KEEP_BYTES))


def anonymous_bytes(num_bytes: int, huge_pages: bool = False) -> torch.Tensor:
    """``num_bytes`` zeroed bytes, a uint8 CPU tensor over a private anonymous mapping of its own: the OS maps its
    pages, zeroed, as they are first written, so an untouched part costs no time and no memory. With
    ``huge_pages`` (where ``huge_pages_available``), the mapping is advised ``MADV_HUGEPAGE`` and the tensor starts
    on a 2 MiB boundary."""
    huge_pages = huge_pages and huge_pages_available()
    padding = HUGE_PAGE_BYTES if huge_pages else 0
    memory = mmap.mmap(-1, max(num_bytes + padding, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages:
        memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping (a buffer export keeps it open) for as long as it lives.
    whole = torch.frombuffer(memory, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES if huge_pages else 0
    return whole[start : start + num_bytes]


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the data of CPU ``tensors`` into one mapping of huge pages, in place: each tensor keeps its identity,
    shape, strides and dtype (``Tensor.set_``), so modules and anything else holding it see the moved data, and
    tensors that shared memory still share it. A storage moves as the span its given tensors cover; what they
    left is freed once nothing else holds it. Views made of a tensor before the move stay on the old memory: move
    before anything is viewed. Returns the bytes moved: 0, moving nothing, where huge pages are unavailable.
    """
    if not huge_pages_available():
        return 0
    # A view holds its base (autograd's view tracking), which would keep the old memory: bases move too.
    given = [t for t in tensors if t.device.type == "cpu" and t.layout == torch.strided and t.numel()]
    unique = {id(t): t for t in (*given, *(t._base for t in given if t._base is not None))}
    # Per storage: the byte span its tensors cover, and those tensors.
    spans: dict[int, tuple[torch.UntypedStorage, int, int, list[torch.Tensor]]] = {}
    left: list[tuple[int, int]] = []  # each tensor's old addresses
    for tensor in unique.values():
        storage = tensor.untyped_storage()
        first = int(tensor.storage_offset()) * tensor.element_size()
        extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        end = first + extent * tensor.element_size()
        left.append((storage.data_ptr() + first, storage.data_ptr() + end))
        _, start, stop, members = spans.get(storage.data_ptr(), (storage, first, end, []))
        members.append(tensor)
        spans[storage.data_ptr()] = (storage, min(start, first), max(stop, end), members)
    # Each span keeps its start's address modulo 64, so every tensor keeps the alignment it had.
    placed, total = [], 0
    for storage, start, stop, members in spans.values():
        offset = total + (-total + storage.data_ptr() + start) % 64
        placed.append((offset, storage, start, stop, members))
        total = offset + stop - start
    arena = anonymous_bytes(total, huge_pages=True)
    target = arena.untyped_storage()
    with torch.no_grad():
        for offset, storage, start, stop, members in placed:
            source = torch.empty(0, dtype=torch.uint8).set_(storage, start, (stop - start,), (1,))
            arena[offset : offset + stop - start].copy_(source)
            for tensor in members:
                moved = (
                    int(arena.storage_offset()) + offset + int(tensor.storage_offset()) * tensor.element_size() - start
                )
                tensor.set_(target, moved // tensor.element_size(), tensor.shape, tensor.stride())
    _unmap_file_pages(left)
    return total


def _unmap_file_pages(spans: list[tuple[int, int]]) -> None:
    """Unmap the whole pages of the moved tensors' old ``spans`` (start and end addresses) that lie in a file's
    mapping: a safetensors file stays mapped while any of its tensors is read from it (the embedding), and the
    pages the others left would stay resident beside their copies. The file keeps their bytes, so a view of them
    read later maps them again. Anonymous memory is freed with its storage instead."""
    files = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            files.append(tuple(int(address, 16) for address in fields[0].split("-")))
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start, end in spans:
        first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first and any(low <= first and last <= high for low, high in files):
            madvise(first, last - first, _MADV_DONTNEED)
