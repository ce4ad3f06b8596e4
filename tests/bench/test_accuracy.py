"""``bench accuracy``'s variants and report text (the measurement itself runs transformers: see docs/kv_cache.md)."""

from __future__ import annotations

import pytest
from tokenmill_plugins.commands.bench.accuracy import Variant, format_accuracy
from tokenmill_plugins.commands.bench.metrics import build_report


@pytest.mark.parametrize("name", ["float16", "fp8", "fp8_e4m3", "int8"])
def test_kv_variants_take_the_settings_names(name: str) -> None:
    assert Variant.parse(f"kv={name}").kv_cache_dtype == name


def test_a_kv_variant_the_setting_refuses_is_refused_when_parsed() -> None:
    with pytest.raises(ValueError, match="variant 'kv=fp4': kv: Invalid enum value 'fp4'"):
        Variant.parse("kv=fp4")


def _variant(name: str, kv_cache_dtype: str, perplexity: float) -> dict[str, object]:
    return {
        "variant": name, "quantization": "int4", "kv_cache_dtype": kv_cache_dtype, "perplexity": perplexity,
        "text_max_error": 0.1, "max_error": 0.2, "prompts": [],
    }  # fmt: skip


def test_report_gives_each_variants_perplexity_change_against_the_first() -> None:
    results = {
        "reference": {"perplexity": 10.0, "prompts": []},
        "variants": [_variant("kv=float16", "float16", 10.0), _variant("kv=fp8", "float8_e4m3fn", 10.25)],
    }
    text = format_accuracy(build_report("accuracy", {"model": "m"}, results))
    assert "kv=float16 (int4, KV cache float16): perplexity 10.0000, text max err" in text
    assert "kv=fp8 (int4, KV cache float8_e4m3fn): perplexity 10.2500 (+2.50% vs kv=float16)" in text
