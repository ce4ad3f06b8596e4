"""``bench step`` on a tiny in-memory model, through the engine's and the model runner's public API."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenmill_plugins.commands.bench.step import run_step

from tests.factories import make_engine, save_hf_model


@pytest.mark.parametrize("model", ["llama-tiny", "qwen3-tiny"])  # qwen3: q/k norms over the heads
def test_step_times_a_decode_step_and_its_parts(tmp_path: Path, model: str) -> None:
    save_hf_model(model, tmp_path)
    engine = make_engine(tmp_path)
    report = run_step(engine, batch_size=3, context_len=10, num_steps=2, seed=0)
    results, parameters = report["results"], report["parameters"]
    assert report["benchmark"] == "step" and (results["batch_size"], results["context_len"]) == (3, 10)
    assert min(results["step_ms"], results["linear_ms"], results["attention_ms"]) > 0
    assert results["other_ms"] == pytest.approx(results["step_ms"] - results["linear_ms"] - results["attention_ms"])
    parts = [results[name] for name in ("schedule_ms", "update_ms", "batch_ms", "sampling_ms", "layer_kernels_ms")]
    assert min(parts) > 0 and results["rest_ms"] == pytest.approx(results["other_ms"] - sum(parts))
    assert results["output_throughput"] == pytest.approx(3 / (results["step_ms"] / 1000))
    in_step = [results[f"{name}_in_step_ms"] for name in ("linear", "attention", "layer_kernels", "other")]
    assert min(in_step) > 0 and sum(in_step) == pytest.approx(results["step_in_step_ms"])
    assert parameters["attention_backend"] == engine.loaded.attention.name
    assert parameters["quantization"] == "none"
    assert not engine.has_unfinished_requests()  # its requests are aborted, their blocks free

    again = run_step(engine, batch_size=1, context_len=4, num_steps=1, seed=1)  # the same engine serves more runs
    assert again["results"]["batch_size"] == 1


def test_attention_specs_one_per_layer(tmp_path: Path) -> None:
    save_hf_model("llama-tiny", tmp_path)
    loaded = make_engine(tmp_path).loaded
    specs = loaded.model.attention_specs()
    assert len(specs) == loaded.arch.num_layers
    assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in specs} == {
        (loaded.arch.num_attention_heads, loaded.arch.num_kv_heads, loaded.arch.head_dim)
    }
