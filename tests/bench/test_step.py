"""``bench step`` on a tiny in-memory model, through the engine's and the model runner's public API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenmill_plugins.commands.bench.step import _recorded_calls, run_step

from tests.factories import make_engine, save_hf_model


@pytest.mark.parametrize("model", ["llama-tiny", "qwen3-tiny"])  # qwen3: q/k norms over the heads
def test_step_times_a_decode_step_and_its_parts(tmp_path: Path, model: str) -> None:
    save_hf_model(model, tmp_path)
    engine = make_engine(tmp_path)
    report = run_step(engine, batch_size=3, context_len=10, num_steps=2, seed=0)
    results, parameters = report["results"], report["parameters"]
    assert report["benchmark"] == "step" and (results["batch_size"], results["context_len"]) == (3, 10)
    assert min(results["step_ms"], results["linear_ms"], results["attention_ms"]) > 0
    assert results["experts_ms"] == 0 and results["experts_in_step_ms"] == 0  # a dense model
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


@pytest.mark.parametrize("quantization", ["none", "int8"])  # the torch reference's experts; the cpu kernels'
def test_a_mixture_of_experts_times_its_fused_experts_apart(tmp_path: Path, quantization: str) -> None:
    """The linears timed alone are those one decode step called outside the fused experts, with their rows; the
    fused experts are timed apart, each MoE layer's call replayed with the step's routing."""
    save_hf_model("qwen3-moe-tiny", tmp_path, hidden_size=64, moe_intermediate_size=64, intermediate_size=64)
    engine = make_engine(tmp_path, model={"quantization": quantization})
    for request in range(3):
        engine.add_request(_request(f"r{request}"))
    engine.step()  # the prompts; the next step decodes one token each
    runner = engine.executor.runner
    graphs: Any = object()  # a replay would call it: the recorded step runs eagerly, then it is back
    runner.cuda_graphs = graphs
    calls, expert_calls = _recorded_calls(engine)
    assert runner.cuda_graphs is graphs
    runner.cuda_graphs = None
    moe_layers = sum(".experts.0.gate_up_proj" in _name(engine, m) for m in engine.loaded.model.modules())
    assert moe_layers and len(expert_calls) == moe_layers
    assert all(call().shape == (3, 64) for call in expert_calls)  # replayed over the step's three tokens
    assert calls and all(".experts." not in _name(engine, layer) and rows == 3 for layer, rows in calls)
    report = run_step(engine, batch_size=3, context_len=10, num_steps=2, seed=0)
    results = report["results"]
    assert 0 < results["experts_ms"] < results["step_ms"] and results["experts_in_step_ms"] > 0
    parts = results["linear_ms"] + results["experts_ms"] + results["attention_ms"]
    assert results["other_ms"] == pytest.approx(results["step_ms"] - parts)


def _name(engine: Any, module: Any) -> str:
    return next(name for name, m in engine.loaded.model.named_modules() if m is module)


def _request(request_id: str) -> Any:
    from tokenmill.engine import now
    from tokenmill.messages import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return EngineCoreRequest(request_id, [5, 9, 17, 33], params, [], now())


def test_attention_specs_one_per_layer(tmp_path: Path) -> None:
    save_hf_model("llama-tiny", tmp_path)
    loaded = make_engine(tmp_path).loaded
    specs = loaded.model.attention_specs()
    assert len(specs) == loaded.arch.num_layers
    assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in specs} == {
        (loaded.arch.num_attention_heads, loaded.arch.num_kv_heads, loaded.arch.head_dim)
    }
