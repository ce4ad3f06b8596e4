"""Speculative decoding and KV tiers through an engine on a CUDA GPU (Triton attention, CUDA graphs for plain
decode steps), in float32 so that greedy tokens must equal plain decoding's exactly, as on the CPU.

Marked ``gpu``; skips without CUDA. ``DEVICE`` is a module attribute so that the tests' logic can be run on the
CPU by hand (set it to ``"cpu"``); the CPU suite covers the same features in tests/speculators and tests/kv_tiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.core.test_async_scheduling import greedy_token, run_workload, workload
from tests.kv_tiers.test_engine_tiers import _prompt, _rounds
from tests.models.quantized.test_reference_match import NAMES as QUANTIZED_CHECKPOINTS
from tests.models.quantized.test_reference_match import _check_logits
from tests.speculators.test_verification import _requests
from tokenmill.engine import EngineCore
from tokenmill.testing.factories import make_engine, run_to_completion

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the engine on a CUDA GPU"),
]

DEVICE = "cuda"


def _engine(model_dir: Path, **sections: dict[str, Any]) -> EngineCore:
    sections = {"device": {"device": DEVICE}, "model": {"dtype": "float32"}, **sections}
    return make_engine(model_dir, **sections)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_output_equals_plain_decoding(method: str, tiny_model: Path) -> None:
    """Verification steps (several rows per request, run eagerly) give exactly the tokens of plain decode steps
    (one row per request, replayed from CUDA graphs)."""
    plain_engine = _engine(tiny_model)
    assert plain_engine.executor.runner.cuda_graphs is not None or DEVICE == "cpu"
    plain = run_to_completion(plain_engine, _requests(6))
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3, "draft_policy": "constant"}
    if method == "draft_model":
        spec["model"] = str(tiny_model)  # the target drafting for itself: every draft is accepted
    engine = _engine(tiny_model, speculative_config=spec)
    assert run_to_completion(engine, _requests(6)) == plain
    stats = engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if method == "draft_model":
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_kv_tiers_change_no_token_through_eviction_and_reload(tiny_model: Path) -> None:
    """A device cache too small for the rounds: prefixes are evicted to the cpu tier and loaded back into the
    GPU's cache, and every token equals the run without tiers."""
    # Rounds of 4 requests of 40 + 8 tokens (48 blocks of 4 at once; the device has 30, so some are preempted);
    # the third round repeats the first, whose prefixes the second evicted from the device.
    prompts = [_prompt(seed) for seed in (0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3)]
    cache = {"num_kv_blocks": 30}
    plain = _rounds(_engine(tiny_model, cache=cache), prompts, concurrent=4)
    tiered_engine = _engine(tiny_model, cache=cache, kv_tiers=[{"name": "cpu", "capacity": "64MiB"}])
    assert _rounds(tiered_engine, prompts, concurrent=4) == plain
    (cpu,) = tiered_engine.kv_tiers
    assert cpu.stats.hits > 0  # prefixes came back from the cpu tier
    tiered_engine.close()


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_async_scheduling_gives_the_tokens_of_synchronous_steps(cuda_graphs: bool, tiny_model: Path) -> None:
    """Steps launched while the step before runs, their input ids read on the GPU (into a graph's buffer, or
    as an eager step's input), give the tokens and stops of synchronous steps. Logprobs agree to float32
    rounding: the two runs batch differently, and GPU kernels round differently per batch shape."""
    sections: dict[str, Any] = {"device": {"device": DEVICE, "cuda_graphs": cuda_graphs}}
    scheduler = {"max_num_seqs": 4}
    sync = _engine(tiny_model, scheduler=scheduler, **sections)
    requests = workload(stop_token=greedy_token(sync, 5))
    tokens, logprobs, finished = run_workload(sync, requests)
    engine = _engine(tiny_model, scheduler={**scheduler, "async_scheduling": True}, **sections)
    assert engine.loop.runs_ahead
    assert (engine.executor.runner.cuda_graphs is not None) == (cuda_graphs and DEVICE == "cuda")
    async_tokens, async_logprobs, async_finished = run_workload(engine, requests)
    assert (async_tokens, async_finished) == (tokens, finished)
    assert async_logprobs.keys() == logprobs.keys()
    for request_id, values in logprobs.items():
        assert async_logprobs[request_id] == pytest.approx(values, abs=1e-3), request_id
    assert engine.loop.num_steps_run_ahead > 10


