"""Paged-attention kernels against their plain-torch reference.

The Triton kernels run here on CPU under the Triton interpreter (see
``conftest.py``), so the sizes are tiny; every axis is still covered: dtype x
head_dim x block_size in full, and per case a batch (decode tokens, prefill
chunks longer and shorter than a query tile, padding requests), a GQA ratio
and a sliding window taken in turn from short lists. Block tables are shuffled
and interleaved, unused block-table entries hold huge ids, and every cache slot
no request owns holds NaN, so a read outside a request's tokens shows up.
The CUDA kernel's tests are marked ``gpu`` and skip without CUDA and CuPy.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenmill_kernels.paged_attention import cuda as cuda_kernels
from tokenmill_kernels.paged_attention import triton as kernels
from tokenmill_kernels.paged_attention.reference import paged_attention_reference, write_kv_cache_reference

from tests.kernels.tolerances import tolerance
from tokenmill.attention.kv_quant import dequantize_kv, quantize_kv

assert torch.cuda.is_available() or kernels.is_interpreted(), (
    "the Triton kernels were imported before TRITON_INTERPRET=1 was set (tests/kernels/conftest.py sets it)"
)

#: Per request: (query_len, num_computed_tokens). A query_len of 0 is a padding request.
BATCHES: list[list[tuple[int, int]]] = [
    [(1, 9)],  # one decode token
    [(1, 30), (7, 0), (1, 1)],  # decode around a first prompt chunk
    [(19, 12), (1, 40), (0, 5), (3, 2)],  # a chunk over two query tiles after a prefix, and a padding request
    [(5, 0), (17, 0), (0, 0)],  # prefill only, and an empty padding request
]
#: (num_heads, num_kv_heads): GQA ratios 1, 2, 3, 4 and 8.
HEADS: list[tuple[int, int]] = [(2, 2), (4, 2), (6, 2), (4, 1), (8, 1)]
WINDOWS: list[int | None] = [None, 6]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [32, 64, 128]
BLOCK_SIZES = [8, 16, 32]
#: Where the kernels run: the GPU when there is one, else the CPU under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_UNUSED_BLOCK_ID = 1 << 30  # a block-table entry past a request's blocks: reading it would fault or give NaN


@dataclass
class Batch:
    """One step's inputs, laid out as the model runner lays them out."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query, self.key_cache, self.value_cache, self.block_tables,
            self.seq_lens, self.query_start_loc, self.positions,
        )  # fmt: skip

    def reference(self, scale: float, sliding_window: int | None) -> torch.Tensor:
        return paged_attention_reference(*self.attention_args(), scale, sliding_window)


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: str = DEVICE,
) -> Batch:
    """Random queries and K/V; cached prefixes already in a NaN-filled cache, blocks shuffled across requests."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    block_counts = [-(-(q + c) // block_size) for q, c in requests]
    num_blocks = sum(block_counts) + 3  # a few blocks nobody owns
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    max_blocks = max(block_counts) + 2
    block_tables = torch.full((len(requests), max_blocks), _UNUSED_BLOCK_ID, dtype=torch.int32)
    tables: list[list[int]] = [[] for _ in requests]
    for i in itertools.cycle(range(len(requests))):  # deal blocks round-robin: requests interleave in memory
        if all(len(tables[j]) == block_counts[j] for j in range(len(requests))):
            break
        if len(tables[i]) < block_counts[i]:
            tables[i].append(pool.pop())
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    positions, slots, query_lens = [], [], []
    for (query_len, num_computed), table in zip(requests, tables, strict=True):
        for position in range(num_computed):  # the cached prefix
            block, offset = table[position // block_size], position % block_size
            key_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
            value_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
        for position in range(num_computed, num_computed + query_len):
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
        query_lens.append(query_len)
    num_tokens = len(positions)
    query_start_loc = torch.zeros(len(requests) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    batch = Batch(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([q + c for q, c in requests], dtype=torch.int32),
        query_start_loc=query_start_loc,
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
    )
    if device != "cpu":
        for name, tensor in vars(batch).items():
            if isinstance(tensor, torch.Tensor):
                setattr(batch, name, tensor.to(device))
    return batch


def _write_both_ways(batch: Batch) -> None:
    """The Triton cache write, checked slot for slot (NaN included) against the reference write."""
    expected_keys, expected_values = batch.key_cache.clone(), batch.value_cache.clone()
    write_kv_cache_reference(batch.key, batch.value, expected_keys, expected_values, batch.slot_mapping.cpu())
    kernels.write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.slot_mapping)
    torch.testing.assert_close(batch.key_cache, expected_keys, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(batch.value_cache, expected_values, atol=0, rtol=0, equal_nan=True)


def _grid() -> list[Any]:  # pytest.param objects
    cases = []
    for i, (dtype, head_dim, block_size) in enumerate(itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES)):
        batch, heads, window = i % len(BATCHES), HEADS[i % len(HEADS)], WINDOWS[i % len(WINDOWS)]
        case_id = f"{str(dtype)[6:]}-d{head_dim}-bs{block_size}-batch{batch}-h{heads[0]}kv{heads[1]}-w{window}"
        cases.append(pytest.param(dtype, head_dim, block_size, BATCHES[batch], heads, window, id=case_id))
    return cases


@pytest.mark.parametrize("dtype, head_dim, block_size, requests, heads, window", _grid())
def test_triton_matches_reference(
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    requests: list[tuple[int, int]],
    heads: tuple[int, int],
    window: int | None,
) -> None:
    """Cache write, then the mixed launcher (decode + prefill), then split-K decode: each against the reference."""
    num_heads, num_kv_heads = heads
    batch = make_batch(requests, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + block_size)
    _write_both_ways(batch)
    scale = head_dim**-0.5
    expected = batch.reference(scale, window)

    tiles = kernels.build_prefill_tiles(batch.query_start_loc, batch.query.shape[0])
    out = kernels.paged_attention(*batch.attention_args(), tiles, scale=scale, sliding_window=window)
    torch.testing.assert_close(out, expected, **tolerance(dtype))

    split = torch.zeros_like(out)
    kernels.paged_attention_decode(*batch.attention_args(), split, scale=scale, sliding_window=window, num_splits=3)
    is_decode = torch.repeat_interleave(
        (batch.query_start_loc.diff() == 1), batch.query_start_loc.diff().long()
    )  # [num_tokens]
    torch.testing.assert_close(split[is_decode], expected[is_decode], **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode_over_a_long_context(dtype: torch.dtype) -> None:
    """Split-K merges to the unsplit result for any number of splits, including more splits than key tiles."""
    batch = make_batch([(1, 150), (1, 3), (1, 77)], 4, 2, 32, 8, dtype, seed=5)
    _write_both_ways(batch)
    expected = batch.reference(32**-0.5, None)
    for num_splits in (1, 2, 5, 16):
        out = torch.zeros_like(batch.query)
        kernels.paged_attention_decode(*batch.attention_args(), out, scale=32**-0.5, num_splits=num_splits, tile_n=16)
        torch.testing.assert_close(out, expected, **tolerance(dtype), msg=f"num_splits={num_splits}")


@pytest.mark.parametrize("tile_n", [16, 32, 128])
@pytest.mark.parametrize("block_size", [8, 32])
def test_key_tiles_smaller_and_larger_than_blocks(tile_n: int, block_size: int) -> None:
    """A key tile may cover part of a block or several blocks: both read the right slots."""
    batch = make_batch([(1, 45), (20, 30), (4, 0)], 4, 2, 64, block_size, torch.float32, seed=tile_n)
    _write_both_ways(batch)
    for window in (None, 13):
        expected = batch.reference(0.125, window)
        out = torch.zeros_like(batch.query)
        tiles = kernels.build_prefill_tiles(batch.query_start_loc, batch.query.shape[0])
        kernels.paged_attention_decode(*batch.attention_args(), out, scale=0.125, sliding_window=window, tile_n=tile_n)
        kernels.paged_attention_prefill(
            *batch.attention_args(), *tiles, out, scale=0.125, sliding_window=window, tile_n=tile_n
        )
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))


def test_head_dim_256_and_a_window_of_one() -> None:
    """The largest head_dim, and a window so small that each query sees only itself."""
    batch = make_batch([(1, 20), (6, 3)], 2, 1, 256, 16, torch.float16, seed=3)
    _write_both_ways(batch)
    tiles = kernels.build_prefill_tiles(batch.query_start_loc, batch.query.shape[0])
    for window in (None, 1):
        out = kernels.paged_attention(*batch.attention_args(), tiles, scale=1 / 16, sliding_window=window)
        torch.testing.assert_close(out, batch.reference(1 / 16, window), **tolerance(torch.float16))


@pytest.mark.parametrize("heads, head_dim", [((16, 1), 32), ((12, 2), 256)])
def test_gqa_groups_larger_than_one_prefill_program(heads: tuple[int, int], head_dim: int) -> None:
    """A group too large for one prefill program's rows is split over programs (the last one partly filled)."""
    batch = make_batch([(18, 3), (1, 6)], *heads, head_dim, 16, torch.bfloat16, seed=2)
    _write_both_ways(batch)
    tiles = kernels.build_prefill_tiles(batch.query_start_loc, batch.query.shape[0])
    out = kernels.paged_attention(*batch.attention_args(), tiles, scale=head_dim**-0.5)
    torch.testing.assert_close(out, batch.reference(head_dim**-0.5, None), **tolerance(torch.bfloat16))


