"""The GPU paths of quantized checkpoints: the Triton W4A16/W8A16 kernel against dequantize-then-matmul, and the
checkpoint quantizers' CUDA ``apply`` (Triton, ``torch._int_mm`` for W8A8, ``torch._scaled_mm`` or per-tile
dequantization for FP8).

Without a GPU the kernel runs under the Triton interpreter (``conftest.py``) on tiny shapes, the W8A8 and FP8
functions run on CPU tensors (``torch._int_mm`` and ``torch._scaled_mm`` have CPU implementations, so both FP8
routes are forced and compared), and the kernel is compiled for sm_90 without running. The tests marked ``gpu``
need CUDA and skip without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from tokenmill_kernels.quant_matmul import triton as kernels
from tokenmill_plugins.quant import checkpoint_quantizer
from tokenmill_plugins.quant.checkpoint_quantizer import (
    fp8_matmul,
    int8_matmul,
    quantize_activations,
    repack_int,
    repack_int_gpu,
    supports_fp8_matmul,
)
from tokenmill_plugins.quant.checkpoint_weights import ActivationScheme, FloatWeight, IntWeight
from tokenmill_plugins.quant.compressed_tensors import CompressedTensorsQuantizer
from tokenmill_plugins.quant.gptq import GPTQQuantizer

from tests.kernels.tolerances import tolerance
from tests.plugins.test_checkpoint_quantizers import _random_int_weight
from tokenmill.layers.linear import Linear

assert torch.cuda.is_available() or kernels.is_interpreted(), (
    "the Triton kernels were imported before TRITON_INTERPRET=1 was set (tests/kernels/conftest.py sets it)"
)

#: Where the kernel grid runs: the GPU when there is one, else the interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IN_FEATURES, OUT_FEATURES = 256, 48  # 48: not a multiple of the kernel's BLOCK_N, so the last tile is masked
#: (act_order, symmetric)
VARIANTS = [(False, True), (True, False), (False, False), (True, True)]


def random_int_weight(
    bits: int, group_size: int, act_order: bool, symmetric: bool, out: int = OUT_FEATURES
) -> IntWeight:
    """Random codes, scales and zero points as a checkpoint reader returns them, ``[out, 256]``; ``group_size``
    256 is one scale per output channel."""
    return _random_int_weight(bits, group_size, act_order, symmetric, out=out, k=IN_FEATURES)


def assert_close_to(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` (in ``dtype``) against a float32 ``expected``, within the dtype's relative tolerance of the
    largest output: the weights and the output are rounded to ``dtype``, the sums are float32."""
    assert actual.dtype == dtype
    atol = tolerance(dtype)["rtol"] * expected.abs().max().item()
    torch.testing.assert_close(actual.float().cpu(), expected, atol=atol, rtol=0)


# ---------------------------------------------------------------- the kernel


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_int_weight_follows_the_layout(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (5, 64), dtype=torch.uint8)
    packed = kernels.pack_int_weight(codes, bits)
    per_word = 32 // bits
    assert packed.dtype == torch.int32 and packed.shape == (64 // per_word, 5)
    word = packed[1, 3].item() % 2**32  # as unsigned
    assert [(word >> (i * bits)) & (2**bits - 1) for i in range(per_word)] == codes[3, per_word : 2 * per_word].tolist()
    ones, zeros = torch.ones(1, 5), torch.zeros(1, 5)
    assert torch.equal(kernels.dequantize_int_weight(packed, ones, zeros, bits), codes.float())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128, IN_FEATURES])  # IN_FEATURES: one scale per output channel
@pytest.mark.parametrize(("act_order", "symmetric"), VARIANTS)
def test_kernel_matches_dequantize_then_matmul(bits: int, group_size: int, act_order: bool, symmetric: bool) -> None:
    weight = random_int_weight(bits, group_size, act_order, symmetric)
    storage = {name: value.to(DEVICE) for name, value in repack_int_gpu(weight).items()}
    assert ("perm" in storage) == (act_order and group_size < IN_FEATURES)  # one group has no order
    torch.testing.assert_close(  # q * s + (-z * s) against (q - z) * s: float32 rounding only
        kernels.dequantize_int_weight(storage["qweight"], storage["scales"], storage["mins"], bits).cpu(),
        weight.dequantize()[:, storage["perm"].cpu()] if "perm" in storage else weight.dequantize(),
        atol=1e-6,
        rtol=0,
    )
    generator = torch.Generator().manual_seed(group_size)
    bias = torch.randn(OUT_FEATURES, generator=generator)
    for dtype in DTYPES:
        for num_tokens, with_bias in ((1, True), (37, False)):  # decode, and rows over two row tiles
            x = torch.randn(num_tokens, IN_FEATURES, generator=generator)
            expected = x.to(dtype).float() @ weight.dequantize().T + (bias.to(dtype).float() if with_bias else 0)
            out = kernels.dequant_matmul(
                x.to(DEVICE, dtype), storage["qweight"], storage["scales"], storage["mins"], bits,
                bias.to(DEVICE, dtype) if with_bias else None, storage.get("perm"),
            )  # fmt: skip
            assert out.shape == (num_tokens, OUT_FEATURES)
            assert_close_to(out, expected, dtype)


