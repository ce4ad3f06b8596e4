"""Weight-only quantized matmul: the kernels against the plain-torch reference, and the formats themselves.

Tolerances (kept here on purpose, independent of any shared tolerance table):

* ``TIGHT_RTOL`` - kernel vs ``reference.matmul_*``, which simulates the same activation quantization. The integer
  block dot products are exact in both; what differs is float32 rounding of the block scale products and of the
  running sums (at most K/32/8 + 5 roundings of 2**-24 each, i.e. < 1e-6 for K = 1536). The bound is applied to
  the sum of the absolute values of the terms (``_term_magnitude``), since outputs may cancel to near zero. 1e-5
  leaves 10x headroom while a single wrong weight code in one block already shows up at ~1/K = 6e-4. An
  activation code one off moves the output by ~1/32767 of one term, below any float tolerance, so the kernels'
  activation codes are compared with the reference's exactly instead (``test_activation_codes_match_reference``).
* The loose comparison against plain ``x @ dequantize(W).T`` allows exactly the activation rounding error:
  ``|x - dx * qx| <= dx / 2`` per element, so ``|error| <= sum_g dx[m, g] / 2 * sum_j |w[n, g, j]|``, plus
  ``LOOSE_RTOL`` of ``|x| @ |w|.T`` for float32 summation in either product.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
from tokenmill_kernels import quant_matmul
from tokenmill_kernels.quant_matmul import cpu, reference

from tests.cpu_machine import needs_cpu_kernels

TIGHT_RTOL = 1e-5
LOOSE_RTOL = 1e-5


M_VALUES = (1, 2, 3, 4, 5, 8, 16, 33, 257)  # 257: three passes of the tiles (kRowsPerPass)
K_VALUES = (32, 64, 576, 1536)
N_VALUES = (1, 7, 64, 192, 1536)


def _quantize(kind: str, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return quant_matmul.quantize_int8(weight) if kind == "int8" else quant_matmul.quantize_int4(weight)


def _dequantize(kind: str, packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return quant_matmul.dequantize_int8(*packed) if kind == "int8" else quant_matmul.dequantize_int4(*packed)


def _kernel(kind: str, x: torch.Tensor, packed: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> torch.Tensor:
    return quant_matmul.matmul_int8(x, *packed, bias) if kind == "int8" else quant_matmul.matmul_int4(x, *packed, bias)


def _reference(kind: str, x: torch.Tensor, packed: tuple[torch.Tensor, ...], bias: torch.Tensor | None) -> torch.Tensor:
    return reference.matmul_int8(x, *packed, bias) if kind == "int8" else reference.matmul_int4(x, *packed, bias)


def _term_magnitude(
    kind: str, x: torch.Tensor, packed: tuple[torch.Tensor, ...], bias: torch.Tensor | None
) -> torch.Tensor:
    """Sum of |terms| of the reference sum: quantizing |x| gives |qx| with the same scales."""
    if kind == "int8":
        qweight, scales = packed
        out = reference.matmul_int8(x.abs(), qweight.abs(), scales)
    else:
        qweight, scales, mins = packed
        out = reference.matmul_int4(x.abs(), qweight, scales, mins.abs())
    return out + (bias.abs() if bias is not None else 0.0)


def _random_weight(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    # Rows of different magnitude and an offset, so that scales and (for int4) mins vary across groups.
    w = torch.randn(n, k, generator=generator) * torch.rand(n, 1, generator=generator).add(0.05)
    return w + 0.1 * torch.randn(n, 1, generator=generator)


@functools.cache
def _layer(kind: str, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """Quantized weight, its dequantized form and a bias, shared by every M (quantizing is the slow part)."""
    generator = torch.Generator().manual_seed(n * k)
    packed = _quantize(kind, _random_weight(n, k, generator))
    return packed, _dequantize(kind, packed), torch.randn(n, generator=generator)


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("k", K_VALUES)
@pytest.mark.parametrize("m", M_VALUES)
def test_kernel_matches_reference(kind: str, m: int, k: int) -> None:
    generator = torch.Generator().manual_seed(1000 * m + k)
    x = torch.randn(m, k, generator=generator) * 3.0
    x[:, :32] = 0.0  # an all-zero activation block: dx = 0 must give 0, not NaN
    for n in N_VALUES:
        packed, dense, some_bias = _layer(kind, n, k)
        for bias in (None, some_bias):
            where = f"{kind} M={m} K={k} N={n} bias={bias is not None}"
            out = _kernel(kind, x, packed, bias)
            assert out.shape == (m, n) and out.dtype == torch.float32, where

            expected = _reference(kind, x, packed, bias)
            magnitude = _term_magnitude(kind, x, packed, bias)
            err = (out - expected).abs()
            assert (err <= TIGHT_RTOL * magnitude + 1e-30).all(), f"{where}: max err {err.max():.3g}"

            plain = x @ dense.T + (bias if bias is not None else 0.0)
            _, dx, _ = reference.quantize_activations(x)
            rounding = (dx / 2) @ dense.abs().reshape(n, k // 32, 32).sum(-1).T
            allowed = rounding * (1 + LOOSE_RTOL) + LOOSE_RTOL * (x.abs() @ dense.abs().T + magnitude)
            assert ((out - plain).abs() <= allowed).all(), f"{where}: too far from x @ dequantize(W).T"


ISAS = ("avx2", "avx_vnni", "avx512", "avx512_vnni16", "amx")


def _skip_unless_supported(isa: str) -> None:
    if isa not in cpu.supported_isas():
        pytest.skip(f"this CPU lacks {isa} (it supports {', '.join(cpu.supported_isas())})")


@needs_cpu_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_every_isa_variant_matches_reference(kind: str, isa: str) -> None:
    """``test_kernel_matches_reference`` runs the best variant; this runs each, on every tile shape (M up to 33
    covers full and partial activation tiles: avx512_vnni16 splits 5..12 rows into tiles of 5 or 6 and 4..6; N =
    1, 7 partial weight tiles of 4 rows and strips of 32; K = 128 is one block of four groups for the 512-bit
    nibble tiles, 32 and 576 end in a partial block)."""
    _assert_variant_matches_reference(kind, isa, (32, 128, 576), (1, 3, 4, 5, 6, 7, 9, 32, 33), N_VALUES)


def _assert_variant_matches_reference(
    kind: str, isa: str, k_values: tuple[int, ...], m_values: tuple[int, ...], n_values: tuple[int, ...]
) -> None:
    """Variant ``isa`` against the reference within ``TIGHT_RTOL`` on every shape of the grid, with an all-zero
    activation block in each input of more than one block."""
    _skip_unless_supported(isa)
    before = cpu.isa()
    try:
        cpu.set_isa(isa)
        for k in k_values:
            for m in m_values:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) * 3.0
                x[:, 32:64] = 0.0
                for n in n_values:
                    packed, _, bias = _layer(kind, n, k)
                    err = (_kernel(kind, x, packed, bias) - _reference(kind, x, packed, bias)).abs()
                    allowed = TIGHT_RTOL * _term_magnitude(kind, x, packed, bias) + 1e-30
                    assert (err <= allowed).all(), f"{kind} {isa} M={m} K={k} N={n}: max err {err.max():.3g}"
    finally:
        cpu.set_isa(before)


@needs_cpu_kernels
@pytest.mark.parametrize("isa", ["avx2", "avx_vnni"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_pair_tiles_match_reference(kind: str, isa: str) -> None:
    """From 5 rows on, avx2 and avx_vnni widen each weight row once into two groups per register (the pair tiles):
    group counts that leave the last pair's second group empty (K = 32, 96, 288, 544), Q4_1 min terms over fewer
    than 8 groups, a multiple of 8 and a last 8 that overlaps the previous block (K = 96, 256, 544), partial
    activation tiles (M = 5, 7, 10) and weight rows left after whole tiles (N = 1, 2, 4, 5, 7)."""
    _assert_variant_matches_reference(kind, isa, (32, 96, 256, 288, 544), (5, 6, 7, 10), (1, 2, 4, 5, 7, 64))


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_column_tiles_match_reference(kind: str) -> None:
    """From 5 rows on, avx512_vnni16 lays out strips of 32 weight rows with one pair of codes per lane and 16 rows
    per register (the column tiles): strips cut short in their first or second register and one row past whole
    strips (N = 1, 16, 17, 31, 33, 97), one group and a group count that is not a multiple of anything (K = 32,
    96, 544), every activation tile height (M = 5 to 13: tiles of 5 and 6, 6 and 7 rows split 4 + 3 ...) and
    two passes (M = 130)."""
    _assert_variant_matches_reference(
        kind, "avx512_vnni16", (32, 96, 544), (5, 6, 7, 11, 12, 13, 130), (1, 16, 17, 31, 33, 97)
    )


@needs_cpu_kernels
@pytest.mark.parametrize("isa", ["avx2", "avx_vnni", "avx512", "avx512_vnni16"])
def test_nibble_tiles_match_reference(isa: str) -> None:
    """Under 5 rows, int4 weights are unpacked two groups per 32-byte load (avx2, avx_vnni) or four per 64-byte
    load (avx512, avx512_vnni16): the nibble tiles. Group counts that leave the last pair or block short (K = 32,
    96, 288, 544, 2080), a row of more groups than one chunk of scale products (K = 2080: 65 groups), every
    activation tile (M = 1 to 4) and weight rows left after whole tiles of 4 (N = 1, 3, 5, 7)."""
    _assert_variant_matches_reference("int4", isa, (32, 96, 256, 288, 544, 2080), (1, 2, 3, 4), (1, 3, 4, 5, 7, 64))


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_avx_vnni_is_bit_identical_to_avx2(kind: str) -> None:
    """Both hold a group as two 256-bit halves (int8 under 5 rows) or two groups in four registers (int4 under 5
    rows: the nibble tiles; from 5 rows on: the pair tiles):
    exact integer dot products, then the same float32 operations in the same order. (avx512 sums 16 float lanes
    instead of 8, so it matches them only to float32 rounding.)"""
    _skip_unless_supported("avx_vnni")
    before = cpu.isa()
    try:
        for k in K_VALUES:
            for m in (1, 3, 4, 5, 32, 33):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) * 3.0
                for n in N_VALUES:
                    packed, _, bias = _layer(kind, n, k)
                    cpu.set_isa("avx2")
                    expected = _kernel(kind, x, packed, bias)
                    cpu.set_isa("avx_vnni")
                    assert torch.equal(_kernel(kind, x, packed, bias), expected), f"{kind} M={m} K={k} N={n}"
    finally:
        cpu.set_isa(before)


@needs_cpu_kernels
def test_activation_codes_match_reference() -> None:
    """The kernels round activations exactly as reference.quantize_activations: same int16 codes, scales, sums."""
    generator = torch.Generator().manual_seed(23)
    x = torch.randn(7, 576, generator=generator) * 3.0
    x[0, :32] = 0.0  # dx = 0: codes 0, not NaN
    x[1, 40] = 1e6  # one outlier: the rest of its block rounds to few codes
    x[2, 64:96] = torch.arange(32) - 16.0  # integers
    x[3, 96:128] *= 1e-30  # tiny values, tiny scale
    codes, scales, sums = cpu.quantize_activations(x)
    expected = reference.quantize_activations(x)
    assert codes.dtype == torch.int16 and codes.abs().max() == reference.ACT_MAX
    for got, want in zip((codes, scales, sums), expected, strict=True):
        assert torch.equal(got, want)


@needs_cpu_kernels
def test_set_isa() -> None:
    before = cpu.isa()
    supported = cpu.supported_isas()
    try:
        assert supported[0] == "avx2" and set(supported) <= set(ISAS)
        cpu.set_isa("avx2")
        assert cpu.isa() == "avx2"
        cpu.set_isa("auto")
        assert cpu.isa() == supported[-1]  # the best one
        with pytest.raises(ValueError, match="isa must be"):
            cpu.set_isa("sse2")
    finally:
        cpu.set_isa(before)


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_kernel_is_deterministic_across_thread_counts(kind: str) -> None:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(9, 576, generator=generator)
    packed = _quantize(kind, _random_weight(1537, 576, generator))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _kernel(kind, x, packed, None)
    finally:
        torch.set_num_threads(threads)
    # Threads split the output features, never a sum, so the result is bit-identical.
    assert torch.equal(_kernel(kind, x, packed, None), single)


@needs_cpu_kernels
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_empty_batch(kind: str) -> None:
    packed = _quantize(kind, torch.randn(7, 64))
    out = _kernel(kind, torch.empty(0, 64), packed, None)
    assert out.shape == (0, 7) and out.dtype == torch.float32


def _awkward_weight() -> torch.Tensor:
    """Groups that stress the quantizers: zero, constant, tiny (scales round to 0), large, one outlier, and
    already-integer values."""
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(6, 32 * 8, generator=generator)
    w[0] = 0.0
    w[1, :32] = 0.75
    w[1, 32:64] = -2.0
    w[2] *= 1e-30
    w[3] *= 1e4
    w[4, 5] = 1000.0
    w[5] = torch.arange(32 * 8, dtype=torch.float32) % 16 - 8
    return w


def _float16_edge_weight() -> torch.Tensor:
    """Groups where float16 storage costs precision: scales among its subnormals (fewer significant bits), and
    a min far from 0 against the group's range (int4). Quantizing these is within the error bound but, unlike
    GGUF's own blocks, not always idempotent: the extreme codes may go unused."""
    generator = torch.Generator().manual_seed(4)
    w = torch.randn(2, 32 * 8, generator=generator)
    w[0] *= 1e-4
    w[1] = w[1] * 0.01 + 300.0
    return w


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_is_idempotent(kind: str) -> None:
    """Quantizing a dequantized tensor gives back the same codes and scales, hence identical values."""
    generator = torch.Generator().manual_seed(11)
    for weight in (_random_weight(64, 576, generator), _awkward_weight()):
        packed = _quantize(kind, weight)
        dense = _dequantize(kind, packed)
        again = _quantize(kind, dense)
        for first, second in zip(packed, again, strict=True):
            assert torch.equal(first, second)
        assert torch.equal(_dequantize(kind, again), dense)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantization_error_is_at_most_half_a_step(kind: str) -> None:
    weight = _random_weight(64, 256, torch.Generator().manual_seed(5))
    weight = torch.cat([weight, _awkward_weight(), _float16_edge_weight()])
    packed = _quantize(kind, weight)
    step = packed[1].float().repeat_interleave(32, dim=1)
    # Half a step, plus the float16 rounding of the scale (half an ulp: 2**-11 relative, or 2**-25 absolute
    # among subnormals) applied to the largest code, plus for int4 that of the min.
    largest_code = 127 if kind == "int8" else 15
    allowed = step * (0.5 + largest_code * 2.0**-11) + largest_code * 2.0**-25 + weight.abs() * 2.0**-23
    if kind == "int4":
        allowed += packed[2].float().abs().repeat_interleave(32, dim=1) * 2.0**-11 + 2.0**-25
    assert ((_dequantize(kind, packed) - weight).abs() <= allowed).all()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_scales_and_mins_are_float16(kind: str) -> None:
    packed = _quantize(kind, torch.cat([_awkward_weight(), _float16_edge_weight()]))
    assert [t.dtype for t in packed[1:]] == [torch.float16] * len(packed[1:])
    assert (packed[1][2] == 0).all()  # groups of ~1e-30: their scale rounds to 0 ...
    assert (_dequantize(kind, packed)[2] == 0).all()  # ... and they read back as 0
    assert (packed[1][6] > 0).all() and (packed[1][6] < 2.0**-14).all()  # subnormal scales are kept


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantize_rejects_what_float16_cannot_hold(kind: str) -> None:
    """A scale or min beyond float16's range must fail loudly rather than store inf."""
    weight = torch.randn(4, 64)
    weight[1, 3] = 1e7 if kind == "int8" else -1e5  # int8: absmax / 127 > 65504; int4: the min itself
    with pytest.raises(ValueError, match="float16, whose largest finite value is 65504"):
        _quantize(kind, weight)
    weight[1, 3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        _quantize(kind, weight)
    weight[1, 3] = 8e6 if kind == "int8" else -6e4  # just inside the range
    assert all(torch.isfinite(t).all() for t in _quantize(kind, weight)[1:])


def _gguf_test_weight(seed: int) -> np.ndarray:
    """48 rows; the last 8 small enough that their float16 scales are subnormal."""
    weight = _random_weight(48, 576, torch.Generator().manual_seed(seed))
    weight[40:] *= 1e-4
    return weight.numpy()


def test_int4_layout_matches_gguf_q4_1_blocks() -> None:
    """Q4_1 blocks (d fp16, m fp16, 16 bytes of codes) map onto (scales, mins, qweight) by a reshape."""
    weight = _gguf_test_weight(13)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1).reshape(48, -1, 20)
    scales = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16)[..., 0])
    mins = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16)[..., 0])
    qweight = torch.from_numpy(raw[:, :, 4:].reshape(48, -1).copy())
    expected = gguf.quants.dequantize(raw.reshape(48, -1), gguf.GGMLQuantizationType.Q4_1)
    dense = quant_matmul.dequantize_int4(qweight, scales, mins)
    assert torch.equal(dense, torch.from_numpy(expected))
    # Re-quantizing the dequantized GGUF tensor is lossless: same codes, same float16 scales and mins.
    for ours, theirs in zip(quant_matmul.quantize_int4(dense), (qweight, scales, mins), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_int8_layout_matches_gguf_q8_0_blocks() -> None:
    weight = _gguf_test_weight(17)
    raw = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0).reshape(48, -1, 34)
    scales = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16)[..., 0])
    qweight = torch.from_numpy(raw[:, :, 2:].reshape(48, -1).copy().view(np.int8))
    expected = gguf.quants.dequantize(raw.reshape(48, -1), gguf.GGMLQuantizationType.Q8_0)
    dense = quant_matmul.dequantize_int8(qweight, scales)
    assert torch.equal(dense, torch.from_numpy(expected))
    for ours, theirs in zip(quant_matmul.quantize_int8(dense), (qweight, scales), strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("quantize", [quant_matmul.quantize_int8, quant_matmul.quantize_int4])
def test_quantize_rejects_k_not_multiple_of_32(quantize: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48))
    with pytest.raises(ValueError, match="positive multiple of 32"):
        quantize(torch.randn(4, 0))
    with pytest.raises(ValueError, match="float32"):
        quantize(torch.randn(4, 64, dtype=torch.float64))