def test_each_kernel_leaves_the_other_kernels_rows_alone() -> None:
    """Decode writes only decode tokens' rows and prefill only prefill tokens' rows (one output, two launches)."""
    batch = make_batch([(1, 10), (9, 4), (1, 2)], 4, 2, 32, 8, torch.float32)
    _write_both_ways(batch)
    is_decode = torch.tensor([True] + [False] * 9 + [True], device=DEVICE)
    out = torch.full_like(batch.query, 7.0)
    kernels.paged_attention_decode(*batch.attention_args(), out, scale=0.2)
    assert (out[~is_decode] == 7.0).all()
    out = torch.full_like(batch.query, 7.0)
    tiles = kernels.build_prefill_tiles(batch.query_start_loc, batch.query.shape[0])
    kernels.paged_attention_prefill(*batch.attention_args(), *tiles, out, scale=0.2)
    assert (out[is_decode] == 7.0).all()


def test_write_skips_padding_slots() -> None:
    batch = make_batch([(3, 0), (2, 5)], 2, 2, 32, 8, torch.float16)
    batch.slot_mapping[1] = -1  # a padding token
    _write_both_ways(batch)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantized_cache_matches_reference(cache_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """fp8/int8 caches: the write stores the bytes ``tokenmill.attention.kv_quant`` defines (codes, then the row's
    float32 scale), and both kernels attend over the dequantized rows, read in the query's dtype. Slots no request
    owns hold NaN rows (NaN scales), so a stray read still shows."""
    batch = make_batch([(1, 30), (19, 12), (1, 3), (0, 2)], 6, 2, 32, 8, dtype, seed=7)
    for name in ("key_cache", "value_cache"):
        setattr(batch, name, quantize_kv(getattr(batch, name), cache_dtype))  # [blocks, block_size, kv_heads, 36]
    expected_cache = [cache.clone() for cache in (batch.key_cache, batch.value_cache)]
    for cache, new in zip(expected_cache, (batch.key, batch.value), strict=True):
        cache.view(torch.uint8).view(-1, 2, 36)[batch.slot_mapping] = quantize_kv(new, cache_dtype).view(torch.uint8)
    kernels.write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.slot_mapping)
    for got, expected in zip((batch.key_cache, batch.value_cache), expected_cache, strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))

    scale = 32**-0.5
    widened = [dequantize_kv(cache, dtype) for cache in (batch.key_cache, batch.value_cache)]
    expected = paged_attention_reference(batch.query, *widened, *batch.attention_args()[3:], scale, 6)
    tiles = kernels.build_prefill_tiles(batch.query_start_loc, batch.query.shape[0])
    out = kernels.paged_attention(*batch.attention_args(), tiles, scale=scale, sliding_window=6)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    split = torch.zeros_like(out)
    kernels.paged_attention_decode(*batch.attention_args(), split, scale=scale, sliding_window=6, num_splits=2)
    torch.testing.assert_close(split[:1], expected[:1], **tolerance(dtype))  # the first request decodes