def test_kernel_takes_no_tokens() -> None:
    storage = {name: value.to(DEVICE) for name, value in repack_int_gpu(random_int_weight(4, 32, False, True)).items()}
    x = torch.empty(0, IN_FEATURES, device=DEVICE)
    assert kernels.dequant_matmul(x, storage["qweight"], storage["scales"], storage["mins"], 4).shape == (0, 48)


def test_launcher_checks_its_arguments() -> None:
    storage = repack_int_gpu(random_int_weight(4, 32, False, False))
    qweight, scales, mins = storage["qweight"], storage["scales"], storage["mins"]
    x = torch.randn(3, IN_FEATURES)

    def call(**changes: Any) -> None:
        args = {"x": x, "qweight": qweight, "scales": scales, "mins": mins, "bits": 4} | changes
        kernels.dequant_matmul(**args)

    with pytest.raises(ValueError, match="bits must be one of"):
        call(bits=3)
    with pytest.raises(ValueError, match=r"qweight must be int32 \[K \* 8 / 32 = 64, N\]"):
        call(bits=8)
    with pytest.raises(ValueError, match="x dtype torch.float64"):
        call(x=x.double())
    with pytest.raises(ValueError, match="group size 16"):
        call(scales=scales.repeat(2, 1), mins=mins.repeat(2, 1))
    with pytest.raises(ValueError, match=r"mins must be float32 \[8, 48\]"):
        call(mins=mins.half())
    with pytest.raises(ValueError, match=r"bias must have shape \(48,\)"):
        call(bias=torch.zeros(47))
    with pytest.raises(ValueError, match=r"perm must have shape \(256,\)"):
        call(perm=torch.arange(128))
    with pytest.raises(ValueError, match="scales must be contiguous"):
        call(scales=scales.T.contiguous().T)


_COMPILE_FOR_SM90 = """
import inspect, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tokenmill_kernels.quant_matmul import triton as kernels

def compile_for_sm90(kernel, dtype, **constexprs):
    types = {"x_ptr": dtype, "bias_ptr": dtype, "out_ptr": dtype, "qweight_ptr": "*i32", "scales_ptr": "*fp32",
             "mins_ptr": "*fp32"}
    names = inspect.signature(kernel.fn).parameters
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in names}
    triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))

for dtype, dot_fp32 in (("*fp16", False), ("*bf16", False), ("*fp32", True)):
    for bits, block_m, block_n, block_k in ((4, 16, 32, 64), (8, 64, 64, 32)):
        compile_for_sm90(kernels._dequant_matmul_kernel, dtype, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n,
                         BLOCK_K=block_k, HAS_BIAS=True, DOT_FP32=dot_fp32)
print("compiled")
"""


