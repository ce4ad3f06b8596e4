"""The scheduler's policy, step by step, with a real KV cache manager and no model."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from tests.factories import make_requests, make_scheduler
from tokenmill.messages import EngineCoreOutput
from tokenmill.request import RequestStatus
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.scheduler import ModelRunnerOutput, SchedulerOutput


def _complete(scheduler, output: SchedulerOutput, token: int = 7) -> list[EngineCoreOutput]:  # type: ignore[no-untyped-def]
    """Play the runner and sampler: every request that samples gets ``token``; the scheduler does the rest."""
    runner_output = ModelRunnerOutput(sampled_token_ids={r.request_id: [token] for _, r in output.sampling_requests})
    return scheduler.update_from_output(output, runner_output)


def _plan(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in output.scheduled]


def test_token_budget_splits_a_long_prompt_while_others_decode() -> None:
    scheduler = make_scheduler()
    requests = make_requests(1, prompt_len=6) + make_requests(1, prompt_len=40, max_tokens=2)[0:1]
    requests[1].request_id = "long"
    requests[1].arrival_time = 1.0
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert _plan(first) == [("r0", 6), ("long", 10)]  # the budget of 16 cuts the long prompt
    _complete(scheduler, first)
    second = scheduler.schedule()
    assert _plan(second) == [("r0", 1), ("long", 15)]  # r0 decodes, long reads its next chunk
    assert not second.scheduled[1].samples_token
    _complete(scheduler, second)
    third = scheduler.schedule()
    assert _plan(third) == [("r0", 1), ("long", 15)]
    assert third.scheduled[1].samples_token  # 10 + 15 + 15 = 40: the prompt is read, a token is due


def test_new_requests_join_at_every_step_up_to_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=3)
    requests = make_requests(5, prompt_len=2, max_tokens=10)
    for request in requests[:2]:
        scheduler.add_request(request)
    _complete(scheduler, scheduler.schedule())
    for request in requests[2:]:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert _plan(output) == [("r0", 1), ("r1", 1), ("r2", 2)]  # r3, r4 wait for a free seat
    assert scheduler.num_waiting == 2 and scheduler.num_running == 3


def test_preemption_takes_the_lowest_priority_latest_request() -> None:
    # 8 blocks of 4 tokens: three 8-token prompts fill 6; decoding soon needs more.
    scheduler = make_scheduler("priority", num_blocks=8)
    requests = make_requests(3, prompt_len=8, max_tokens=8)
    requests[0].priority = 1  # least important, though first to arrive
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert _plan(output) == [("r1", 8), ("r2", 8)]  # priority first: r0 does not fit the budget of 16
    _complete(scheduler, output)
    preempted: list[str] = []
    for _ in range(6):
        output = scheduler.schedule()
        preempted += [r.request_id for r in output.preempted]
        _complete(scheduler, output)
    assert preempted and set(preempted) <= {"r0", "r2"}
    assert "r1" not in preempted  # the most important running request keeps its blocks
    assert scheduler.num_preemptions == len(preempted)
    victim = scheduler.requests[preempted[0]]
    assert victim.num_preemptions >= 1


def test_preempted_request_keeps_its_tokens_and_recomputes_them() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64, enable_prefix_caching=False)
    first, second = make_requests(2, prompt_len=8, max_tokens=12)
    for request in (first, second):
        scheduler.add_request(request)
    output = scheduler.schedule()
    while not any(r is second for r in output.preempted):
        _complete(scheduler, output)
        output = scheduler.schedule()
    _complete(scheduler, output)
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    generated = list(second.output_token_ids)
    assert generated  # it had produced tokens before losing its blocks
    while True:
        output = scheduler.schedule()
        readmitted = next((s for s in output.scheduled if s.request is second), None)
        if readmitted is not None:
            break
        _complete(scheduler, output)
    # Readmitted: the prompt and every generated token are read again in one chunk (the budget
    # allows it), and the step then samples the next token; nothing generated was lost.
    assert second.output_token_ids == generated
    assert (second.num_computed_tokens, readmitted.num_new_tokens) == (0, 8 + len(generated))
    assert readmitted.samples_token


def test_abort_frees_everything_wherever_the_request_is() -> None:
    scheduler = make_scheduler()
    requests = make_requests(4, prompt_len=10, max_tokens=20)
    for request in requests:
        scheduler.add_request(request)
    _complete(scheduler, scheduler.schedule())  # r0 and r1 (partly) running, r2 and r3 waiting
    finished = scheduler.abort_requests(["r0", "r3", "unknown"])
    assert [(o.request_id, o.finish_reason, o.request_finished) for o in finished] == [
        ("r0", "abort", True),
        ("r3", "abort", True),
    ]
    assert requests[0].status == requests[3].status == RequestStatus.FINISHED_ABORTED
    assert scheduler.num_waiting == 1 and [r.request_id for r in scheduler.running] == ["r1"]
    while scheduler.has_unfinished_requests():
        _complete(scheduler, scheduler.schedule())
    assert scheduler.kv_cache.usage == 0
    scheduler.kv_cache.check_invariants()


def test_prefix_cache_hit_on_admission() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    first, second = make_requests(2, prompt_len=13, max_tokens=1)
    second = dataclasses.replace(second, prompt_token_ids=first.prompt_token_ids[:12] + [5, 6])
    scheduler.add_request(first)
    _complete(scheduler, scheduler.schedule())
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert _plan(output) == [("r1", 2)]  # 3 full blocks (12 tokens) reused
    assert second.num_cached_tokens == 12


def test_fcfs_runs_in_arrival_order_and_refuses_priorities() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    late, early = make_requests(2, prompt_len=8, max_tokens=1)
    late.arrival_time, early.arrival_time = 5.0, 1.0
    scheduler.add_request(late)
    scheduler.add_request(early)
    assert _plan(scheduler.schedule()) == [("r1", 8)]
    (urgent,) = make_requests(1, priority=-1)
    urgent.request_id = "urgent"
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        scheduler.add_request(urgent)
    assert "urgent" not in scheduler.requests


def test_priority_policy_admits_the_lowest_value_first() -> None:
    scheduler = make_scheduler("priority", max_num_batched_tokens=8)
    requests = make_requests(3, prompt_len=8, max_tokens=1)
    for request, priority in zip(requests, (2, 0, 1), strict=True):
        request.priority = priority
        scheduler.add_request(request)
    order = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        order += [s.request.request_id for s in output.scheduled]
        _complete(scheduler, output)
    assert order == ["r1", "r2", "r0"]


def test_n_completions_are_forked_by_the_scheduler_and_finish_together() -> None:
    scheduler = make_scheduler()
    (request,) = make_requests(1, prompt_len=6, max_tokens=2)
    request.params = msgspec.structs.replace(request.params, n=3)
    scheduler.add_request(request)
    first = scheduler.schedule()
    (scheduled,) = first.scheduled
    assert [r.request_id for r in scheduled.forks] == ["r0#1", "r0#2"]
    assert [r.request_id for _, r in first.sampling_requests] == ["r0", "r0#1", "r0#2"]
    outputs = _complete(scheduler, first)
    assert [(o.request_id, o.new_token_ids, o.parent_id) for o in outputs] == [
        ("r0", [7], None), ("r0#1", [7], "r0"), ("r0#2", [7], "r0"),
    ]  # fmt: skip
    outputs = _complete(scheduler, scheduler.schedule())
    assert [o.finish_reason for o in outputs] == ["length"] * 3
    assert [o.request_finished for o in outputs] == [False, False, True]  # the last of the three says so
    assert scheduler.kv_cache.usage == 0
    scheduler.kv_cache.check_invariants()


def test_aborting_a_request_id_aborts_all_its_completions() -> None:
    scheduler = make_scheduler()
    (request,) = make_requests(1, prompt_len=6, max_tokens=5)
    request.params = msgspec.structs.replace(request.params, n=2)
    scheduler.add_request(request)
    _complete(scheduler, scheduler.schedule())
    outputs = scheduler.abort_requests(["r0"])
    assert [(o.request_id, o.finish_reason, o.request_finished) for o in outputs] == [
        ("r0", "abort", False),
        ("r0#1", "abort", True),
    ]
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache.usage == 0


def test_a_runner_error_finishes_only_that_request() -> None:
    scheduler = make_scheduler()
    requests = make_requests(2, prompt_len=4, max_tokens=3)
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    runner_output = ModelRunnerOutput(sampled_token_ids={"r0": [7]}, errors={"r1": "logits processor 'x' failed"})
    outputs = scheduler.update_from_output(output, runner_output)
    assert [(o.request_id, o.finish_reason, o.error) for o in outputs] == [
        ("r0", None, None),
        ("r1", "abort", "logits processor 'x' failed"),
    ]
    while scheduler.has_unfinished_requests():
        _complete(scheduler, scheduler.schedule())
    assert requests[0].output_token_ids == [7, 7, 7]


def test_outstanding_tokens_count_uncomputed_prompt_and_tokens_still_to_generate() -> None:
    scheduler = make_scheduler()  # a 16-token step budget
    short, long = make_requests(1, prompt_len=6, max_tokens=3) + make_requests(2, prompt_len=40, max_tokens=2)[1:]
    scheduler.add_request(short)
    scheduler.add_request(long)
    assert scheduler.stats().num_outstanding_tokens == (6 + 3) + (40 + 2)
    _complete(scheduler, scheduler.schedule())  # short's prompt and a token; 10 of long's prompt
    assert scheduler.stats().num_outstanding_tokens == (0 + 2) + (30 + 2)
    _complete(scheduler, scheduler.schedule())  # short: one token; long: 15 more of its prompt
    assert scheduler.stats().num_outstanding_tokens == (0 + 1) + (15 + 2)
    scheduler.abort_requests([long.request_id])
    assert scheduler.stats().num_outstanding_tokens == 1
