"""The checkpoint format readers (GPTQ, AWQ, compressed-tensors) and their CPU runtime, unit by unit: unpacking
against each format's definition (and compressed-tensors' own packer), repacked kernels against
dequantize-then-matmul, and bad checkpoints as one-line errors before anything loads."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenmill_plugins.quant.awq import AWQQuantizer
from tokenmill_plugins.quant.checkpoint_quantizer import quantize_activations, repack_int
from tokenmill_plugins.quant.checkpoint_weights import (
    ActivationScheme,
    FloatWeight,
    IntWeight,
    merge_parts,
    shard_part,
    unpack_int32,
)
from tokenmill_plugins.quant.compressed_tensors import CompressedTensorsQuantizer
from tokenmill_plugins.quant.gptq import GPTQQuantizer

from tokenmill.config import load_config
from tokenmill.errors import TokenmillError
from tokenmill.model_loader import load_model

CHECKPOINTS = Path(__file__).parents[1] / "models" / "quantized" / "checkpoints"
Q_PROJ = "model.layers.0.self_attn.q_proj."
UP_PROJ = "model.layers.1.mlp.up_proj."


def _pack_by_definition(codes: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack uint8 ``codes [rows, n]`` into int32 ``[rows, n * bits / 32]`` along the last dimension, the element
    ``order[i]`` of each word's group in bits ``i * bits`` (identity order when None), one element at a time."""
    per_word = 32 // bits
    order = order or tuple(range(per_word))
    rows, n = codes.shape
    out = torch.zeros(rows, n // per_word, dtype=torch.int64)
    for word in range(n // per_word):
        for i, column in enumerate(order):
            out[:, word] |= codes[:, word * per_word + column].long() << (i * bits)
    return ((out + 2**31) % 2**32 - 2**31).to(torch.int32)  # reinterpret as signed


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_int32_inverts_the_packing_definition(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (6, 64), dtype=torch.uint8)
    packed = _pack_by_definition(codes, bits)
    assert torch.equal(unpack_int32(packed, bits, dim=1, count=64), codes)
    assert torch.equal(unpack_int32(packed.T, bits, dim=0, count=64), codes.T)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_int32_reads_compressed_tensors_own_packing(bits: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    signed = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (8, 96), dtype=torch.int8)
    offset = 2 ** (bits - 1)
    for dim in (0, 1):
        packed = pack_to_int32(signed, bits, packed_dim=dim)
        codes = unpack_int32(packed, bits, dim=dim, count=signed.shape[dim])
        assert torch.equal(codes.to(torch.int16) - offset, signed.to(torch.int16))


def test_awq_reads_its_interleaved_column_order() -> None:
    in_features, out_features, group = 64, 16, 32
    codes = torch.randint(0, 16, (in_features, out_features), dtype=torch.uint8)  # [in, out] as AWQ stores
    zeros = torch.randint(0, 16, (in_features // group, out_features), dtype=torch.uint8)
    scales = torch.rand(in_features // group, out_features).half() + 0.01
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    quantizer = AWQQuantizer()
    quantizer.configure({"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True})
    weight = quantizer.read_checkpoint(
        {"qweight": _pack_by_definition(codes, 4, order), "qzeros": _pack_by_definition(zeros, 4, order),
         "scales": scales},
        out_features, in_features,
    )  # fmt: skip
    assert torch.equal(weight.codes, codes.T)
    expected = (codes.T.float() - zeros.T.float().repeat_interleave(group, 1)) * scales.T.float().repeat_interleave(
        group, 1
    )
    torch.testing.assert_close(weight.dequantize(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
def test_gptq_zero_points_follow_the_checkpoint_format(checkpoint_format: str) -> None:
    """v1 stores zero - 1 (AutoGPTQ's historical offset); v2 the zero point itself."""
    in_features, out_features = 64, 8
    codes = torch.randint(0, 16, (in_features, out_features), dtype=torch.uint8)
    stored_zeros = torch.randint(0, 15, (2, out_features), dtype=torch.uint8)
    quantizer = GPTQQuantizer()
    quantizer.configure({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": checkpoint_format})
    weight = quantizer.read_checkpoint(
        {"qweight": _pack_by_definition(codes.T, 4).T.contiguous(), "qzeros": _pack_by_definition(stored_zeros, 4),
         "scales": torch.ones(2, out_features).half(), "g_idx": torch.arange(in_features, dtype=torch.int32) // 32},
        out_features, in_features,
    )  # fmt: skip
    assert torch.equal(weight.codes, codes.T)
    offset = 1 if checkpoint_format == "gptq" else 0
    assert torch.equal(weight.zeros, stored_zeros.T.float() + offset)


def _random_int_weight(bits: int, group_size: int, act_order: bool, symmetric: bool, out: int = 48, k: int = 256):
    generator = torch.Generator().manual_seed(bits * 1000 + group_size)
    groups = k // group_size
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=generator)]
    zeros = torch.full((out, groups), float(2 ** (bits - 1)))
    if not symmetric:
        zeros = torch.randint(0, 2**bits, (out, groups), generator=generator).float()
    return IntWeight(
        bits=bits,
        codes=torch.randint(0, 2**bits, (out, k), generator=generator, dtype=torch.uint8),
        scales=torch.rand(out, groups, generator=generator) * 0.02 + 0.001,
        zeros=zeros,
        group_size=group_size,
        g_idx=g_idx,
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, 256])  # 256 = k: one scale per output channel
@pytest.mark.parametrize(("act_order", "symmetric"), [(False, True), (True, False), (False, False)])
def test_repacked_kernels_match_dequantize_then_matmul(bits: int, group_size: int, act_order: bool, symmetric: bool):
    from torch import nn

    from tokenmill.layers.linear import Linear

    weight = _random_int_weight(bits, group_size, act_order, symmetric)
    quantizer = GPTQQuantizer()
    quantizer.configure({"quant_method": "gptq", "bits": bits, "group_size": group_size})
    layer = Linear(256, 48, bias=True, quantizer=quantizer, dtype=torch.float32)
    bias = torch.randn(48)
    layer.load_weight("weight", weight)  # type: ignore[arg-type]
    layer.load_weight("bias", bias)
    x = torch.randn(5, 256)
    expected = nn.functional.linear(x, weight.dequantize(), bias)
    # The kernel rounds inputs to int16 per 32 and group scales to float16: relative errors near 2**-11.
    tolerance = 2e-3 * expected.abs().max().item()
    torch.testing.assert_close(layer(x), expected, atol=tolerance, rtol=0)
    assert ("perm" in repack_int(weight)) == (act_order and group_size < 256)  # one group has no order


def test_merged_parts_need_one_activation_order() -> None:
    a = _random_int_weight(4, 32, act_order=True, symmetric=True)
    b = _random_int_weight(4, 64, act_order=True, symmetric=True)
    merged = merge_parts([a, a])
    assert merged.codes.shape == (96, 256)
    torch.testing.assert_close(merged.dequantize(), torch.cat([a.dequantize(), a.dequantize()]))
    with pytest.raises(ValueError, match="bit widths or group sizes"):
        merge_parts([a, b])
    other_order = IntWeight(4, a.codes, a.scales, a.zeros, 32, a.g_idx.flip(0))  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="activation orders"):
        merge_parts([a, other_order])


@pytest.mark.parametrize("group_size", [32, 64, 256])  # 256 = k: one scale per output channel
@pytest.mark.parametrize("symmetric", [True, False])
def test_tensor_parallel_shares_dequantize_to_the_whole_weights_slices(group_size: int, symmetric: bool) -> None:
    weight = _random_int_weight(4, group_size, act_order=False, symmetric=symmetric)
    whole = weight.dequantize()  # [48, 256]
    for dim in (0, 1):
        shares = [shard_part(weight, dim, rank, 2).dequantize() for rank in range(2)]
        assert torch.equal(torch.cat(shares, dim=dim), whole)
    # GPTQ stores g_idx even without activation order: i // group_size is no order, and splits.
    trivial = replace(weight, g_idx=torch.arange(256) // group_size)
    assert torch.equal(shard_part(trivial, 1, 1, 2).dequantize(), whole[:, 128:])
    values = (torch.randn(48, 256) * 30).to(torch.float8_e4m3fn)
    for block in ((1, 256), (1, 64), (8, 64)):
        scales = torch.rand(48 // block[0], 256 // block[1]) + 0.01
        fp8 = FloatWeight(values=values, scales=scales, block_size=block)
        for dim in (0, 1):
            shares = [shard_part(fp8, dim, rank, 2).dequantize() for rank in range(2)]
            assert torch.equal(torch.cat(shares, dim=dim), fp8.dequantize())


def test_tensor_parallel_shares_refuse_to_cut_groups_or_activation_order() -> None:
    with pytest.raises(ValueError, match="not whole groups of 128"):
        shard_part(_random_int_weight(4, 128, act_order=False, symmetric=True), 1, 0, 4)
    with pytest.raises(ValueError, match="activation-ordered groups"):
        shard_part(_random_int_weight(4, 32, act_order=True, symmetric=True), 1, 0, 2)
    ordered = shard_part(_random_int_weight(4, 32, act_order=True, symmetric=True), 0, 1, 2)  # rows: any order
    assert ordered.codes.shape == (24, 256)


def test_activation_quantization_follows_compressed_tensors() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(7, 64) * torch.linspace(0.1, 10, 7)[:, None]
    for kind in ("int", "float"):
        args = QuantizationArgs(num_bits=8, type=kind, strategy="token", dynamic=True, symmetric=True)
        scale, zero_point = calculate_qparams(x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True), args)
        expected = fake_quantize(x, scale, zero_point, args)
        codes, x_scale = quantize_activations(x, ActivationScheme(kind, 8, "token", True), torch.empty(0))
        torch.testing.assert_close(codes * x_scale, expected, atol=0, rtol=0)


# ------------------------------------------------------------------ bad checkpoints


def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name
    shutil.copytree(CHECKPOINTS / name, target)
    return target


def _edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _load(directory: Path, quantization: str = "auto") -> object:
    return load_model(load_config(overrides={
        "model": {"model": str(directory), "quantization": quantization}, "device": {"device": "cpu"},
    }))  # fmt: skip


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        ("gptq-4bit-g32-sym", {"quant_method": "bitsandbytes"},
         "quant_method 'bitsandbytes', which no installed quantizer reads (supported: awq, compressed-tensors, gptq)"),
        ("gptq-4bit-g32-sym", {"bits": 3}, "gptq: bits 3 is not supported; supported: 4, 8"),
        ("gptq-4bit-g32-sym", {"group_size": 16}, "gptq: group_size 16 is not supported"),
        ("gptq-4bit-g32-sym", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
        ("gptq-4bit-g32-sym", {"lm_head": True}, "a quantized lm_head (lm_head: true) is not supported"),
        ("awq-4bit-g128-gemm", {"version": "gemv"}, "awq: version 'gemv' is not supported; supported: gemm"),
        # Routers may stay in float (no linears here; the ct-moe-* checkpoints ignore them), linears may not.
        ("ct-w4a16-gptq", {"ignore": ["lm_head", "re:.*down_proj"]},
         "the checkpoint leaves model.layers.0.mlp.down_proj unquantized (compressed-tensors ignore list); supported: "
         "one scheme for every linear but lm_head (MoE routers may be left out)"),
        ("ct-w4a16-gptq", {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme is not supported"),
    ],
)  # fmt: skip
def test_unsupported_variants_are_one_line_errors_before_loading(
    name: str, changes: dict[str, object], message: str, tmp_path: Path
) -> None:
    directory = _copy(name, tmp_path)
    _edit_config(directory, **changes)
    (directory / "model.safetensors").write_bytes(b"not read")  # configure refuses before any tensor is read
    with pytest.raises(TokenmillError) as excinfo:
        _load(directory)
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_a_float_quantizer_on_a_quantized_checkpoint_says_what_to_use(tmp_path: Path) -> None:
    with pytest.raises(TokenmillError, match="model.quantization='int4' cannot run this checkpoint, quantized with "
                                             "'gptq'; use 'auto' or 'gptq'"):  # fmt: skip
        _load(CHECKPOINTS / "gptq-4bit-g32-sym", quantization="int4")
    from tests.factories import save_hf_model

    save_hf_model("llama-tiny", tmp_path)  # a float checkpoint
    with pytest.raises(TokenmillError, match="'gptq' reads checkpoints quantized with gptq, and this checkpoint has no "
                                             "quantization_config"):  # fmt: skip
        _load(tmp_path, quantization="gptq")


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("gptq-4bit-g32-sym", lambda t: t.update({Q_PROJ + "qzeros": torch.zeros(3, 16, dtype=torch.int32)}),
         "belongs to a module whose 'qzeros' has shape [3, 16], expected [4, 16]"),
        ("gptq-4bit-g32-sym", lambda t: t.update({UP_PROJ + "qweight": t[UP_PROJ + "qweight"].float()}),
         "belongs to a module whose 'qweight' is torch.float32, expected torch.int32"),
        ("gptq-4bit-g32-sym", lambda t: t.pop("model.layers.1.mlp.down_proj.scales"),
         "missing tensors model.layers.1.mlp.down_proj.scales"),
        ("ct-w4a16-gptq", lambda t: t.update({"model.layers.0.mlp.down_proj.weight_shape": torch.tensor([128, 256])}),
         "belongs to a module whose weight_shape is [128, 256], expected [128, 384]"),
    ],
)  # fmt: skip
def test_mismatched_or_missing_tensors_name_file_and_tensor(name: str, edit, message: str, tmp_path: Path) -> None:
    directory = _copy(name, tmp_path)
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TokenmillError) as excinfo:
        _load(directory)
    assert message in str(excinfo.value)
    assert str(excinfo.value).startswith(str(directory / "model.safetensors"))


def test_a_truncated_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    directory = _copy("ct-w4a16-asym-awq", tmp_path)
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(TokenmillError, match="corrupt or truncated safetensors file"):
        _load(directory)


def test_compressed_tensors_configure_reads_each_scheme() -> None:
    expected = {
        "ct-w4a16-gptq": ("int4", None, ("weight_packed", "weight_scale", "weight_shape")),
        "ct-w4a16-asym-awq": ("int4", None, ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")),
        "ct-w8a8-int8": ("w8a8", "int", ("weight", "weight_scale")),
        "ct-fp8-dynamic": ("fp8", "float", ("weight", "weight_scale")),
        "ct-fp8-static": ("fp8", "float", ("weight", "weight_scale", "input_scale")),
    }
    for name, (kind, activations, names) in expected.items():
        quantizer = CompressedTensorsQuantizer()
        quantizer.configure(json.loads((CHECKPOINTS / name / "config.json").read_text())["quantization_config"])
        assert quantizer.weight_kind == kind
        assert (quantizer.activations.type if quantizer.activations else None) == activations
        assert quantizer.checkpoint_tensor_names == names


def test_fp8_bytes_convert_exactly() -> None:
    from tokenmill_plugins.quant.checkpoint_quantizer import FP8_SCALE, fp8_to_float

    codes = torch.arange(256, dtype=torch.uint8)
    finite = ~torch.isnan(codes.view(torch.float8_e4m3fn).float())
    assert finite.sum() == 254  # every code but the two NaNs
    expected = codes.view(torch.float8_e4m3fn).float()[finite]
    assert torch.equal(fp8_to_float(codes)[finite] * FP8_SCALE, expected)


@pytest.mark.parametrize("block", [None, 32])
def test_fp8_layer_matches_dequantize_then_matmul(block: int | None) -> None:
    from tokenmill_plugins.quant.checkpoint_weights import FloatWeight
    from torch import nn

    from tokenmill.layers.linear import Linear

    generator = torch.Generator().manual_seed(3)
    out_features, in_features = 300, 64  # 300: the last 128-row tile is partial
    values = (torch.randn(out_features, in_features, generator=generator) * 30).to(torch.float8_e4m3fn)
    columns = in_features if block is None else block
    scales = torch.rand(out_features, in_features // columns, generator=generator) + 0.01
    weight = FloatWeight(values=values, scales=scales, block_size=(1, columns))
    quantizer = CompressedTensorsQuantizer()
    quantizer.weight_kind = "fp8"
    layer = Linear(in_features, out_features, bias=True, quantizer=quantizer, dtype=torch.float32)
    bias = torch.randn(out_features, generator=generator)
    layer.load_weight("weight", weight)  # type: ignore[arg-type]
    layer.load_weight("bias", bias)
    x = torch.randn(3, in_features, generator=generator)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, weight.dequantize(), bias), rtol=1e-5, atol=1e-4)


def test_output_quantization_int8_quantizes_the_float_output_projection() -> None:
    """``[plugins.quant] output_quantization = "int8"``: the float lm_head the tools leave becomes Q8_0 at load."""
    from safetensors.torch import load_file as load_reference

    from tests.factories import make_engine

    name = "ct-w4a16-gptq"
    default = make_engine(CHECKPOINTS / name).loaded.model
    engine = make_engine(CHECKPOINTS / name, plugins={"quant": {"output_quantization": "int8"}})
    model = engine.loaded.model
    assert default.lm_head.quantizer.name == "none"
    assert model.lm_head.quantizer.name == "int8"
    assert model.model.layers[0].self_attn.qkv_proj.quantizer.name == "compressed-tensors"
    hidden = torch.randn(3, 128)
    reference = load_reference(CHECKPOINTS / name / "reference.safetensors")["logits.0"]
    with torch.no_grad():
        float_logits, int8_logits = default.compute_logits(hidden), model.compute_logits(hidden)
    difference = (int8_logits - float_logits).abs().max().item()
    assert 0 < difference < 0.01 * reference.abs().max().item()  # rounded, but only by int8 steps
    with pytest.raises(TokenmillError, match="output_quantization"):
        make_engine(CHECKPOINTS / name, plugins={"quant": {"output_quantization": "int4"}})


def test_a_quantization_config_that_is_not_an_object_is_a_one_line_error(tmp_path: Path) -> None:
    directory = _copy("gptq-4bit-g32-sym", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = "gptq"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(TokenmillError, match="quantization_config is a str, not an object"):
        _load(directory)
