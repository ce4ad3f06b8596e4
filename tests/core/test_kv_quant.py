"""The quantized KV cache (``cache.kv_cache_dtype = "fp8" | "int8"``): its format, the torch reference backend
over it, the setting, the memory budget, and what it does to a tiny model's output."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch
from tokenmill_kernels.paged_attention import cpu as cpu_kernels

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec
from tokenmill.attention.kv_quant import dequantize_kv, is_quantized_kv, kv_row_size, quantize_kv, read_kv
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.config import load_config
from tokenmill.config.cache import CacheConfig
from tokenmill.config.engine import ConfigError
from tokenmill.engine import now
from tokenmill.memory import plan_kv_cache
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import resolve_kv_cache_dtype
from tokenmill.model_runner import SequenceChunk, build_batch
from tokenmill.plugin_manager import PluginError
from tokenmill.sampling_params import SamplingParams

FP8, INT8 = torch.float8_e4m3fn, torch.int8


def _rows(*shape: int, seed: int = 0) -> torch.Tensor:
    """Rows with outliers and a wide range of magnitudes, as keys have."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, generator=generator) * torch.rand(*shape[:-1], 1, generator=generator) * 20
    rows[..., 3] *= 8  # an outlier channel
    return rows


def _split(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as uint8, scales as float32 [..., 1]) of packed rows."""
    raw = packed.view(torch.uint8)
    return raw[..., :-4], raw[..., -4:].contiguous().view(torch.float32)


def test_fp8_rows_are_torch_float8_codes_of_row_over_absmax_scale():
    rows = _rows(6, 3, 64)
    packed = quantize_kv(rows, FP8)
    assert packed.dtype == FP8 and packed.shape == (6, 3, 68)
    codes, scales = _split(packed)
    assert torch.equal(scales, rows.abs().amax(-1, keepdim=True) / 448.0)
    assert torch.equal(codes, (rows / scales).to(FP8).view(torch.uint8))  # torch's e4m3 rounding
    assert int((codes & 0x7F).max()) == 0x7E  # each row's absmax is code 448; no NaN code
    restored = dequantize_kv(packed)
    # 3 mantissa bits: within half a step, 2^-4 relative, of each value (2^-9 * scale for subnormals)
    assert bool(((restored - rows).abs() <= rows.abs() / 16 + scales * 2**-10).all())
    assert float((restored - rows).abs().max()) > 0  # it is lossy: the test would see a no-op


def test_int8_rows_are_rounded_codes_of_row_over_absmax_scale():
    rows = _rows(6, 3, 64, seed=1)
    packed = quantize_kv(rows, INT8)
    assert packed.dtype == INT8 and packed.shape == (6, 3, 68)
    codes, scales = _split(packed)
    assert torch.equal(scales, rows.abs().amax(-1, keepdim=True) / 127.0)
    assert torch.equal(codes.view(torch.int8), (rows / scales).round().to(torch.int8))
    assert int(codes.view(torch.int8).abs().max()) == 127
    restored = dequantize_kv(packed, torch.float16)
    assert restored.dtype == torch.float16
    error = (restored.float() - rows).abs()
    assert bool((error <= scales / 2 + rows.abs() * 2**-10).all())  # half a step, plus float16's rounding


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_zero_rows_have_scale_zero_and_read_as_zeros(dtype):
    packed = quantize_kv(torch.zeros(2, 32), dtype)
    assert not packed.view(torch.uint8).any()  # a zeroed cache is a valid cache of zeros
    assert torch.equal(read_kv(packed, torch.float32), torch.zeros(2, 32))


def test_row_size_counts_the_scale():
    assert kv_row_size(64, FP8) == kv_row_size(64, INT8) == 68
    assert kv_row_size(64, torch.float16) == 64
    assert is_quantized_kv(INT8) and not is_quantized_kv(torch.bfloat16)
    shape = TorchAttentionBackend().kv_cache_shape(10, 16, 3, 64, FP8)
    assert shape == (2, 10, 16, 3, 68)


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_torch_backend_attends_over_the_dequantized_cache(dtype):
    """Writes quantize into the slots; attention equals float attention over the dequantized rows."""
    block_size, num_blocks, spec = 4, 12, AttentionLayerSpec(4, 2, 32, 32**-0.5)
    chunks = [SequenceChunk([1] * 6, 0, [5, 2]), SequenceChunk([1], 9, [7, 0, 11])]
    _, metadata = build_batch(chunks, block_size)
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(metadata.num_tokens, h, 32, generator=generator) for h in (4, 2, 2))
    cache = quantize_kv(_rows(2, num_blocks, block_size, 2, 32, seed=4), dtype)
    backend = TorchAttentionBackend()
    backend.prepare(metadata, block_size)
    got = backend.forward(spec, query, key, value, cache, metadata)

    slots = metadata.slot_mapping
    written = cache.view(2, -1, 2, 36)[:, slots]  # [2, num_tokens, kv_heads, row]
    assert torch.equal(written[0].view(torch.uint8), quantize_kv(key, dtype).view(torch.uint8))
    assert torch.equal(written[1].view(torch.uint8), quantize_kv(value, dtype).view(torch.uint8))
    widened = dequantize_kv(cache)  # what the cache holds, as float32
    float_metadata = build_batch(chunks, block_size)[1]
    backend.prepare(float_metadata, block_size)
    expected = backend.forward(
        spec, query, dequantize_kv(written[0]), dequantize_kv(written[1]), widened, float_metadata
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_budget_holds_about_twice_the_float16_blocks():
    """SmolLM2-135M's geometry (30 layers, 3 KV heads of 64): fp8/int8 rows cost 68 bytes against 128."""
    config = CacheConfig(kv_cache_memory="256MiB")
    layouts = {
        dtype: plan_kv_cache(config, torch.device("cpu"), 30, 3, 64, dtype)
        for dtype in (torch.float32, torch.float16, FP8, INT8)
    }
    float16 = layouts[torch.float16]
    assert float16.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 2
    for dtype in (FP8, INT8):
        assert layouts[dtype].bytes_per_block == 2 * 30 * 16 * 3 * 68  # the scales are counted
        assert 1.85 < layouts[dtype].num_blocks / float16.num_blocks < 1.9  # 128 / 68 = 1.88
        assert layouts[dtype].num_bytes <= 256 * 2**20
    assert layouts[torch.float32].num_blocks * 2 == pytest.approx(float16.num_blocks, abs=1)


