"""Triton kernels for attention over the paged KV cache, with their launchers.

Three kernels (plus a reduction), all reading the cache through block tables:

- ``write_kv_cache``: one program per (16 new tokens, KV head) stores their keys
  and values in their slots; a negative slot marks a padding token and is skipped.
- ``paged_attention_decode``: one program per (request, KV head, split). The
  program loads the query rows of every query head that shares the KV head
  (the GQA group, padded to 16 rows for ``tl.dot``) and streams the request's
  keys in tiles of ``TILE_N`` positions with an online softmax, so each K/V
  tile is read once for the whole group. Requests whose query length is not 1
  exit at once. With ``num_splits > 1`` (flash-decoding), each program covers
  a slice of the key tiles and writes a partial output and its log-sum-exp;
  ``_decode_reduce_kernel`` merges the slices.
- ``paged_attention_prefill``: one program per (query tile, KV head, head
  chunk). A query tile is ``PREFILL_BLOCK_Q`` consecutive tokens of one
  request; its rows are (token, query head) pairs of one GQA group, and it
  streams keys up to its last token's position, causally masked per row.
  ``build_prefill_tiles`` lays out the tile table on the device, once per step.

A key tile is independent of the cache's block size: each key position looks
up its own block id, so any block size works and a tile may span blocks.
Scores and the softmax are float32; probabilities are rounded to the cache
dtype before the P·V product (as flash attention does).

The cache is in the query's dtype, or quantized (``QUANTIZED_DTYPES``, the format of
``tokenmill.attention.kv_quant``): each (token, KV head) row is ``head_dim`` one-byte codes,
float8 e4m3 or int8, then the row's float32 scale (absmax / 448 or / 127), so the cache's last
dimension is ``head_dim + 4``. The write quantizes (codes rounded to nearest even, as torch's
conversions do, computed with integer and float32 arithmetic rather than Triton's float8 type,
so that it runs on any GPU and under the interpreter alike); attention dequantizes each key and
value tile to the query's dtype as it loads it. The launchers pass a quantized cache twice: as
its codes (bytes) and as float32 words, through which the kernels read and write the scales.

On a machine without a GPU the kernels run under the Triton interpreter, which
is chosen when the kernels are decorated: ``TRITON_INTERPRET=1`` must be in
the environment before this module is imported (``is_interpreted`` tells).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = [
    "MAX_NUM_SPLITS",
    "PREFILL_BLOCK_Q",
    "QUANTIZED_DTYPES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "build_prefill_tiles",
    "choose_num_splits",
    "is_interpreted",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "write_kv_cache",
]

#: Query tokens per prefill program; ``build_prefill_tiles`` lays out its tile table with it.
PREFILL_BLOCK_Q = 16
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Cache dtypes stored as codes plus a float32 scale per row, for queries of any ``SUPPORTED_DTYPES``.
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8)
#: The kernels' ``QUANT`` argument per cache dtype: 0 float, 1 float8 e4m3, 2 int8.
_QUANT = {torch.float8_e4m3fn: 1, torch.int8: 2}
#: Bytes of a quantized row's scale, after its codes.
_SCALE_BYTES = 4
#: Most key slices one decode request is split into.
MAX_NUM_SPLITS = 16
#: A split should cover at least this many keys, or merging costs more than it saves.
_MIN_KEYS_PER_SPLIT = 256
#: Rows of a program's query tile are at least this many: older Triton versions need M >= 16 in ``tl.dot``.
_MIN_DOT_ROWS = 16
#: Most rows (query tokens x query heads) of one prefill program: its float32 accumulator is rows x head_dim.
_MAX_PREFILL_ROWS = 128
#: Tokens per program of the cache write.
_WRITE_BLOCK_T = 16
#: Finite stand-in for -inf as the running maximum, so that a fully masked tile gives exp2(-inf - m) = 0, not NaN.
_NEG_LARGE = tl.constexpr(-1.0e30)


def is_interpreted() -> bool:
    """Whether these kernels were decorated for the Triton interpreter (``TRITON_INTERPRET=1`` at import).

    Called by the Triton attention backend at construction to refuse CPU runs
    that would fail at the first launch.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_kernel, InterpretedFunction)


