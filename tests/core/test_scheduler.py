"""The scheduler's policy, step by step, with a real KV cache manager and no model."""

from __future__ import annotations

import dataclasses

from tests.factories import make_requests, make_scheduler
from tokenmill.request import RequestStatus
from tokenmill.scheduler import SchedulerOutput


def _complete(scheduler, output: SchedulerOutput, token: int = 7) -> None:  # type: ignore[no-untyped-def]
    """Do what the engine does after the forward: count computed tokens, append sampled ones, stop."""
    for scheduled in output.scheduled:
        samples = scheduled.samples_token
        scheduler.finish_computed(scheduled)
        if samples:
            scheduled.request.append_token(token)
            status = scheduled.request.check_stop()
            if status is not None:
                scheduler.finish(scheduled.request, status)


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
    scheduler = make_scheduler(num_blocks=8)
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
    for request_id in ("r0", "r3", "unknown"):
        scheduler.abort_request(request_id)
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
