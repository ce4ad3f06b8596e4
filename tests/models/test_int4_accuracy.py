"""The default path (Q4_1 linears, Q8_0 output projection, float16 KV cache) against transformers float32 on
the same weights, the GGUF blocks dequantized exactly: ``tokenmill bench accuracy``'s measurement.

Tolerance: 0.25 nats on the chosen token's logprob at every greedy position of every prompt, the bound issue 18
sets (it quotes llama.cpp's Q4_1 path at 0.19; on these prompts llama.cpp measured 0.09 to 0.37). Measured with
int16 activations and the float16 cache: 0.001 to 0.006 nats per prompt, mostly the float16 cache's share (with a
float32 cache: 0.001), and greedy output the reference's on every prompt. The kernels' earlier int8 activations
were 0.16 to 0.44 nats off and left the reference on every prompt; ``act=int8`` plants that rounding (emulated:
0.19 to 0.44 per prompt over two runs, at least one prompt above 0.25 in each) to show that the check fails for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenmill_plugins.commands.bench.accuracy import Variant, run_accuracy

from tokenmill.config import load_config

MAX_ERROR_NATS = 0.25

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def variants(smollm2_gguf: Path) -> dict[str, dict[str, Any]]:
    config = load_config(overrides={"model": {"model": str(smollm2_gguf)}, "device": {"device": "cpu"}})
    report = run_accuracy(config, [Variant.parse("default"), Variant.parse("act=int8")])
    return {variant["variant"]: variant for variant in report["results"]["variants"]}


def _over(variant: dict[str, Any]) -> list[tuple[str, float]]:
    return [(p["prompt"], p["max_error"]) for p in variant["prompts"] if p["max_error"] > MAX_ERROR_NATS]


def test_default_path_stays_within_quarter_nat_of_float32(variants: dict[str, dict[str, Any]]) -> None:
    default = variants["default"]
    assert (default["quantization"], default["kv_cache_dtype"]) == ("int4+int8", "float16")
    assert len(default["prompts"]) == 4 and all(p["num_tokens"] > 0 for p in default["prompts"])
    assert _over(default) == []


def test_the_check_fails_for_int8_activations(variants: dict[str, dict[str, Any]]) -> None:
    assert _over(variants["act=int8"]) != []
