"""Async scheduling (``scheduler.async_scheduling``): a step scheduled and launched while the one before still
runs gives exactly the tokens of synchronous scheduling, whatever arrives, stops or is aborted meanwhile.

It is off by default, and gains nothing on the CPU (nothing to overlap there) but runs when asked, so these
tests check its bookkeeping here; tests/gpu/test_features_on_gpu.py runs ``run_workload`` on CUDA, with CUDA graphs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tokenmill.engine import EngineCore
from tokenmill.messages import EngineCoreRequest
from tokenmill.request import PLACEHOLDER_TOKEN_ID
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ModelRunnerOutput
from tokenmill.testing.factories import make_engine, make_requests, make_scheduler, save_tiny_model

Results = tuple[dict[str, list[int]], dict[str, list[float]], dict[str, str]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("async") / "llama")


def workload(stop_token: int | None) -> list[EngineCoreRequest]:
    """Ten requests that exercise what a step ahead must get right: greedy and seeded sampling, logprobs, a
    penalty (such steps run in order), n = 2 (forks), logit bias and min_tokens, and stops in the middle of a
    step ahead."""
    requests = []
    for i in range(10):
        fields: dict[str, Any] = {"max_tokens": 4 + (7 * i) % 17, "temperature": 0.0}
        if i % 3 == 1:
            fields.update(temperature=0.8, seed=i)
        if i % 4 == 2:
            fields.update(logprobs=2)
        if i == 5:
            fields.update(presence_penalty=0.5)
        if i in (3, 6) and stop_token is not None:
            fields.update(stop_token_ids=[stop_token], max_tokens=40)
        if i == 8:
            fields.update(n=2)
        if i == 9:  # the built-in logits processors read no token values: they run ahead
            fields.update(logit_bias={5: 3.0}, min_tokens=3)
        prompt = [(37 * i + 11 * t) % 500 + 3 for t in range(3 + (5 * i) % 23)]
        requests.append(EngineCoreRequest(f"r{i}", prompt, SamplingParams(**fields), [], 0.0))
    return requests


def run_workload(engine: EngineCore, requests: list[EngineCoreRequest], abort: str | None = None) -> Results:
    """Add one request every third step (so steps ahead meet arrivals), abort ``abort`` at step 8, and step
    until done; returns the tokens, logprobs and finish reasons of each completion."""
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    finished: dict[str, str] = {}
    pending = list(requests)
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            engine.add_request(pending.pop(0))
        outputs = engine.step()
        if step == 8 and abort is not None:
            outputs += engine.abort_requests([abort])
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            logprobs.setdefault(output.request_id, []).extend(lp.logprob for lp in output.new_logprobs or ())
            if output.finish_reason is not None:
                assert output.request_id not in finished, f"{output.request_id} finished twice"
                finished[output.request_id] = output.finish_reason
        step += 1
    return tokens, logprobs, finished


def greedy_token(engine: EngineCore, position: int) -> int:
    """The token request r3 of ``workload`` generates at ``position``, for a stop that lands mid-way."""
    probe = workload(stop_token=None)[3]
    probe = EngineCoreRequest("probe", probe.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=12), [], 0.0)
    tokens, _, _ = run_workload(engine, [probe])
    return tokens["probe"][position]


@pytest.mark.parametrize("num_kv_blocks", [256, 22], ids=["roomy", "preempting"])
def test_steps_ahead_give_the_tokens_of_synchronous_steps(tiny_dir: Path, num_kv_blocks: int) -> None:
    """With a cache of 22 blocks of 4 tokens, requests are preempted and steps cannot always run ahead."""
    cache = {"num_kv_blocks": num_kv_blocks}
    sync = make_engine(tiny_dir, scheduler={"async_scheduling": False, "max_num_seqs": 4}, cache=cache)
    requests = workload(stop_token=greedy_token(sync, 5))
    expected = run_workload(sync, requests)
    assert sync.loop.num_steps_run_ahead == 0
    assert (sync.scheduler.num_preemptions > 0) == (num_kv_blocks == 22)

    engine = make_engine(tiny_dir, scheduler={"async_scheduling": True, "max_num_seqs": 4}, cache=cache)
    assert engine.loop.runs_ahead
    assert run_workload(engine, requests) == expected
    assert engine.loop.num_steps_run_ahead > 10
    _, _, finished = expected
    assert finished["r3"] == "stop"  # with a step already launched after its stop
    assert len(expected[0]["r3"]) <= 6 < 40
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0.0


def test_abort_while_a_step_is_in_flight(tiny_dir: Path) -> None:
    sync = make_engine(tiny_dir, scheduler={"async_scheduling": False, "max_num_seqs": 4})
    requests = workload(stop_token=None)
    expected_tokens, _, _ = run_workload(sync, requests, abort="r1")

    engine = make_engine(tiny_dir, scheduler={"async_scheduling": True, "max_num_seqs": 4})
    tokens, _, finished = run_workload(engine, requests, abort="r1")
    assert finished["r1"] == "abort"
    # The aborted request's tokens depend on when its outputs were read; everyone else's do not.
    del tokens["r1"], expected_tokens["r1"]
    assert tokens == expected_tokens
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0.0


def test_async_scheduling_is_opt_in_and_off_with_speculation(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert not make_engine(tiny_dir).loop.runs_ahead
    with caplog.at_level(logging.WARNING, logger="tokenmill.step_loop"):
        engine = make_engine(tiny_dir, scheduler={"async_scheduling": True}, speculative_config={"method": "ngram"})
    assert not engine.loop.runs_ahead
    assert "async scheduling off: speculative decoding" in caplog.text


# ---------------------------------------------------------------- the scheduler's part


def _launch_first_step() -> tuple[Any, Any]:
    scheduler = make_scheduler()
    for request in make_requests(2, prompt_len=3, max_tokens=3):
        scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.mark_in_flight(output)
    return scheduler, output


def test_mark_in_flight_counts_the_step_and_adds_placeholders() -> None:
    scheduler, output = _launch_first_step()
    for request in scheduler.running:
        assert request.num_computed_tokens == 3
        assert request.output_token_ids == [PLACEHOLDER_TOKEN_ID]
    assert scheduler.can_schedule_ahead()
    ahead = scheduler.schedule()
    assert [s.num_new_tokens for s in ahead.scheduled] == [1, 1]

    runner_output = ModelRunnerOutput(sampled_token_ids={"r0": [7], "r1": [9]})
    outputs = scheduler.update_from_output(output, runner_output)
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("r0", [7]), ("r1", [9])]
    r0 = scheduler.requests["r0"]
    assert r0.output_token_ids == [7] and r0.all_token_ids[-1] == 7
    assert r0.num_computed_tokens == 3  # counted once, by mark_in_flight
    scheduler.mark_in_flight(ahead)
    assert r0.output_token_ids == [7, PLACEHOLDER_TOKEN_ID] and r0.num_computed_tokens == 4


def test_no_step_ahead_past_a_known_end_or_with_arrivals_or_a_full_cache() -> None:
    scheduler, output = _launch_first_step()
    assert scheduler.can_schedule_ahead()
    scheduler.add_request(make_requests(3)[2])
    assert not scheduler.can_schedule_ahead()  # an arrival: the next step admits it

    scheduler, output = _launch_first_step()
    scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids={"r0": [7], "r1": [9]}))
    scheduler.mark_in_flight(scheduler.schedule())
    assert scheduler.can_schedule_ahead()
    scheduler.mark_in_flight(scheduler.schedule())  # the third and last token of max_tokens=3 is in flight
    assert not scheduler.can_schedule_ahead()

    scheduler = make_scheduler(num_blocks=2)  # the two prompts fill both blocks: the next token needs a new one
    for request in make_requests(2, prompt_len=4, max_tokens=3):
        scheduler.add_request(request)
    scheduler.mark_in_flight(scheduler.schedule())
    assert not scheduler.can_schedule_ahead()