@pytest.mark.slow
def test_triton_kernel_compiles_for_a_gpu_without_one() -> None:
    """The interpreter accepts code the GPU compiler rejects: compile the kernel for sm_90 through Triton's own
    compiler and ptxas, for each dtype and bit width, in a process without TRITON_INTERPRET."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's warning about a changing default
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "compiled"


# ---------------------------------------------------------------- the quantizer's CUDA paths, on CPU tensors


def _gptq_layer_in_gpu_layout(weight: IntWeight, bias: torch.Tensor) -> tuple[GPTQQuantizer, Linear]:
    """A GPTQ linear whose buffers hold what ``load_weight`` stores on CUDA (here on ``DEVICE``)."""
    quantizer = GPTQQuantizer()
    quantizer.configure({"quant_method": "gptq", "bits": weight.bits, "group_size": weight.group_size})
    layer = Linear(IN_FEATURES, OUT_FEATURES, bias=True, quantizer=quantizer, dtype=torch.float32).to(DEVICE)
    for name, value in repack_int_gpu(weight).items():
        setattr(layer, name, value.to(DEVICE))
    layer.load_weight("bias", bias)
    return quantizer, layer


@pytest.mark.parametrize(("bits", "group_size", "act_order"), [(4, 128, True), (8, IN_FEATURES, False)])
def test_gpu_apply_runs_the_triton_kernel(bits: int, group_size: int, act_order: bool) -> None:
    weight = random_int_weight(bits, group_size, act_order, symmetric=False)
    bias = torch.randn(OUT_FEATURES)
    quantizer, layer = _gptq_layer_in_gpu_layout(weight, bias)
    x = torch.randn(6, IN_FEATURES)
    out = quantizer._apply_gpu(layer, x.to(DEVICE, torch.bfloat16))  # what apply calls for a CUDA input
    assert_close_to(out, x.bfloat16().float() @ weight.dequantize().T + bias, torch.bfloat16)


def test_int8_matmul_is_the_cpu_path_and_pads_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """W8A8 on CUDA is the CPU's arithmetic (int8 codes times int8 weights in integers); batches of 16 rows or fewer
    reach ``torch._int_mm`` padded to 17 rows, and dimensions that are not multiples of 8 skip it."""
    quantizer = CompressedTensorsQuantizer()
    scheme = ActivationScheme("int", 8, "token", is_dynamic=True)
    quantizer.weight_kind, quantizer.activations = "w8a8", scheme
    weight = random_int_weight(8, IN_FEATURES, act_order=False, symmetric=True)
    layer = Linear(IN_FEATURES, OUT_FEATURES, bias=False, quantizer=quantizer, dtype=torch.float32)
    layer.load_weight("weight", weight)  # type: ignore[arg-type]
    storage = repack_int(weight)
    rows_seen: list[int] = []
    real_int_mm = torch._int_mm

    def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        rows_seen.append(a.shape[0])
        return real_int_mm(a, b)

    x = torch.randn(20, IN_FEATURES)
    expected = layer(x)  # the CPU path, before torch._int_mm is watched
    monkeypatch.setattr(torch, "_int_mm", int_mm)
    for num_tokens in (1, 16, 20):
        out = int8_matmul(x[:num_tokens], storage["qweight"], storage["out_scale"], scheme, torch.empty(0))
        torch.testing.assert_close(out, expected[:num_tokens], atol=0, rtol=0)
    assert rows_seen == [17, 17, 20]
    odd = storage["qweight"][:44]  # 44 outputs: not a multiple of 8
    out = int8_matmul(x[:3], odd, storage["out_scale"][:44], scheme, torch.empty(0))
    torch.testing.assert_close(out, expected[:3, :44], atol=0, rtol=0)
    assert rows_seen == [17, 17, 20]


def _fp8_weight(block_columns: int | None) -> FloatWeight:
    """Random FP8 weight with a scale per channel (``block_columns`` None) or per ``1 x block_columns`` block."""
    generator = torch.Generator().manual_seed(8)
    values = (torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator) * 40).to(torch.float8_e4m3fn)
    columns = block_columns or IN_FEATURES
    scales = torch.rand(OUT_FEATURES, IN_FEATURES // columns, generator=generator) * 0.01 + 0.001
    return FloatWeight(values=values, scales=scales, block_size=(1, columns))


FP8_SCHEMES: dict[str, ActivationScheme | None] = {
    "weight-only": None,
    "token": ActivationScheme("float", 8, "token", is_dynamic=True),
    "static tensor": ActivationScheme("float", 8, "tensor", is_dynamic=False),
    "group": ActivationScheme("float", 8, "group", is_dynamic=True, group_size=64),
}


@pytest.mark.parametrize("scheme_name", list(FP8_SCHEMES))
@pytest.mark.parametrize("block_columns", [None, 128])
@pytest.mark.parametrize("use_scaled_mm", [True, False])
def test_fp8_matmul_either_way_matches_dequantize_then_matmul(
    scheme_name: str, block_columns: int | None, use_scaled_mm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both routes, forced on CPU tensors: ``torch._scaled_mm`` where it fits (FP8 per token or per tensor, channel
    scales) and per-tile dequantization elsewhere, against the checkpoint's definition."""
    scheme = FP8_SCHEMES[scheme_name]
    weight = _fp8_weight(block_columns)
    input_scale = torch.tensor([0.02])
    bias = torch.randn(OUT_FEATURES)
    calls: list[int] = []
    real_scaled_mm = torch._scaled_mm

    def scaled_mm(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real_scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(checkpoint_quantizer, "FP8_GPU_TILE_ROWS", 32)  # two tiles, the last one short
    x = torch.randn(5, IN_FEATURES) * 3
    for dtype in DTYPES:
        x_rounded = x.to(dtype).float()  # what the function sees
        if scheme is not None:
            codes, x_scale = quantize_activations(x_rounded, scheme, input_scale)
            x_rounded = (codes * x_scale).reshape(x.shape)
        expected = x_rounded @ weight.dequantize().T + bias.to(dtype).float()
        calls.clear()
        out = fp8_matmul(
            x.to(dtype), weight.values, weight.scales, scheme, input_scale, bias.to(dtype), use_scaled_mm=use_scaled_mm
        )
        fits = scheme_name in ("token", "static tensor") and block_columns is None
        assert calls == ([1] if use_scaled_mm and fits else [])
        assert_close_to(out, expected, dtype)


@pytest.mark.parametrize("scaled_mm", [False, True])
def test_carried_checkpoints_through_the_gpu_paths_match_the_producing_tool(
    scaled_mm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every checkpoint of tests/models/quantized, loaded and run through the CUDA layouts and paths on the CPU
    (Triton under the interpreter; ``torch._int_mm``; FP8 through ``torch._scaled_mm`` or the tiled fallback), in
    float32, matches the producing tool's logits within the CPU path's tolerances. On a GPU machine the real
    CUDA paths run instead (``test_checkpoints_on_cuda_match_the_producing_tool``)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the kernels would not run on CPU tensors; the gpu test below runs them")
    from tests.models.quantized.test_reference_match import NAMES, _check_logits

    monkeypatch.setattr(checkpoint_quantizer, "_takes_gpu_paths", lambda device: True)
    monkeypatch.setattr(checkpoint_quantizer, "supports_fp8_matmul", lambda device: scaled_mm)
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE", "0")  # the CPU key with GPU layouts: keep it out of the cache
    apply_gpu = checkpoint_quantizer.CheckpointQuantizer._apply_gpu
    kinds: set[str] = set()

    def watched(self: checkpoint_quantizer.CheckpointQuantizer, layer: Any, x: torch.Tensor) -> torch.Tensor:
        kinds.add(self.weight_kind)
        assert self.weight_kind not in ("int4", "int8") or layer.qweight.dtype == torch.int32  # the GPU layout
        return apply_gpu(self, layer, x)

    monkeypatch.setattr(checkpoint_quantizer.CheckpointQuantizer, "_apply_gpu", watched)
    real_scaled_mm, scaled_mm_calls = torch._scaled_mm, []

    def scaled_mm_watched(*args: Any, **kwargs: Any) -> torch.Tensor:
        scaled_mm_calls.append(1)
        return real_scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_watched)
    for name in NAMES if not scaled_mm else [n for n in NAMES if n.startswith("ct-fp8-")]:
        _check_logits(name)
    assert kinds == ({"fp8"} if scaled_mm else {"int4", "int8", "w8a8", "fp8"})
    assert bool(scaled_mm_calls) == scaled_mm


def test_fp8_matmul_needs_compute_capability_8_9() -> None:
    assert not supports_fp8_matmul(torch.device("cpu"))
    if torch.cuda.is_available():
        assert supports_fp8_matmul(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (8, 9))


def test_half_precision_is_for_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU-only machine bfloat16 is refused when the model is built; with CUDA present it is accepted then, and
    a layer that turns out to be on the CPU refuses its weight."""
    quantizer = GPTQQuantizer()
    quantizer.configure({"quant_method": "gptq", "bits": 4, "group_size": 32})
    monkeypatch.setattr(checkpoint_quantizer, "_cuda_is_available", lambda: False)
    with pytest.raises(ValueError, match="computes in float32 on the CPU"):
        Linear(IN_FEATURES, OUT_FEATURES, bias=False, quantizer=quantizer, dtype=torch.bfloat16)
    monkeypatch.setattr(checkpoint_quantizer, "_cuda_is_available", lambda: True)
    layer = Linear(IN_FEATURES, OUT_FEATURES, bias=False, quantizer=quantizer, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="computes in float32 on the CPU"):
        layer.load_weight("weight", random_int_weight(4, 32, False, True))  # type: ignore[arg-type]


# ---------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 16, 17, 200])
def test_w8a8_and_fp8_on_cuda_match_the_cpu(num_tokens: int) -> None:
    """``torch._int_mm`` (padded below 17 rows) and ``torch._scaled_mm`` (on compute capability 8.9+; the tiled
    fallback elsewhere) on the GPU against the same functions on the CPU."""
    weight = random_int_weight(8, IN_FEATURES, act_order=False, symmetric=True, out=64)
    storage = repack_int(weight)
    scheme = ActivationScheme("int", 8, "token", is_dynamic=True)
    x = torch.randn(num_tokens, IN_FEATURES)
    expected = int8_matmul(x, storage["qweight"], storage["out_scale"], scheme, torch.empty(0))
    cuda = {name: value.cuda() for name, value in storage.items()}
    out = int8_matmul(x.cuda(), cuda["qweight"], cuda["out_scale"], scheme, torch.empty(0, device="cuda"))
    # Bitwise the same codes on both devices (quantize_activations divides by a tensor: see there), so only the
    # float32 products' order differs.
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    fp8 = _fp8_weight(None)
    fp8_scheme = ActivationScheme("float", 8, "token", is_dynamic=True)
    # The GPU side's input is rounded to bfloat16 before its FP8 rounding: the CPU side rounds the same values (from
    # float32 inputs, an input near an FP8 midpoint could round the other way: a whole FP8 step).
    x = x.bfloat16().float()
    expected = fp8_matmul(x, fp8.values, fp8.scales, fp8_scheme, torch.empty(0), None, use_scaled_mm=False)
    out = fp8_matmul(
        x.cuda().bfloat16(), fp8.values.cuda(), fp8.scales.cuda(), fp8_scheme, torch.empty(0, device="cuda"), None,
        use_scaled_mm=supports_fp8_matmul(torch.device("cuda")),
    )  # fmt: skip
    assert_close_to(out, expected, torch.bfloat16)


def _logits_on_cuda(name: str, dtype: str) -> tuple[torch.Tensor, list[list[int]], dict[str, torch.Tensor]]:
    from tests.models.quantized.test_reference_match import CHECKPOINTS, _reference
    from tokenmill.config import load_config
    from tokenmill.model_loader import load_model
    from tokenmill.model_runner import ModelRunner, SequenceChunk

    prompts, reference = _reference(name)
    config = load_config(overrides={
        "model": {"model": str(CHECKPOINTS / name), "dtype": dtype}, "device": {"device": "cuda"},
        "cache": {"kv_cache_dtype": dtype},
    })  # fmt: skip
    loaded = load_model(config)
    runner = ModelRunner(loaded, num_blocks=64, block_size=4)
    chunks = [SequenceChunk(prompts[0], 0, list(range(0, 3))), SequenceChunk(prompts[1], 0, list(range(3, 5)))]
    return runner.execute(chunks, all_logits=True).float().cpu(), prompts, reference


def _checkpoint_names() -> list[str]:
    from tests.models.quantized.test_reference_match import NAMES

    return NAMES


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", _checkpoint_names())
def test_checkpoints_on_cuda_match_the_producing_tool(name: str) -> None:
    """Every carried checkpoint loaded on the GPU in float32 (twice: the second start reads the weight cache's
    GPU layout) matches the tool's logits within the CPU path's tolerance; FP8 through ``torch._scaled_mm`` within
    0.3.

    FP8 tensor cores (sm_89+) accumulate products with about 14 bits of mantissa before promoting partial sums to
    float32 (the DeepSeek-V3 report, section 3.3.2), where the CPU and the tool accumulate in float32: on an H200
    the FP8 checkpoints' logits were 0.188 (dynamic) and 0.227 (static) from the tool's, against 0.1. On the CPU,
    relative noise of 2^-14 on every FP8 matmul's output moves them by up to 0.196 and 0.234 (2^-12: 0.234 and
    0.252; measured 2026-11-26 with a patched ``_fp8_matmul``): 0.3 bounds that accumulation error."""
    from tests.models.quantized.test_reference_match import _tolerance

    fp8_tensor_cores = name.startswith("ct-fp8-") and supports_fp8_matmul(torch.device("cuda"))
    tolerance = 0.3 if fp8_tensor_cores else _tolerance(name)
    logits, prompts, reference = _logits_on_cuda(name, "float32")
    again, _, _ = _logits_on_cuda(name, "float32")
    torch.testing.assert_close(again, logits, atol=0, rtol=0)
    start = 0
    for index, prompt in enumerate(prompts):
        expected = reference[f"logits.{index}"]
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=tolerance, rtol=0)
        start += len(prompt)
