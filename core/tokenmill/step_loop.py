"""The engine loop's variants: what each of a step's three calls does, chosen once at start-up.

``EngineCore.step`` is always ``schedule`` -> ``execute`` -> ``update`` on the engine's loop
(docs/engine.md):

- ``SyncLoop``: the scheduler schedules, the executor runs the step, the scheduler applies its output; with a
  speculator, the proposer then hands the next step's drafts to the scheduler.
- ``KVTierLoop``: the same, with KV tiers: blocks of requests that left go to the tiers before their outputs
  are reported, and requests whose prompt another engine computes (disaggregated prefill) are held until
  their blocks have arrived.
- ``AsyncSchedulingLoop``: a decode step whose tokens the host need not see at once runs ahead: it is launched
  and left in flight, and the next step is scheduled and launched (its input ids read on the device) before
  the host waits for it. Each step then reports the step before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import ClassVar

from tokenmill.config import EngineConfig
from tokenmill.executor import LaunchedStep, ModelExecutor
from tokenmill.kv_cache.block_hash import block_hashes
from tokenmill.kv_cache.tier_stack import KVTierStack
from tokenmill.messages import EngineCoreOutput, EngineCoreRequest
from tokenmill.request import Request
from tokenmill.sampling.logits_processor import SamplingRow
from tokenmill.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

#: How long a decode engine holds a disaggregated request for its prompt's blocks before computing them itself.
KV_TRANSFER_TIMEOUT_S = 10.0


class SyncLoop:
    """Each step's tokens are applied before the next step is scheduled."""

    #: Whether steps may run ahead, and how many did: launched ahead of the step before them (for tests and
    #: benchmarks).
    runs_ahead: ClassVar[bool] = False
    num_steps_run_ahead = 0

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.proposer = executor.proposer  # with a speculator: drafts for the next step, after each update

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not scheduler_output.scheduled and self.scheduler.has_unfinished_requests():
            time.sleep(0.0005)  # requests wait for something (their grammar compiling): let it run, not spin
        return self.executor.execute(scheduler_output)

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self.proposer is not None and scheduler_output.scheduled:
            self.scheduler.update_draft_token_ids(self.proposer.propose(scheduler_output, runner_output, outputs))
        return outputs

    def hold(self, message: EngineCoreRequest) -> bool:
        """Whether the loop keeps a new request back from the scheduler for now (it queues it later)."""
        return False

    def abort(self, request_ids: list[str], completions_only: bool) -> list[EngineCoreOutput]:
        """``Scheduler.abort_requests``, plus whatever the loop keeps for the requests."""
        outputs = self.scheduler.abort_requests(request_ids, completions_only)
        if self.proposer is not None:
            self.proposer.forget([output.request_id for output in outputs])
        return outputs

    @property
    def num_held(self) -> int:
        """Requests held back from the scheduler (``hold``)."""
        return 0