def test_quantized_write_rounds_ties_to_even_as_torch() -> None:
    """Rows whose absmax makes the scale exactly 1 put values on the midpoints between codes: e4m3 normals and
    subnormals, and int8 halves, must round to even as torch's conversions do."""
    fp8_row = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 0.01513671875, -5 * 2.0**-10])
    int8_row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -3.5])
    for row, cache_dtype in ((fp8_row, torch.float8_e4m3fn), (int8_row, torch.int8)):
        key = torch.cat([row, torch.zeros(24)]).view(1, 1, 32).to(DEVICE)
        cache = torch.zeros(1, 8, 1, 36, dtype=cache_dtype, device=DEVICE)
        kernels.write_kv_cache(key, key, cache, cache.clone(), torch.tensor([3], device=DEVICE))
        assert torch.equal(cache[0, 3].view(torch.uint8), quantize_kv(key[0], cache_dtype).view(torch.uint8))
        codes = cache[0, 3, 0, :8]
        expected_codes = row.to(cache_dtype) if cache_dtype == torch.float8_e4m3fn else row.round().to(torch.int8)
        assert torch.equal(codes.view(torch.uint8), expected_codes.to(DEVICE).view(torch.uint8))


def test_prefill_tile_table() -> None:
    """Tiles of 16 query tokens for requests with more than one; decode and padding requests get none."""
    query_lens = [1, 40, 0, 16, 2, 1]
    query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    tile_req, tile_start = kernels.build_prefill_tiles(query_start_loc, sum(query_lens))
    assert len(tile_req) == sum(query_lens) // 16 + len(query_lens)
    real = tile_req >= 0
    assert tile_req[real].tolist() == [1, 1, 1, 3, 4]
    assert tile_start[real].tolist() == [0, 16, 32, 0, 0]
    assert not real[real.sum() :].any() and (tile_start[~real] == -1).all()
    empty_req, empty_start = kernels.build_prefill_tiles(torch.zeros(1, dtype=torch.int32), 0)
    assert empty_req.numel() == empty_start.numel() == 0