def test_bench_step_times_a_gpu_decode_step_and_its_parts(tiny_model: Path) -> None:
    """``bench step`` on the GPU: inputs in the model's device and dtype (bf16), every timed call synchronized."""
    from tokenmill_plugins.commands.bench.step import run_step

    engine = make_engine(tiny_model, device={"device": DEVICE})
    report = run_step(engine, batch_size=4, context_len=32, num_steps=5, seed=0)
    results = report["results"]
    assert min(results["step_ms"], results["linear_ms"], results["attention_ms"]) > 0
    assert report["parameters"]["attention_backend"] == ("triton" if DEVICE == "cuda" else "cpu")
    assert not engine.has_unfinished_requests()
    assert engine.executor.runner.cuda_graphs is not None or DEVICE == "cpu"  # the linears' eager step gave them back


def test_triton_fused_experts_decode_as_the_reference(tmp_path: Path) -> None:
    """A MoE model under ``--fused-experts triton`` (what ``auto`` picks on CUDA) and ``torch``, float32: the same
    greedy tokens; the triton ones ran (their launcher was called), decode steps replayed from CUDA graphs, which
    the ``torch`` ones (reading the routing on the host) run without."""
    from tokenmill_kernels.fused_moe import triton as fused_moe

    from tokenmill.engine import now
    from tokenmill.messages import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.testing.factories import save_tiny_model

    model_dir = save_tiny_model(tmp_path, "qwen3-moe-tiny")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {"a": [5, 17, 300, 42, 9, 77, 123], "b": [400, 3, 3, 90]}
    launches: list[int] = []
    launch = fused_moe.fused_experts

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        launches.append(1)
        return launch(*args, **kwargs)

    fused_moe.fused_experts = counted
    try:
        engines = {name: _engine(model_dir, model={"dtype": "float32", "fused_experts": name})
                   for name in ("torch", "triton")}  # fmt: skip
        results = {
            name: run_to_completion(engine, [EngineCoreRequest(r, p, params, [], now()) for r, p in prompts.items()])
            for name, engine in engines.items()
        }
    finally:
        fused_moe.fused_experts = launch
    assert results["torch"] == results["triton"] and launches
    graphs = {name: engine.executor.runner.cuda_graphs for name, engine in engines.items()}
    assert graphs["torch"] is None and (graphs["triton"] is not None or DEVICE == "cpu")


@pytest.mark.parametrize("name", [name for name in QUANTIZED_CHECKPOINTS if "-moe-" in name])
def test_quantized_moe_checkpoints_match_their_tools(name: str) -> None:
    """The MoE checkpoints of tests/models/quantized on the GPU's dequantizing matmuls, float32, against the producing
    tools' logits to the CPU's tolerance."""
    _check_logits(name, DEVICE)


def test_structured_output_masks_apply_on_the_device(tiny_model: Path) -> None:
    """Constrained requests beside free ones on the GPU (the bitmask copied there and applied by torch ops before the
    sampler), temperature 1.0: every constrained output validates with ``jsonschema``, and the free requests get
    exactly the tokens they get alone."""
    from tests.structured_output.schemas import SCHEMAS, assert_valid
    from tests.structured_output.test_engine import _json, _params, _run, _texts
    from tokenmill.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(tiny_model)
    schema = SCHEMAS["flat"]
    free = [_params(None, seed, max_tokens=12) for seed in range(3)]
    alone = _texts(_run(_engine(tiny_model), tokenizer, free), tokenizer)
    constrained = [_params(_json(schema), seed) for seed in range(4)]
    mixed = _texts(_run(_engine(tiny_model), tokenizer, [*free, *constrained]), tokenizer)
    assert [mixed[f"r{i}"] for i in range(3)] == [alone[f"r{i}"] for i in range(3)]
    for i in range(3, 7):
        assert_valid(mixed[f"r{i}"], schema)