# ---------------------------------------------------------------- kernels


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    query_pos,
    row_valid,
    key_start,
    seq_len,
    window,
    block_table_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kv_head,
    scale_log2,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One key tile of the online softmax: returns the updated (acc, m_i, l_i). Scores are in log2 units."""
    key_pos = key_start + tl.arange(0, TILE_N)
    in_seq = key_pos < seq_len
    block_ids = tl.load(block_table_ptr + key_pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
    slots = block_ids * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_offset + kv_head * stride_cache_head
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_cache_ptr + slots[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0)  # [TILE_N, HEAD_DIM]
    v = tl.load(v_cache_ptr + slots[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0)
    if QUANT != 0:
        # Codes times their row's scale (a float32 word after the row's HEAD_DIM bytes), in the query's dtype.
        k_scale = tl.load(k_scale_ptr + (slots + HEAD_DIM) // 4, mask=in_seq, other=0.0)  # [TILE_N]
        v_scale = tl.load(v_scale_ptr + (slots + HEAD_DIM) // 4, mask=in_seq, other=0.0)
        if QUANT == 1:
            # An e4m3 code moved into float16's bit fields (sign to bit 15, the rest up by 7) is a float16
            # 2^-8 times its value, subnormals included (the exponent biases differ by 8): widen, times 256.
            k = k.to(tl.int32)
            k = (((k & 0x7F) << 7) | ((k & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
            v = v.to(tl.int32)
            v = (((v & 0x7F) << 7) | ((v & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
            k_scale = k_scale * 256.0
            v_scale = v_scale * 256.0
        k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)

    # DOT_FP32: float32 must not fall back to TF32, and the interpreter multiplies bfloat16 operands
    # wrongly (triton 3.9): both take an exact float32 product. (Inline, not a helper: each jit call
    # costs the interpreter a re-patch of triton.language.)
    if DOT_FP32:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores *= scale_log2  # [M, TILE_N]
    allowed = in_seq[None, :] & (key_pos[None, :] <= query_pos[:, None]) & row_valid[:, None]
    if USE_WINDOW:
        allowed = allowed & (key_pos[None, :] > query_pos[:, None] - window)
    scores = tl.where(allowed, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(v.dtype)  # rounded to the cache (or query) dtype for the P·V product, as flash attention does
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, m_new, l_i


@triton.jit
def _store_quantized(
    rows,  # [BLOCK_T, HEAD_DIM]
    codes_ptr,
    scale_ptr,
    dest,  # [BLOCK_T] int64: each row's first code
    mask,  # [BLOCK_T, 1]
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Quantize rows as ``tokenmill.attention.kv_quant`` does and store codes and scales."""
    rows = rows.to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(rows), axis=1), 448.0 if QUANT == 1 else 127.0)  # [BLOCK_T]
    scaled = tl.math.div_rn(rows, tl.where(scale > 0, scale, 1.0)[:, None])  # |scaled| <= 448 (or 127)
    if QUANT == 1:
        # float32 -> e4m3, rounded to nearest even: normals round the 23-bit mantissa to 3 and rebias the
        # exponent (127 -> 7); below 2^-6 the subnormal step is 2^-9, and adding 2^23 to a * 512 rounds it.
        bits = scaled.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
        a = magnitude.to(tl.float32, bitcast=True)
        subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        codes = tl.where(a < 0.015625, subnormal, normal) | ((bits >> 24) & 0x80)
    else:
        # round to nearest even (adding 1.5 * 2^23 does it), then clamp
        codes = tl.minimum(tl.maximum((scaled + 12582912.0) - 12582912.0, -127.0), 127.0).to(tl.int32)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(codes_ptr + dest[:, None] + offs_d[None, :], codes.to(codes_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + (dest[:, None] + HEAD_DIM) // 4, scale[:, None], mask=mask)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    QUANT: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    kv_head = tl.program_id(1)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    is_real = slots >= 0  # a negative slot marks a padding token
    tokens = tokens.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = is_real[:, None]
    key = tl.load(
        key_ptr + tokens[:, None] * stride_key_token + kv_head * stride_key_head + offs_d[None, :], mask=mask
    )  # [BLOCK_T, HEAD_DIM]
    value = tl.load(
        value_ptr + tokens[:, None] * stride_value_token + kv_head * stride_value_head + offs_d[None, :], mask=mask
    )
    dest = (
        (slots // BLOCK_SIZE) * stride_cache_block
        + (slots % BLOCK_SIZE) * stride_cache_offset
        + kv_head * stride_cache_head
    )
    if QUANT == 0:
        tl.store(k_cache_ptr + dest[:, None] + offs_d[None, :], key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dest[:, None] + offs_d[None, :], value.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        _store_quantized(key, k_cache_ptr, k_scale_ptr, dest, mask, HEAD_DIM, QUANT)
        _store_quantized(value, v_cache_ptr, v_scale_ptr, dest, mask, HEAD_DIM, QUANT)


@triton.jit
def _decode_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    positions_ptr,
    scale_log2,
    window,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_tables,
    stride_partial_req,
    stride_partial_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token != 1:  # a prefill chunk or a padding request
        return
    token = token.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    pos = tl.load(positions_ptr + token)

    rows = tl.arange(0, GROUP_PAD)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr + token * stride_query_token + heads[:, None] * stride_query_head + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # [GROUP_PAD, HEAD_DIM]
    query_pos = tl.zeros([GROUP_PAD], dtype=tl.int64) + pos

    # Keys [lo, hi): causal end, window start, split into NUM_SPLITS slices of whole tiles.
    hi = tl.minimum(seq_len, pos + 1)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    lo = (lo // TILE_N) * TILE_N
    num_tiles = tl.maximum(tl.cdiv(hi - lo, TILE_N), 0)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    m_i = tl.zeros([GROUP_PAD], dtype=tl.float32) + _NEG_LARGE
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_block_tables
    for tile in range(tile_begin, tile_end):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, query_pos, row_valid, lo + tile * TILE_N, seq_len, window,
            block_table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, scale_log2,
            stride_cache_block, stride_cache_offset, stride_cache_head,
            HEAD_DIM, BLOCK_SIZE, TILE_N, USE_WINDOW, DOT_FP32, QUANT,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty sequence or slice has acc == 0: its output is 0
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
    else:
        partial = req.to(tl.int64) * stride_partial_req + heads * stride_partial_head + split  # [GROUP_PAD]
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_valid[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(partial_lse_ptr + partial, lse, mask=row_valid)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    query_start_loc_ptr,
    stride_out_token,
    stride_out_head,
    stride_partial_req,
    stride_partial_head,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - token != 1:
        return
    token = token.to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS_PAD)
    is_split = splits < NUM_SPLITS
    partial = req.to(tl.int64) * stride_partial_req + head * stride_partial_head + splits
    lse = tl.load(partial_lse_ptr + partial, mask=is_split, other=float("-inf"))  # [NUM_SPLITS_PAD]
    lse_max = tl.max(lse, axis=0)
    weights = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - lse_max))
    offs_d = tl.arange(0, HEAD_DIM)
    parts = tl.load(
        partial_out_ptr + partial[:, None] * HEAD_DIM + offs_d[None, :], mask=is_split[:, None], other=0.0
    )  # [NUM_SPLITS_PAD, HEAD_DIM]
    total = tl.sum(weights, axis=0)
    out = tl.sum(parts * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + offs_d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    positions_ptr,
    tile_req_ptr,
    tile_start_ptr,
    scale_log2,
    window,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_tables,
    GROUP: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    head_chunk = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    if req < 0:  # the tile table is padded to a length known without a device sync
        return
    tile_start = tl.load(tile_start_ptr + tile)  # first query token of the tile, within the request
    token_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - token_start
    seq_len = tl.load(seq_lens_ptr + req)

    # Row r is query token r // HEADS_PER_PROGRAM of the tile, for head r % HEADS_PER_PROGRAM of the chunk.
    rows = tl.arange(0, BLOCK_Q * HEADS_PER_PROGRAM)
    row_token = tile_start + rows // HEADS_PER_PROGRAM
    head_in_group = head_chunk * HEADS_PER_PROGRAM + rows % HEADS_PER_PROGRAM
    row_valid = (row_token < query_len) & (head_in_group < GROUP)
    tokens = (token_start + row_token).to(tl.int64)
    heads = kv_head * GROUP + head_in_group
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr + tokens[:, None] * stride_query_token + heads[:, None] * stride_query_head + offs_d[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # [BLOCK_Q * HEADS_PER_PROGRAM, HEAD_DIM]
    query_pos = tl.load(positions_ptr + tokens, mask=row_valid, other=0)

    # The tile's keys: up to its latest query position, from its earliest one's window start.
    hi = tl.minimum(seq_len, tl.max(tl.where(row_valid, query_pos, -1), axis=0) + 1)
    lo = 0
    if USE_WINDOW:
        first_pos = tl.min(tl.where(row_valid, query_pos, hi), axis=0)
        lo = tl.maximum(first_pos - window + 1, 0)
    lo = (lo // TILE_N) * TILE_N

    acc = tl.zeros([BLOCK_Q * HEADS_PER_PROGRAM, HEAD_DIM], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_Q * HEADS_PER_PROGRAM], dtype=tl.float32) + _NEG_LARGE
    l_i = tl.zeros([BLOCK_Q * HEADS_PER_PROGRAM], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * stride_block_tables
    for key_start in range(lo, hi, TILE_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, query_pos, row_valid, key_start, seq_len, window,
            block_table_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv_head, scale_log2,
            stride_cache_block, stride_cache_offset, stride_cache_head,
            HEAD_DIM, BLOCK_SIZE, TILE_N, USE_WINDOW, DOT_FP32, QUANT,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_out_token + heads[:, None] * stride_out_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


# ---------------------------------------------------------------- launchers


def _expect(condition: bool, message: str) -> None:
    """A launcher's argument check: raises instead of launching a kernel that would read out of bounds."""
    if not condition:
        raise ValueError(message)


def _cache_head_dim(cache: torch.Tensor) -> int:
    """head_dim of a cache: its last dimension, less a quantized cache's scale bytes."""
    return cache.shape[-1] - (_SCALE_BYTES if cache.dtype in QUANTIZED_DTYPES else 0)


def _cache_args(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What a kernel takes for a cache: its codes (or values), the tensor its scales are read through (float32
    words over the same bytes), and ``QUANT``. A float cache stands in for its own (unused) scales."""
    quant = _QUANT.get(cache.dtype, 0)
    if not quant:
        return cache, cache, 0
    codes = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    return codes, cache.view(torch.float32), quant


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _expect(
        key_cache.dim() == 4,
        f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(key_cache.shape)}",
    )
    _expect(
        value_cache.shape == key_cache.shape and value_cache.stride() == key_cache.stride(),
        f"value_cache {tuple(value_cache.shape)}/{value_cache.stride()} must match key_cache "
        f"{tuple(key_cache.shape)}/{key_cache.stride()} in shape and strides",
    )
    _expect(key_cache.stride(-1) == 1, f"the cache's head_dim must be contiguous, got strides {key_cache.stride()}")
    _expect(value_cache.dtype == key_cache.dtype, f"cache dtypes differ: {key_cache.dtype} and {value_cache.dtype}")
    dtypes = SUPPORTED_DTYPES + QUANTIZED_DTYPES
    _expect(key_cache.dtype in dtypes, f"cache dtype {key_cache.dtype} is not one of {dtypes}")
    _expect(
        _cache_head_dim(key_cache) in SUPPORTED_HEAD_DIMS,
        f"head_dim {_cache_head_dim(key_cache)} is not supported; the kernels take {SUPPORTED_HEAD_DIMS}"
        + (" (a quantized cache's rows are head_dim + 4 long)" if key_cache.dtype in QUANTIZED_DTYPES else ""),
    )
    _expect(value_cache.device == key_cache.device, "key_cache and value_cache are on different devices")


def _check_index(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    _expect(tuple(tensor.shape) == shape, f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    _expect(tensor.dtype in dtypes, f"{name} must be {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
    _expect(tensor.dim() == 0 or tensor.stride(-1) == 1, f"{name} must be contiguous in its last dim")


def _check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
) -> None:
    _check_cache(key_cache, value_cache)
    _expect(query.dim() == 3, f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    cache_head_dim = _cache_head_dim(key_cache)
    _expect(head_dim == cache_head_dim, f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    _expect(num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    _expect(query.stride(-1) == 1, f"query's head_dim must be contiguous, got strides {query.stride()}")
    _expect(
        query.dtype == key_cache.dtype or (key_cache.dtype in QUANTIZED_DTYPES and query.dtype in SUPPORTED_DTYPES),
        f"query dtype {query.dtype} != cache dtype {key_cache.dtype}",
    )
    _expect(out.shape == query.shape and out.dtype == query.dtype, "out must have the query's shape and dtype")
    _expect(out.stride(-1) == 1, f"out's head_dim must be contiguous, got strides {out.stride()}")
    num_reqs = query_start_loc.shape[0] - 1
    _check_index("seq_lens", seq_lens, (num_reqs,), (torch.int32,))
    _check_index("query_start_loc", query_start_loc, (num_reqs + 1,), (torch.int32,))
    _check_index("positions", positions, (num_tokens,), (torch.int64, torch.int32))
    _expect(
        block_tables.dim() == 2 and block_tables.shape[0] == num_reqs,
        f"block_tables must be [num_reqs={num_reqs}, max_num_blocks], got {tuple(block_tables.shape)}",
    )
    _check_index("block_tables", block_tables, tuple(block_tables.shape), (torch.int32,))
    for name, tensor in (("key_cache", key_cache), ("block_tables", block_tables), ("seq_lens", seq_lens),
                         ("query_start_loc", query_start_loc), ("positions", positions), ("out", out)):  # fmt: skip
        _expect(tensor.device == query.device, f"{name} is on {tensor.device}, query on {query.device}")
    _expect(
        query.device.type == "cuda" or is_interpreted(),
        f"Triton kernels on {query.device.type} need TRITON_INTERPRET=1 set before tokenmill_kernels is imported",
    )


def _default_tile_n(head_dim: int) -> int:
    return 32 if head_dim >= 256 else 64  # K and V tiles of TILE_N x head_dim stay within 32 KiB in fp16


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreted())


def _window_args(sliding_window: int | None) -> tuple[int, bool]:
    _expect(sliding_window is None or sliding_window > 0, f"sliding_window must be positive, got {sliding_window}")
    return (sliding_window or 0), sliding_window is not None


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative for padding tokens
) -> None:
    """Store each new token's key and value in its cache slot (cast to the cache dtype, or quantized).

    Called by the Triton and CUDA attention backends once per layer per step,
    before attention. Padding tokens (slot < 0) are skipped.
    """
    _check_cache(key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2], _cache_head_dim(key_cache)
    num_tokens = slot_mapping.shape[0]
    for name, tensor in (("key", key), ("value", value)):
        _expect(
            tuple(tensor.shape) == (num_tokens, num_kv_heads, head_dim),
            f"{name} must be [num_tokens={num_tokens}, {num_kv_heads}, {head_dim}], got {tuple(tensor.shape)}",
        )
        _expect(tensor.stride(-1) == 1, f"{name}'s head_dim must be contiguous, got strides {tensor.stride()}")
        _expect(tensor.device == key_cache.device, f"{name} is on {tensor.device}, the cache on {key_cache.device}")
    _check_index("slot_mapping", slot_mapping, (num_tokens,), (torch.int64, torch.int32))
    if num_tokens == 0:
        return
    k_codes, k_scales, quant = _cache_args(key_cache)
    v_codes, v_scales, _ = _cache_args(value_cache)
    _write_kv_cache_kernel[(triton.cdiv(num_tokens, _WRITE_BLOCK_T), num_kv_heads)](
        key, value, k_codes, v_codes, k_scales, v_scales, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1], BLOCK_T=_WRITE_BLOCK_T, QUANT=quant,
    )  # fmt: skip


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many key slices each decode request gets: enough programs to fill ``num_sms``, each slice >= 256 keys.

    Called by the backends per layer from host integers only (no device sync).
    Large batches get 1: there are programs enough without splitting.
    """
    programs = max(num_reqs * num_kv_heads, 1)
    if programs >= num_sms:
        return 1
    return max(1, min(MAX_NUM_SPLITS, triton.cdiv(num_sms, programs), max_seq_len // _MIN_KEYS_PER_SPLIT))


def paged_attention_decode(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written for decode tokens only
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    tile_n: int | None = None,
) -> None:
    """Attention for every request whose query length is 1; rows of other requests' tokens are left as they are.

    Called by the attention backends once per layer per step (after
    ``write_kv_cache``), and by the kernel tests. ``num_splits > 1`` splits
    each request's keys over that many programs and merges them (flash-decoding).
    """
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, positions, out)
    _expect(1 <= num_splits <= MAX_NUM_SPLITS, f"num_splits must be in [1, {MAX_NUM_SPLITS}], got {num_splits}")
    num_reqs = seq_lens.shape[0]  # checked equal to len(query_start_loc) - 1
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    tile_n = tile_n or _default_tile_n(head_dim)
    _expect(tile_n >= 16 and tile_n & (tile_n - 1) == 0, f"tile_n must be a power of two >= 16, got {tile_n}")
    window, use_window = _window_args(sliding_window)
    if num_reqs == 0:
        return
    if num_splits > 1:
        partial_out = torch.empty(
            num_reqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )  # [num_reqs, num_heads, num_splits, head_dim]
        partial_lse = torch.empty(
            num_reqs, num_heads, num_splits, dtype=torch.float32, device=query.device
        )  # [num_reqs, num_heads, num_splits]
    else:
        partial_out = partial_lse = out  # unused: the kernel writes the output directly
    stride_partial_req, stride_partial_head = num_heads * num_splits, num_splits
    k_codes, k_scales, quant = _cache_args(key_cache)
    v_codes, v_scales, _ = _cache_args(value_cache)
    _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        out, partial_out, partial_lse, query, k_codes, v_codes, k_scales, v_scales,
        block_tables, seq_lens, query_start_loc, positions,
        scale * 1.4426950408889634, window,  # log2(e): the kernel uses exp2
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        stride_partial_req, stride_partial_head,
        GROUP=group, GROUP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1], TILE_N=tile_n, NUM_SPLITS=num_splits, USE_WINDOW=use_window,
        DOT_FP32=_dot_fp32(query.dtype), QUANT=quant, num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            out, partial_out, partial_lse, query_start_loc,
            out.stride(0), out.stride(1), stride_partial_req, stride_partial_head,
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )  # fmt: skip


def build_prefill_tiles(
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    num_tokens: int,
    block_q: int = PREFILL_BLOCK_Q,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill tile table: request and first query token of each ``block_q``-token tile of every request
    whose query length is > 1. Returns ``(tile_req, tile_start)``, both ``[num_tokens // block_q + num_reqs]``
    int32, padded with ``-1``.

    Called by the backends' ``prepare`` once per step. Runs on the device with
    no host sync: the table's length is a bound computed from shapes alone.
    """
    device = query_start_loc.device
    num_reqs = query_start_loc.shape[0] - 1
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [num_reqs]
    num_tiles = torch.where(query_lens > 1, (query_lens + block_q - 1) // block_q, 0)  # [num_reqs]
    tile_ends = torch.cumsum(num_tiles, 0)  # [num_reqs]
    max_tiles = num_tokens // block_q + num_reqs  # sum of ceil(len / block_q) never exceeds this
    tiles = torch.arange(max_tiles, device=device)  # [max_tiles]
    tile_req = torch.searchsorted(tile_ends, tiles, right=True)  # [max_tiles]; num_reqs past the last tile
    is_tile = tile_req < num_reqs
    req = tile_req.clamp(max=max(num_reqs - 1, 0))
    tile_start = (tiles - (tile_ends[req] - num_tiles[req])) * block_q if num_reqs else tiles
    tile_req = torch.where(is_tile, tile_req, -1).to(torch.int32)
    tile_start = torch.where(is_tile, tile_start, -1).to(torch.int32)
    return tile_req, tile_start


def paged_attention_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    tile_req: torch.Tensor,  # [max_tiles] int32, from build_prefill_tiles
    tile_start: torch.Tensor,  # [max_tiles] int32, from build_prefill_tiles
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written for prefill tokens only
    *,
    scale: float,
    sliding_window: int | None = None,
    tile_n: int | None = None,
) -> None:
    """Causal attention for the tokens of every request with query length > 1 (prefill chunks),
    over their cached prefix and themselves; other rows of ``out`` are left as they are.

    Called by the attention backends once per layer per step when the step has
    a prefill chunk (``max_query_len > 1``), and by the kernel tests.
    """
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, positions, out)
    _expect(
        tile_req.shape == tile_start.shape and tile_req.dim() == 1,
        f"tile_req {tuple(tile_req.shape)} and tile_start {tuple(tile_start.shape)} must be equal 1-d tables",
    )
    _check_index("tile_req", tile_req, tuple(tile_req.shape), (torch.int32,))
    _check_index("tile_start", tile_start, tuple(tile_start.shape), (torch.int32,))
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_rows = _MAX_PREFILL_ROWS if head_dim <= 128 else _MAX_PREFILL_ROWS // 2
    heads_per_program = min(triton.next_power_of_2(group), max(1, max_rows // PREFILL_BLOCK_Q))
    tile_n = tile_n or _default_tile_n(head_dim)
    _expect(tile_n >= 16 and tile_n & (tile_n - 1) == 0, f"tile_n must be a power of two >= 16, got {tile_n}")
    window, use_window = _window_args(sliding_window)
    if tile_req.shape[0] == 0:
        return
    rows = PREFILL_BLOCK_Q * heads_per_program
    k_codes, k_scales, quant = _cache_args(key_cache)
    v_codes, v_scales, _ = _cache_args(value_cache)
    _prefill_kernel[(tile_req.shape[0], num_kv_heads, triton.cdiv(group, heads_per_program))](
        out, query, k_codes, v_codes, k_scales, v_scales, block_tables, seq_lens, query_start_loc, positions,
        tile_req, tile_start, scale * 1.4426950408889634, window,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEADS_PER_PROGRAM=heads_per_program, BLOCK_Q=PREFILL_BLOCK_Q, HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1], TILE_N=tile_n, USE_WINDOW=use_window, DOT_FP32=_dot_fp32(query.dtype),
        QUANT=quant, num_warps=8 if rows * head_dim >= 128 * 128 else 4,
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    prefill_tiles: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a mixed batch: decode requests through the decode kernel, prefill chunks
    through the prefill kernel (skipped when ``prefill_tiles`` is None: a decode-only step).

    Called by the Triton backend once per layer per step and by the kernel
    tests. Returns ``out`` (allocated when not given).
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [num_tokens, num_heads, head_dim]
    paged_attention_decode(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, positions, out,
        scale=scale, sliding_window=sliding_window, num_splits=num_splits,
    )  # fmt: skip
    if prefill_tiles is not None:
        paged_attention_prefill(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, positions, *prefill_tiles, out,
            scale=scale, sliding_window=sliding_window,
        )  # fmt: skip
    return out