def test_choose_num_splits() -> None:
    assert kernels.choose_num_splits(num_reqs=256, num_kv_heads=8, max_seq_len=32768, num_sms=132) == 1
    assert kernels.choose_num_splits(num_reqs=1, num_kv_heads=8, max_seq_len=100, num_sms=132) == 1
    assert kernels.choose_num_splits(num_reqs=1, num_kv_heads=8, max_seq_len=2048, num_sms=132) == 8
    assert kernels.choose_num_splits(num_reqs=1, num_kv_heads=2, max_seq_len=1 << 20, num_sms=132) == 16


def test_launchers_check_their_arguments() -> None:
    batch = make_batch([(1, 4), (3, 0)], 4, 2, 64, 8, torch.float32)
    out = torch.empty_like(batch.query)
    args = batch.attention_args()

    def decode(*replaced: tuple[int, torch.Tensor], out: torch.Tensor = out, sliding_window: int | None = None) -> None:
        patched = list(args)
        for index, tensor in replaced:
            patched[index] = tensor
        kernels.paged_attention_decode(*patched, out, scale=1.0, sliding_window=sliding_window)

    with pytest.raises(ValueError, match="block_tables must be torch.int32"):
        decode((3, batch.block_tables.long()))
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        decode((0, batch.query[..., :48]), (1, batch.key_cache[..., :48]), (2, batch.value_cache[..., :48]))
    with pytest.raises(ValueError, match="query's head_dim must be contiguous"):
        decode((0, batch.query.transpose(1, 2).contiguous().transpose(1, 2)))
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        decode((0, batch.query[:, :3]), out=out[:, :3])
    with pytest.raises(ValueError, match="query dtype torch.float16 != cache dtype torch.float32"):
        decode((0, batch.query.half()), out=out.half())
    with pytest.raises(ValueError, match=r"seq_lens must have shape \(2,\)"):
        decode((4, batch.seq_lens[:1]))
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        decode(sliding_window=0)
    with pytest.raises(ValueError, match="value_cache"):
        decode((2, batch.value_cache[:-1]))
    with pytest.raises(ValueError, match="key must be"):
        kernels.write_kv_cache(batch.key[:, :1], batch.value, batch.key_cache, batch.value_cache, batch.slot_mapping)
    quantized = torch.zeros(*batch.key_cache.shape, dtype=torch.int8, device=DEVICE)  # rows of 64: head_dim 60
    with pytest.raises(ValueError, match=r"head_dim 60 is not supported.*rows are head_dim \+ 4 long"):
        decode((1, quantized), (2, quantized))


_COMPILE_FOR_SM90 = """
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill_kernels.paged_attention import triton as kernels

INDEX_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "tile_req_ptr", "tile_start_ptr"}

def arg_type(name):
    if name in INDEX_POINTERS:
        return "*i32"
    if name in ("positions_ptr", "slot_mapping_ptr"):
        return "*i64"
    if name.startswith("partial") or name.endswith("_scale_ptr"):
        return "*fp32"
    if name.endswith("_cache_ptr"):
        return CACHE
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name == "scale_log2" else "i32"

def compile_for_sm90(kernel, **constexprs):
    names = inspect.signature(kernel.fn).parameters
    signature = {name: "constexpr" if name in constexprs else arg_type(name) for name in names}
    triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

# QUANT 0: a bfloat16 cache; 1: float8 e4m3 codes as bytes; 2: int8 codes
for QUANT, CACHE in ((0, "*bf16"), (1, "*u8"), (2, "*i8")):
    shapes = dict(HEAD_DIM=64, BLOCK_SIZE=16, TILE_N=32, USE_WINDOW=True, DOT_FP32=False, QUANT=QUANT)
    compile_for_sm90(kernels._write_kv_cache_kernel, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_T=16, QUANT=QUANT)
    compile_for_sm90(kernels._decode_kernel, GROUP=4, GROUP_PAD=16, NUM_SPLITS=2, **shapes)
    compile_for_sm90(kernels._prefill_kernel, GROUP=3, HEADS_PER_PROGRAM=4, BLOCK_Q=16, **shapes)
compile_for_sm90(kernels._decode_reduce_kernel, HEAD_DIM=64, NUM_SPLITS=3, NUM_SPLITS_PAD=4)
print("compiled")
"""


