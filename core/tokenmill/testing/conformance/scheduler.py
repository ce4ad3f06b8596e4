"""``check_scheduler``: a scheduler through a simulated workload, with a fake model runner (no torch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.kv_cache.manager import KVCacheManager, PagedKVCacheManager
from tokenmill.messages import EngineCoreOutput, completion_request_id
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from tokenmill.testing.conformance._util import calling, conformance_check, fail

EOS = 2
#: Request ids to abort at a step: one still waiting, and one no scheduler knows.
_ABORTS_AT = {1: ["r7", "no-such-request"]}
#: Request id to abort once a completion has received this many tokens: a running request, and all n of an
#: n > 1 request by its id once its forks run.
_ABORTS_WHEN = {"r4": ("r4", 2), "r8": ("r8#1", 1)}


@dataclass
class _Planned:
    prompt_len: int
    max_tokens: int
    n: int = 1
    arrives_at: int = 0
    stops_at: int | None = None  # the runner samples EOS as this output token (1-based)
    shares_prefix_with: str | None = None
    expected_reason: str = "length"


@dataclass
class _Completion:
    sampled: list[int] = field(default_factory=list)  # what the fake runner gave it
    received: list[int] = field(default_factory=list)  # what update_from_output reported
    finish_reason: str | None = None
    seen: bool = False  # in an output at least once


_WORKLOAD: dict[str, _Planned] = {
    "r0": _Planned(10, 5),
    "r1": _Planned(30, 3),  # longer than the step budget: chunked prefill
    "r2": _Planned(6, 4, n=3),  # forks two completions when its prompt is computed
    "r3": _Planned(11, 6, shares_prefix_with="r0"),
    "r4": _Planned(5, 40, expected_reason="abort"),  # aborted while running
    "r5": _Planned(12, 10, stops_at=3, expected_reason="stop"),
    "r6": _Planned(4, 2, arrives_at=2),
    "r7": _Planned(7, 3, arrives_at=1, expected_reason="abort"),  # aborted before it runs
    "r8": _Planned(9, 30, n=2, expected_reason="abort"),  # all of its n aborted by its id
    "r9": _Planned(40, 8, arrives_at=3),
}


def _prompt(request_id: str) -> list[int]:
    planned = _WORKLOAD[request_id]
    base = int(request_id[1:])
    prompt = [100 + 50 * base + t for t in range(planned.prompt_len)]
    if planned.shares_prefix_with is not None:
        shared = _prompt(planned.shares_prefix_with)[:8]
        prompt[: len(shared)] = shared
    return prompt


def _token(request: Request) -> int:
    """The fake model's next token: a function of the request's id and length (never EOS unless planned)."""
    root = (request.parent_id or request.request_id).split("#")[0]
    stops_at = _WORKLOAD[root].stops_at
    if stops_at is not None and len(request.output_token_ids) + 1 == stops_at:
        return EOS
    return 10 + (sum(map(ord, request.request_id)) * 31 + request.num_tokens) % 40


@conformance_check
def check_scheduler(
    scheduler: Callable[..., Scheduler],
    *,
    kv_cache_manager: Callable[..., KVCacheManager] = PagedKVCacheManager,
    num_blocks: int = 14,
    block_size: int = 4,
    max_num_batched_tokens: int = 16,
    max_num_seqs: int = 6,
    max_steps: int = 400,
) -> None:
    """Run a simulated workload through ``schedule()`` and ``update_from_output()`` with a fake runner.

    Ten requests arrive over the first steps: long prompts read in chunks, a shared prefix, an n = 3
    request, one that samples EOS, and aborts of a running request, a waiting one, all n of an n = 2
    request by its id and an unknown id; the KV cache is small enough to force preemption. Each step must
    stay within ``max_num_batched_tokens`` and ``max_num_seqs``, give each scheduled request blocks that
    cover its tokens and write no block another scheduled request writes; outputs must carry exactly the
    tokens the runner sampled (up to a stop), finish each completion once with the right reason and mark
    each request's last output ``request_finished``. In the end nothing is left unfinished and every KV
    block is free again (``usage == 0``).

    :param scheduler: a ``Scheduler`` class or factory, called as the engine does:
        ``scheduler(kv_cache, max_num_batched_tokens=..., max_num_seqs=...)``.
    :param kv_cache_manager: the KV cache manager class or factory, called as
        ``kv_cache_manager(num_blocks, block_size, enable_prefix_caching=True)``.
    :raises AssertionError: naming the step, the request and what went wrong.
    """
    kv_cache = kv_cache_manager(num_blocks, block_size, enable_prefix_caching=True)
    candidate = scheduler(kv_cache, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    name = type(candidate).__name__
    completions: dict[str, _Completion] = {}
    for request_id, planned in _WORKLOAD.items():
        for index in range(planned.n):
            completions[completion_request_id(request_id, index)] = _Completion()
    finished_roots: set[str] = set()

    def record(outputs: list[EngineCoreOutput], when: str) -> None:
        for output in outputs:
            completion = completions.get(output.request_id)
            if completion is None:
                fail(f"{name}: {when}: an output for unknown request id {output.request_id!r}")
            if completion.finish_reason is not None:
                fail(f"{name}: {when}: an output for {output.request_id!r} after it finished")
            completion.received.extend(output.new_token_ids)
            completion.finish_reason = output.finish_reason
            root = output.parent_id or output.request_id
            completion.seen = True
            if output.request_finished:
                siblings = [completions[completion_request_id(root, i)] for i in range(_WORKLOAD[root].n)]
                if output.finish_reason == "abort":
                    # Aborted before its prompt was computed, an n > 1 request never forked the others.
                    for sibling in siblings:
                        if not sibling.seen:
                            sibling.finish_reason = "abort"
                unfinished = [completion_request_id(root, i) for i, s in enumerate(siblings) if s.finish_reason is None]
                if unfinished or root in finished_roots:
                    fail(f"{name}: {when}: request_finished on {output.request_id!r} while {unfinished} of its "
                         "completions are unfinished, or for the second time")  # fmt: skip
                finished_roots.add(root)

    step = 0
    while step < max_steps:
        with calling(f"{name} at step {step}"):
            if not _run_step(candidate, kv_cache, step, completions, record, max_num_batched_tokens, max_num_seqs):
                break
        step += 1
    else:
        stats = candidate.stats()
        leaked = " (KV blocks leaked? nothing runs, yet blocks are in use)" if not stats.num_running else ""
        fail(f"{name}: requests were still unfinished after {max_steps} steps{leaked}: {stats.num_running} "
             f"running, {stats.num_waiting} waiting, KV cache usage {kv_cache.usage:.3f}")  # fmt: skip

    for request_id, completion in completions.items():
        planned = _WORKLOAD[request_id.split("#")[0]]
        if completion.finish_reason != planned.expected_reason:
            fail(f"{name}: {request_id!r} finished with {completion.finish_reason!r}, expected "
                 f"{planned.expected_reason!r}")  # fmt: skip
        if completion.received != completion.sampled:
            fail(f"{name}: {request_id!r}: outputs carried {completion.received}, the runner sampled "
                 f"{completion.sampled}")  # fmt: skip
        expected_len = {"length": planned.max_tokens, "stop": planned.stops_at}.get(planned.expected_reason)
        if expected_len is not None and len(completion.received) != expected_len:
            fail(f"{name}: {request_id!r} finished ({completion.finish_reason}) with {len(completion.received)} "
                 f"tokens, expected {expected_len}")  # fmt: skip
    if finished_roots != set(_WORKLOAD):
        fail(f"{name}: no output marked request_finished for {sorted(set(_WORKLOAD) - finished_roots)}")
    stats = candidate.stats()
    if stats.num_running or stats.num_waiting:
        fail(f"{name}: all requests finished, but stats() reports {stats.num_running} running and "
             f"{stats.num_waiting} waiting")  # fmt: skip
    if kv_cache.usage != 0:
        fail(f"{name}: KV blocks leaked: usage is {kv_cache.usage:.3f} after every request finished; free a "
             "request's blocks when it finishes, is aborted or is preempted")  # fmt: skip
    check_invariants = getattr(kv_cache, "check_invariants", None)
    if check_invariants is not None:
        check_invariants()


def _run_step(
    candidate: Scheduler,
    kv_cache: KVCacheManager,
    step: int,
    completions: dict[str, _Completion],
    record: Callable[[list[EngineCoreOutput], str], None],
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> bool:
    """One engine step of the workload, with its arrivals and aborts; False once everything finished."""
    name = type(candidate).__name__
    for request_id, planned in _WORKLOAD.items():
        if planned.arrives_at == step:
            candidate.add_request(Request(
                request_id=request_id, prompt_token_ids=_prompt(request_id),
                params=SamplingParams(n=planned.n, max_tokens=planned.max_tokens, temperature=0),
                eos_token_ids=(EOS,), max_model_len=1024, arrival_time=float(step),
            ))  # fmt: skip
    to_abort = list(_ABORTS_AT.get(step, []))
    for request_id, (watched, num_tokens) in _ABORTS_WHEN.items():
        if completions[request_id].finish_reason is None and len(completions[watched].received) >= num_tokens:
            to_abort.append(request_id)
    if to_abort:
        aborted = candidate.abort_requests(to_abort)
        record(aborted, f"step {step}, abort_requests({to_abort})")
        if any(output.finish_reason != "abort" for output in aborted):
            fail(f"{name}: abort_requests returned outputs whose finish_reason is not 'abort'")
    if step > max(p.arrives_at for p in _WORKLOAD.values()) and not candidate.has_unfinished_requests():
        return False
    scheduler_output = candidate.schedule()
    _check_step(name, step, candidate, kv_cache, scheduler_output, max_num_batched_tokens, max_num_seqs)
    runner_output = ModelRunnerOutput()
    for _, request in scheduler_output.sampling_requests:
        token = _token(request)
        runner_output.sampled_token_ids[request.request_id] = [token]
        completions[request.request_id].sampled.append(token)
    record(candidate.update_from_output(scheduler_output, runner_output), f"step {step}, update_from_output")
    return True


def _check_step(
    name: str,
    step: int,
    candidate: Scheduler,
    kv_cache: KVCacheManager,
    output: SchedulerOutput,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> None:
    where = f"{name}: step {step}"
    if output.num_scheduled_tokens > max_num_batched_tokens:
        fail(f"{where}: scheduled {output.num_scheduled_tokens} tokens, over max_num_batched_tokens="
             f"{max_num_batched_tokens}")  # fmt: skip
    if candidate.stats().num_running > max_num_seqs:
        fail(f"{where}: {candidate.stats().num_running} requests running, over max_num_seqs={max_num_seqs}")
    ids = [s.request.request_id for s in output.scheduled]
    if len(set(ids)) != len(ids):
        fail(f"{where}: a request was scheduled twice in one step: {ids}")
    written: dict[int, str] = {}
    block_size = kv_cache.block_size
    for scheduled in output.scheduled:
        request = scheduled.request
        if request.is_finished:
            fail(f"{where}: scheduled {request.request_id!r}, which has finished")
        if not 0 < scheduled.num_new_tokens <= request.num_uncomputed_tokens:
            fail(f"{where}: {request.request_id!r} got {scheduled.num_new_tokens} tokens, but has "
                 f"{request.num_uncomputed_tokens} uncomputed")  # fmt: skip
        end = request.num_computed_tokens + scheduled.num_new_tokens
        table = kv_cache.block_ids(request.request_id)
        if len(table) * block_size < end:
            fail(f"{where}: {request.request_id!r} needs slots for {end} tokens but its block table has "
                 f"{len(table)} blocks of {block_size}")  # fmt: skip
        for block in {table[p // block_size] for p in range(request.num_computed_tokens, end)}:
            other = written.setdefault(block, request.request_id)
            if other != request.request_id:
                fail(f"{where}: {request.request_id!r} and {other!r} both write block {block}")