class KVTierLoop(SyncLoop):
    """``SyncLoop`` for an engine with KV tiers below its device cache."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: ModelExecutor,
        enqueue: Callable[[EngineCoreRequest], None],
        block_size: int,
        hash_salt: str,
    ) -> None:
        super().__init__(scheduler, executor)
        assert executor.kv_tier_stack is not None, "an engine with KV tiers"
        self.kv_cache = executor.kv_cache
        self.kv_tier_stack: KVTierStack = executor.kv_tier_stack
        self.enqueue = enqueue
        self.block_size = block_size
        self.hash_salt = hash_salt
        #: Disaggregated requests held until their prompt's blocks arrive: id -> (request, deadline, hashes).
        self._held: dict[str, tuple[EngineCoreRequest, float, list[bytes]]] = {}

    def schedule(self) -> SchedulerOutput:
        if self._held:
            self._admit_arrived()
        return super().schedule()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not scheduler_output.scheduled:  # perhaps a prefix being read in the background: let it run, not spin
            time.sleep(0.0005)
        return self.executor.execute(scheduler_output)

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = super().update(scheduler_output, runner_output)
        self._store_completed()
        return outputs

    def hold(self, message: EngineCoreRequest) -> bool:
        if not (message.kv_transfer_params or {}).get("do_remote_prefill"):
            return False
        # Disaggregated prefill: the prefill engine ships the prompt's blocks; wait for them (bounded).
        prompt = message.prompt_token_ids
        num_blocks = (len(prompt) - 1) // self.block_size  # as many as a prefix lookup can reuse
        hashes = block_hashes(prompt, self.block_size, self.hash_salt, message.cache_salt)[:num_blocks]
        self._held[message.request_id] = (message, time.monotonic() + KV_TRANSFER_TIMEOUT_S, hashes)
        self._admit_arrived()
        return True

    def abort(self, request_ids: list[str], completions_only: bool) -> list[EngineCoreOutput]:
        held = [
            EngineCoreOutput(request_id, [], finish_reason="abort", request_finished=True)
            for request_id in request_ids if self._held.pop(request_id, None) is not None
        ]  # fmt: skip
        outputs = held + super().abort(request_ids, completions_only)
        self._store_completed()
        return outputs

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _store_completed(self) -> None:
        """Hand the blocks of requests that just left to the ``completion`` tiers, now: before their outputs are
        reported (a decode engine waits for them) and before anything can overwrite the blocks."""
        self.executor.transfer_kv(self.kv_cache.take_transfers())

    def _admit_arrived(self) -> None:
        """Queue the held requests whose blocks have all arrived, or that waited too long (their prompt is then
        computed here: slower, same output)."""
        now = time.monotonic()
        for request_id, (message, deadline, hashes) in list(self._held.items()):
            arrived = all(self.kv_tier_stack.contains(h) for h in hashes)
            if arrived or now > deadline:
                if not arrived:
                    logger.warning("request %s: its prompt's KV blocks did not arrive within %.0f s; computing them",
                                   request_id, KV_TRANSFER_TIMEOUT_S)  # fmt: skip
                del self._held[request_id]
                self.enqueue(message)


class AsyncSchedulingLoop(SyncLoop):
    """``SyncLoop`` whose decode steps run ahead: ``execute`` launches this step and returns the output of the step
    before it (in flight until then), and ``update`` applies that output and leaves this step in flight. A step
    that may not run ahead (prompt chunks, forks, prompt logprobs, sampling that reads token history) runs
    synchronously, after the step in flight is applied."""

    runs_ahead: ClassVar[bool] = True

    def __init__(self, scheduler: Scheduler, executor: ModelExecutor) -> None:
        super().__init__(scheduler, executor)
        #: The logits processors that read token values: while one is active, a request's steps run in order.
        self._history_readers = [p for p in executor.logits_processors if p.reads_output_token_ids]
        self._in_flight: LaunchedStep | None = None
        self._launched: LaunchedStep | None = None  # by ``execute``, in flight once ``update`` ran

    def schedule(self) -> SchedulerOutput:
        in_flight = self._in_flight
        if in_flight is not None and not (self.scheduler.can_schedule_ahead() and self._may_continue(in_flight)):
            return SchedulerOutput()  # nothing new: this step waits for the one in flight
        return self.scheduler.schedule()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        in_flight = self._in_flight
        if scheduler_output.scheduled and (in_flight is not None or self._may_run_ahead(scheduler_output)):
            self.num_steps_run_ahead += in_flight is not None
            self._launched = self.executor.launch(scheduler_output, in_flight)
            return self.executor.collect(in_flight) if in_flight is not None else ModelRunnerOutput()
        if scheduler_output.scheduled:
            assert in_flight is None
            return self.executor.execute(scheduler_output)
        if in_flight is not None:
            return self.executor.collect(in_flight)
        return super().execute(scheduler_output)  # nothing at all: waits a moment if requests are waiting

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        in_flight, launched = self._in_flight, self._launched
        if in_flight is None and launched is None:  # a synchronous step
            return self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs = []
        if in_flight is not None:  # its tokens replace its requests' placeholders
            outputs = self.scheduler.update_from_output(in_flight.scheduler_output, runner_output)
        self._in_flight, self._launched = launched, None
        if launched is not None:
            self.scheduler.mark_in_flight(launched.scheduler_output)
        return outputs

    def _may_run_ahead(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a step scheduled with nothing in flight may run ahead: every scheduled request samples one
        token (no drafts, no forks, no prompt logprobs) from logits that no penalty or logits processor reads
        its token history for."""
        if scheduler_output.kv_transfers or scheduler_output.preempted:
            return False
        if not all(s.samples_token and not s.forks and not s.draft_token_ids for s in scheduler_output.scheduled):
            return False
        return all(self._needs_no_history(s.request) for s in scheduler_output.scheduled)

    def _may_continue(self, in_flight: LaunchedStep) -> bool:
        """Whether the next step, which ``can_schedule_ahead`` says holds only requests of ``in_flight``, may run
        ahead of it: its requests' logits still need no token history (a logits processor may turn on)."""
        scheduled = in_flight.scheduler_output.scheduled
        return all(self._needs_no_history(s.request) for s in scheduled if not s.request.is_finished)

    def _needs_no_history(self, request: Request) -> bool:
        """Whether sampling ``request`` reads no token values (penalties do, and logits processors that say so):
        a placeholder may stand in its history."""
        params = request.params
        if request.needs_prompt_logits or params.repetition_penalty != 1.0:
            return False
        if request.structured_output is not None:  # its grammar's mask follows every token
            return False
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            return False
        if not self._history_readers:
            return True
        row = SamplingRow(request.request_id, params, request.prompt_token_ids, request.output_token_ids,
                          request.eos_token_ids)  # fmt: skip
        return not any(processor.is_active(row) for processor in self._history_readers)


def uses_async_scheduling(config: EngineConfig, scheduler: Scheduler, blockers: dict[str, bool]) -> bool:
    """``scheduler.async_scheduling``, unless a feature that needs each step's tokens on the host before the next
    is scheduled turns it off (``blockers``: feature -> whether it is on)."""
    if not config.scheduler.async_scheduling:
        return False
    blockers = {**blockers, f"the {scheduler.name!r} scheduler": not type(scheduler).supports_async_scheduling}
    blocking = [name for name, blocks in blockers.items() if blocks]
    if blocking:
        logger.warning("async scheduling off: %s needs each step's tokens before the next step", blocking[0])
        return False
    logger.info("async scheduling on: a decode step is launched while the step before runs")
    return True
