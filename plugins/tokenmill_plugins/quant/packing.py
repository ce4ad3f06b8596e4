"""compressed-tensors' ``pack-quantized`` layout: intN codes packed densely into int32 words.

Each code is offset to unsigned (``code + 2**(bits - 1)``) and code ``i`` of a row occupies bits
``[i * bits, (i + 1) * bits)`` of the row's words, least significant first: for int4, eight codes per
word, the first in the low nibble. Rows are padded with zero codes to whole words. Zero points pack
the same way along the output dimension (``dim=0``). This is what ``compressed_tensors``'
``pack_to_int32`` writes (checked against its ``unpack_from_int32`` in the tests).
"""

from __future__ import annotations

import torch


def pack_int32(codes: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Pack int8 ``codes`` [rows, cols] holding ``num_bits``-bit signed values along ``dim`` into int32."""
    assert codes.dtype == torch.int8 and codes.dim() == 2, (codes.dtype, codes.shape)
    assert num_bits in (1, 2, 4, 8), "codes must not straddle words"
    if dim == 0:
        return pack_int32(codes.T, num_bits, dim=1).T.contiguous()
    per_word = 32 // num_bits
    rows, cols = codes.shape
    num_words = -(-cols // per_word)
    unsigned = codes.to(torch.int64) + (1 << (num_bits - 1))  # [rows, cols]
    unsigned = torch.nn.functional.pad(unsigned, (0, num_words * per_word - cols))
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits  # [per_word]
    words = (unsigned.reshape(rows, num_words, per_word) << shifts).sum(dim=-1)  # [rows, num_words], < 2**32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int32(packed: torch.Tensor, num_bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of ``pack_int32``: int8 codes with ``size`` entries along ``dim``."""
    if dim == 0:
        return unpack_int32(packed.T, num_bits, size, dim=1).T.contiguous()
    per_word = 32 // num_bits
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [rows, num_words]
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    unsigned = (words[:, :, None] >> shifts) & ((1 << num_bits) - 1)  # [rows, num_words, per_word]
    codes = unsigned.reshape(packed.shape[0], -1)[:, :size] - (1 << (num_bits - 1))
    return codes.to(torch.int8)
