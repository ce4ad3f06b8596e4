"""Scales, codes and int32 packing against compressed-tensors' own implementation (the library that
transformers and vLLM decompress with)."""

from __future__ import annotations

import pytest
import torch
from tokenmill_plugins.commands.quantize.schemes import QuantizeError, make_scheme, quantize_rtn, weight_qparams
from tokenmill_plugins.quant.packing import pack_int32, unpack_int32

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

_CT_ARGS = {
    "gptq": dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
    "awq": dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
    "int8": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
    "fp8": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
}


def _weight(seed: int = 0, rows: int = 24, cols: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator)
    weight[0] = weight[0].abs()  # an all-positive row: the range must still include 0
    weight[1, :32] = 0.0  # an all-zero group: its scale must not be 0
    return weight


@pytest.mark.parametrize("cols", [8, 13, 96])
@pytest.mark.parametrize("num_bits", [4, 8])
def test_packing_matches_compressed_tensors(cols: int, num_bits: int) -> None:
    low, high = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    codes = torch.randint(low, high + 1, (6, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(cols))
    packed = pack_int32(codes, num_bits)
    assert torch.equal(packed, pack_to_int32(codes, num_bits))
    assert torch.equal(unpack_from_int32(packed, num_bits, torch.Size(codes.shape)), codes)
    assert torch.equal(unpack_int32(packed, num_bits, cols), codes)
    # zero points pack along the output dimension
    packed_rows = pack_int32(codes, num_bits, dim=0)
    assert torch.equal(packed_rows, pack_to_int32(codes, num_bits, packed_dim=0))
    assert torch.equal(unpack_int32(packed_rows, num_bits, 6, dim=0), codes)


@pytest.mark.parametrize("method", ["gptq", "awq", "int8", "fp8"])
def test_qparams_match_compressed_tensors(method: str) -> None:
    scheme = make_scheme(method, group_size=32)
    weight = _weight()
    scale, zero_point = weight_qparams(weight, scheme)
    args = QuantizationArgs(**_CT_ARGS[method])
    groups = weight.reshape(weight.shape[0], -1, scheme.group_size or weight.shape[1])
    expected_scale, expected_zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
    if scheme.symmetric:
        assert zero_point is None
    else:
        assert zero_point is not None and torch.equal(zero_point, expected_zero.to(torch.int8))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_pack_quantized_decompresses_with_compressed_tensors(method: str) -> None:
    """What we write for a linear decompresses, through compressed-tensors' own compressor, to exactly the
    weight our codes stand for."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from tokenmill_plugins.commands.quantize.writer import quantized_tensors

    scheme = make_scheme(method, group_size=32)
    weight = _weight(rows=24)
    quantized = quantize_rtn(weight, scheme)
    tensors = quantized_tensors("layer", quantized, scheme, torch.float32)
    state = {name.removeprefix("layer."): tensor for name, tensor in tensors.items()}
    expected_names = {"weight_packed", "weight_scale", "weight_shape"} | (
        set() if scheme.symmetric else {"weight_zero_point"}
    )
    assert set(state) == expected_names
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**_CT_ARGS[method]))
    decompressed = PackedQuantizationCompressor.decompress(state, ct_scheme)["weight"]
    torch.testing.assert_close(decompressed, quantized.dequantize(), rtol=0, atol=0)
    # and the codes are what compressed-tensors itself computes from the dequantized weight
    inputs = {"weight": quantized.dequantize(), "weight_scale": quantized.scale}
    if quantized.zero_point is not None:
        inputs["weight_zero_point"] = quantized.zero_point
    recompressed = PackedQuantizationCompressor.compress(inputs, ct_scheme)
    assert torch.equal(recompressed["weight_packed"], state["weight_packed"])


def test_rtn_error_is_within_half_a_step() -> None:
    scheme = make_scheme("gptq", group_size=32)
    weight = _weight()
    quantized = quantize_rtn(weight, scheme)
    step = quantized.scale.repeat_interleave(32, dim=1)
    # symmetric int4: [-8, 7] * absmax / 7.5 covers [-absmax, absmax] only up to 7/7.5 on the positive side
    inside = weight <= 7 * step
    assert ((quantized.dequantize() - weight).abs()[inside] <= step[inside] / 2 + 1e-6).all()
    assert quantized.codes.min() >= -8 and quantized.codes.max() <= 7


@pytest.mark.parametrize(
    ("method", "group_size", "message"),
    [("gptq4", 128, "unknown method 'gptq4'"), ("gptq", 100, "--group-size 100"), ("awq", 0, "--group-size 0")],
)
def test_bad_scheme_is_one_line(method: str, group_size: int, message: str) -> None:
    with pytest.raises(QuantizeError, match=message) as info:
        make_scheme(method, group_size)
    assert "\n" not in str(info.value)