class _FloatOnly(AttentionBackend):
    name: ClassVar[str] = "float-only"
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16,)

    def forward(self, *args: object) -> torch.Tensor:
        raise NotImplementedError


class _Dense:
    is_dense = True


@pytest.mark.parametrize(("name", "dtype"), [("fp8", FP8), ("fp8_e4m3", FP8), ("int8", INT8)])
def test_vllm_names_resolve_to_the_quantized_dtypes(name, dtype):
    assert resolve_kv_cache_dtype(name, torch.bfloat16, TorchAttentionBackend(), _Dense()) == dtype  # type: ignore[arg-type]


def test_a_backend_without_quantized_caches_refuses_them_in_one_line():
    with pytest.raises(PluginError) as error:
        resolve_kv_cache_dtype("fp8", torch.float32, _FloatOnly(), _Dense())  # type: ignore[arg-type]
    message = str(error.value)
    assert "\n" not in message
    assert message == (
        "cache.kv_cache_dtype='fp8': attention backend 'float-only' stores only float32, float16 for this "
        "float32 model; choose one of those or another attention.backend"
    )


def test_config_accepts_the_quantized_names_and_refuses_others():
    assert load_config(overrides={"cache": {"kv_cache_dtype": "fp8_e4m3"}}).cache.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype: Invalid enum value 'fp4'"):
        load_config(overrides={"cache": {"kv_cache_dtype": "fp4"}})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama-tiny")
    save_hf_model("llama-tiny", directory)
    return directory


def _prompt_logprobs(model_dir: Path, kv_cache_dtype: str, backend: str) -> torch.Tensor:
    """Log-probabilities at every position of a 96-token prompt read in chunks of 16, so that every chunk
    attends over the earlier chunks' K/V as the cache holds them."""
    engine = make_engine(model_dir, attention={"backend": backend}, cache={"kv_cache_dtype": kv_cache_dtype})
    prompt = [(11 * t) % 500 + 3 for t in range(96)]
    chunks = [
        engine.executor.runner.execute(
            [SequenceChunk(prompt[start : start + 16], start, list(range(24)))], all_logits=True
        )
        for start in range(0, 96, 16)
    ]
    return torch.cat(chunks).log_softmax(-1)  # [96, vocab]


# Measured on llama-tiny (seed 0, head_dim 16) with the cpu backend: max |dlogprob| 0.15 (fp8), 0.025 (int8),
# 0.001 for float16; argmax agreement 0.94 and 1.0. The bounds leave about 2x room.
LOGPROB_TOLERANCE = {"fp8": (0.3, 0.9), "int8": (0.05, 0.98)}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_prompt_logprobs_stay_close_to_a_float_cache(llama_dir, kv_cache_dtype, backend):
    if backend == "cpu" and not cpu_kernels.is_available():
        pytest.skip("the CPU kernels need AVX2, FMA and a compiler")
    exact = _prompt_logprobs(llama_dir, "float32", backend)
    quantized = _prompt_logprobs(llama_dir, kv_cache_dtype, backend)
    max_error, min_agreement = LOGPROB_TOLERANCE[kv_cache_dtype]
    difference = (quantized - exact).abs().max()
    assert 0 < float(difference) <= max_error
    assert float((quantized.argmax(-1) == exact.argmax(-1)).float().mean()) >= min_agreement


# Measured as above over 8 requests x 24 greedy tokens: 142/192 tokens equal for fp8 (3 of 8 sequences
# identical), 186/192 for int8 (7 of 8), 186/192 for float16. A divergence carries on to the sequence's end,
# and this random model's logits are flat, so the bounds are on the share of equal positions.
GREEDY_AGREEMENT = {"fp8": 0.6, "int8": 0.9}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_greedy_generation_stays_close_to_a_float_cache(llama_dir, kv_cache_dtype):
    requests = [
        EngineCoreRequest(
            str(i),
            [(17 * i + 5 * t) % 500 + 3 for t in range(20 + 7 * i)],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            [],
            now(),
        )
        for i in range(8)
    ]
    exact = run_to_completion(make_engine(llama_dir, cache={"kv_cache_dtype": "float32"}), requests)
    engine = make_engine(llama_dir, cache={"kv_cache_dtype": kv_cache_dtype})
    assert engine.loaded.kv_cache_dtype == {"fp8": FP8, "int8": INT8}[kv_cache_dtype]
    head_dim = 64 // 4
    assert engine.executor.runner.kv_caches[0].shape[-1] == head_dim + 4
    got = run_to_completion(engine, requests)
    equal = sum(a == b for key in exact for a, b in zip(got[key], exact[key], strict=True))
    assert equal / (8 * 24) >= GREEDY_AGREEMENT[kv_cache_dtype]