@needs_cpu_kernels
def test_matmul_rejects_bad_inputs() -> None:
    qweight, scales, mins = quant_matmul.quantize_int4(torch.randn(8, 64))
    q8, s8 = quant_matmul.quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_matmul.matmul_int8(torch.randn(2, 48), q8[:, :48].contiguous(), s8)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_matmul.matmul_int4(torch.randn(2, 48), qweight[:, :24].contiguous(), scales, mins)
    with pytest.raises(ValueError, match="positive multiple of 32"):
        quant_matmul.matmul_int8(torch.randn(2, 0), q8[:, :0].contiguous(), s8[:, :0].contiguous())
    with pytest.raises(ValueError, match="qweight"):
        quant_matmul.matmul_int4(torch.randn(2, 96), qweight, scales, mins)
    with pytest.raises(ValueError, match="contiguous"):
        quant_matmul.matmul_int8(torch.randn(64, 2).T, q8, s8)
    with pytest.raises(ValueError, match="torch.int8"):
        quant_matmul.matmul_int8(torch.randn(2, 64), q8.view(torch.uint8), s8)
    with pytest.raises(ValueError, match="bias"):
        quant_matmul.matmul_int4(torch.randn(2, 64), qweight, scales, mins, torch.randn(7))
    with pytest.raises(ValueError, match="mins"):
        quant_matmul.matmul_int4(torch.randn(2, 64), qweight, scales, mins[:, :1].contiguous())
    with pytest.raises(ValueError, match="scales must be a contiguous torch.float16"):
        quant_matmul.matmul_int8(torch.randn(2, 64), q8, s8.float())
    with pytest.raises(ValueError, match="mins must be a contiguous torch.float16"):
        quant_matmul.matmul_int4(torch.randn(2, 64), qweight, scales, mins.float())


@needs_cpu_kernels
def test_extension_checks_its_own_inputs() -> None:
    """The compiled ops validate too, so calling them directly cannot read out of bounds."""
    module = quant_matmul.load()
    q8, s8 = quant_matmul.quantize_int8(torch.randn(8, 64))
    with pytest.raises(ValueError, match="scales"):
        module.matmul_int8(torch.randn(2, 64), q8, s8[:4].contiguous(), None)


def test_load_names_missing_cpu_features(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu._EXTENSION, "_module", None)  # as if never built in this process
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert not cpu.is_available()
    with pytest.raises(RuntimeError, match="AVX2 and FMA"):
        cpu.load()
