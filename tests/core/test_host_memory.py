"""Weights and adapter slots in huge pages on the host (``tokenmill.host_memory``)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.smaps import mapping_fields
from tokenmill import host_memory
from tokenmill.host_memory import anonymous_bytes, huge_pages_available, move_to_huge_pages
from tokenmill.testing.factories import make_engine

needs_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not huge_pages_available(), reason="Linux with THP not 'never'"
)


def _advised(tensor: torch.Tensor) -> bool:
    return "hg" in mapping_fields(tensor)["VmFlags"]


@needs_thp
def test_moved_tensors_keep_identity_values_and_shared_memory() -> None:
    base = torch.arange(4096, dtype=torch.float32).view(64, 64)
    left, right = base[:, :40], base[:, 24:]  # overlapping views of one storage
    transposed = torch.randn(48, 80).t()
    odd = torch.arange(101, dtype=torch.float16)[3:]  # starts 6 bytes into its storage
    parameter = nn.Parameter(torch.randn(33, 7), requires_grad=False)
    tensors = [left, right, transposed, odd, parameter, parameter]
    expected = [t.clone() for t in tensors]
    ids, strides = [id(t) for t in tensors], [t.stride() for t in tensors]
    alignments = [t.data_ptr() % 64 for t in tensors]

    moved = move_to_huge_pages(tensors)

    spans = base.nbytes + transposed.nbytes + odd.nbytes + parameter.nbytes  # each storage's span, once
    assert spans <= moved < spans + 4 * 64  # and at most an alignment's padding before each
    assert [id(t) for t in tensors] == ids and isinstance(tensors[4], nn.Parameter)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))
    assert [t.stride() for t in tensors] == strides
    assert all(_advised(t) for t in tensors)
    assert [t.data_ptr() % 64 for t in tensors] == alignments  # vector loads keep their alignment
    assert left.untyped_storage().data_ptr() == right.untyped_storage().data_ptr() != base.data_ptr()
    left[0, 30] = -1.0  # the views still overlap
    assert right[0, 6] == -1.0 and base[0, 30] == 30.0  # and left the old storage behind


def test_nothing_moves_where_huge_pages_are_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(host_memory, "_THP_SETTING", setting)
    tensor = torch.randn(1000)
    where = tensor.data_ptr()
    assert not huge_pages_available()
    assert move_to_huge_pages([tensor]) == 0 and tensor.data_ptr() == where
    assert not anonymous_bytes(1 << 20, huge_pages=True).any()


@needs_thp
def test_a_cpu_model_streams_its_weights_from_huge_pages(tiny_model_dir: Path) -> None:
    """Every weight a decode step reads whole is advised ``MADV_HUGEPAGE``; the embedding, of which a token reads
    one row, stays where it loaded when the model has an output projection of its own."""
    engine = make_engine(tiny_model_dir)
    model = engine.executor.runner.loaded.model
    linears = [module.weight for name, module in model.named_modules() if name.endswith(("qkv_proj", "down_proj"))]
    assert model.lm_head is not None and _advised(model.lm_head.weight)
    arena = model.lm_head.weight.untyped_storage().data_ptr()  # one mapping for all that moved
    assert linears and all(_advised(weight) and weight.untyped_storage().data_ptr() == arena for weight in linears)
    assert model.model.embed_tokens.weight.untyped_storage().data_ptr() != arena


@needs_thp
def test_adapter_slots_share_one_huge_page_mapping(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, lora={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8})
    layers = engine.lora.layers
    slots = [t for layer in layers for t in (layer.lora_a, *layer.lora_b)]
    assert all(_advised(t) and not t.any() for t in slots)
    assert len({t.untyped_storage().data_ptr() for t in slots}) == 1
    ends = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in slots]
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:], strict=False))  # in order, apart


@needs_thp
def test_adapter_slots_are_faulted_in_before_the_first_adapter_loads(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, lora={"enable_lora": True, "max_loras": 2, "max_lora_rank": 8})
    layers = engine.lora.layers
    first, last = layers[0].lora_a, layers[-1].lora_b[-1]
    resident = int(mapping_fields(first)["Rss"][0]) * 1024  # read before anything reads the slots
    assert resident >= last.data_ptr() + last.nbytes - first.data_ptr()


@needs_thp
def test_a_views_base_moves_with_it() -> None:
    """A view holds its base, which would keep the memory it left: the base moves too."""
    base = torch.arange(4096, dtype=torch.int32) % 251
    view = base.view(64, 64)
    move_to_huge_pages([view])
    assert view._base is base and base.data_ptr() == view.data_ptr() and _advised(base)
    assert torch.equal(base, torch.arange(4096, dtype=torch.int32) % 251)


@needs_thp
def test_pages_left_in_a_weights_file_are_unmapped(tmp_path: Path) -> None:
    """Tensors loaded from a safetensors file view its mapping, which stays while any of them is read from it (an
    embedding that does not move); the pages a moved tensor left there no longer count in the process's memory."""
    from safetensors.torch import load_file, save_file

    save_file({"moved": torch.randn(1 << 20), "stays": torch.randn(1 << 20)}, tmp_path / "w.safetensors")
    tensors = load_file(tmp_path / "w.safetensors")
    moved, stays = tensors["moved"], tensors["stays"]
    expected = moved.clone()
    assert moved.sum().isfinite() and stays.sum().isfinite()  # both resident
    before = int(mapping_fields(stays)["Rss"][0])
    move_to_huge_pages([moved])
    assert torch.equal(moved, expected) and _advised(moved)
    assert int(mapping_fields(stays)["Rss"][0]) <= before - moved.nbytes // 1024 + 8  # kB


_FREE_A_BLOCK = """
import ctypes, sys
from tokenmill.host_memory import keep_freed_heap
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def rss_kib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))

block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
before = rss_kib()
libc.free(block)
print(kept, before - rss_kib())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.parametrize("keep", [True, False])
def test_a_freed_block_stays_in_the_heap_for_the_next_step(keep: bool) -> None:
    env = {key: value for key, value in os.environ.items() if key not in host_memory._MALLOC_SETTINGS}
    result = subprocess.run(
        [sys.executable, "-c", _FREE_A_BLOCK, "keep" if keep else "default"],
        capture_output=True, text=True, check=True, env=env,
    )  # fmt: skip
    kept, returned_kib = result.stdout.split()
    if keep:  # malloc kept the 256 MiB it was given back, for the next step's activations
        assert kept == "True" and int(returned_kib) < 16 << 10
    else:  # glibc's default, which keep_freed_heap changes: the block goes back to the OS
        assert int(returned_kib) > 200 << 10


def test_loading_a_cpu_model_keeps_freed_heap(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr("tokenmill.model_loader.keep_freed_heap", lambda: calls.append(True) or True)
    make_engine(tiny_model_dir)
    assert calls == [True]


def test_a_user_who_tunes_malloc_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not host_memory.keep_freed_heap()