@pytest.mark.slow
def test_triton_kernels_compile_for_a_gpu_without_one() -> None:
    """The interpreter accepts code the GPU compiler rejects (a non-constexpr global, say): compile each
    kernel for sm_90 through Triton's own compiler and ptxas, in a process without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's warning about a changing default
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "compiled"


# ---------------------------------------------------------------- CUDA (CuPy) decode kernel


def test_cuda_source_ships_every_entry_point() -> None:
    """The .cu is package data, and defines one kernel per (dtype, head_dim) the launcher can ask for."""
    source = cuda_kernels.cuda_source()
    for dtype_name, head_dim in itertools.product(("f32", "f16", "bf16"), cuda_kernels.SUPPORTED_HEAD_DIMS):
        assert f"DEFINE_DECODE_KERNEL(paged_attention_decode_{dtype_name}_d{head_dim}," in source


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: the CUDA source is not compiled")
def test_cuda_source_compiles_to_ptx(tmp_path: Path) -> None:
    """Compiles decode.cu with nvcc (no GPU needed), so a syntax error shows up without one."""
    source = tmp_path / "decode.cu"
    source.write_text(cuda_kernels.cuda_source())
    result = subprocess.run(
        ["nvcc", "-ptx", "-arch=sm_80", "-std=c++14", "-o", str(tmp_path / "decode.ptx"), str(source)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "decode.ptx").read_text().count(".entry paged_attention_decode_") == 12


_CUDA_SKIP_REASON = cuda_kernels.unavailable_reason()
needs_cuda_kernel = pytest.mark.skipif(
    _CUDA_SKIP_REASON is not None, reason=f"CUDA kernel cannot run here: {_CUDA_SKIP_REASON}"
)


@pytest.mark.gpu
@needs_cuda_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_cuda_decode_matches_reference(
    dtype: torch.dtype, head_dim: int, block_size: int, heads: tuple[int, int]
) -> None:
    batch = make_batch(BATCHES[2] + [(1, 700)], *heads, head_dim, block_size, dtype, device="cuda")
    _write_both_ways(batch)
    is_decode = torch.repeat_interleave(batch.query_start_loc.diff() == 1, batch.query_start_loc.diff().long())
    for window in WINDOWS:
        expected = batch.reference(head_dim**-0.5, window)
        out = torch.full_like(batch.query, 7.0)
        cuda_kernels.paged_attention_decode_cuda(
            *batch.attention_args(), out, scale=head_dim**-0.5, sliding_window=window
        )
        torch.testing.assert_close(out[is_decode], expected[is_decode], **tolerance(dtype), msg=f"window={window}")
        assert (out[~is_decode] == 7.0).all()  # prefill rows are the Triton prefill kernel's


# ---------------------------------------------------------------- Triton on a real GPU: larger sizes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the larger Triton grid needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(32, 8), (28, 4), (16, 16)])
def test_triton_on_gpu_long_contexts(
    dtype: torch.dtype, head_dim: int, block_size: int, heads: tuple[int, int]
) -> None:
    requests = [(1, 3000), (300, 1000), (1, 17), (129, 0), (0, 40), (1, 1)]
    batch = make_batch(requests, *heads, head_dim, block_size, dtype, device="cuda")
    _write_both_ways(batch)
    tiles = kernels.build_prefill_tiles(batch.query_start_loc, batch.query.shape[0])
    for window, num_splits in itertools.product((None, 256), (1, 4)):
        expected = batch.reference(head_dim**-0.5, window)
        out = kernels.paged_attention(
            *batch.attention_args(), tiles, scale=head_dim**-0.5, sliding_window=window, num_splits=num_splits
        )
        torch.testing.assert_close(out, expected, **tolerance(dtype), msg=f"window={window} splits={num_splits}")
