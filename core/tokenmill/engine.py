"""``EngineCore``: the engine loop. Requests in, token deltas out, no I/O.

Every component is the implementation the config names for its slot, built
through the plugin system: the KV cache manager and its KV tiers, the
scheduler, the sampler and the logits processors (plus, inside the model loader, the architecture,
weight format, quantizer and attention backend). Each ``step`` is three calls::

    scheduler_output = scheduler.schedule()
    runner_output = self.execute(scheduler_output)       # model runner, logits processors, sampler
    outputs = scheduler.update_from_output(scheduler_output, runner_output)

The scheduler owns everything that changes a request's state; this module
only turns a schedule into a forward pass and sampled tokens, moving KV blocks
between the device and the KV tiers around it (``kv_tiers``: write-backs and
loads before the forward, finished requests' blocks right after the update;
docs/kv_cache.md#kv-tiers; a slow tier reads and writes on threads of its
own). With a speculator configured (``speculative_config``), a step also
verifies the drafts scheduled with each request
(``tokenmill.sampling.rejection_sampler``) and, after the update, asks the
speculator for the next step's drafts. The same object
runs in-process (offline ``LLM``) and, behind a transport, inside an engine
process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.config.cache import KVTierConfig
from tokenmill.cuda_graphs import cuda_graph_batch_sizes
from tokenmill.device_copy import to_device
from tokenmill.draft_tree import check_parents, parse_token_tree, path
from tokenmill.kv_cache.block_hash import block_hashes
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.kv_cache.tier import KVTier, check_tier_path
from tokenmill.kv_cache.tier_stack import KVTierStack
from tokenmill.memory import CacheLayout, plan_kv_cache
from tokenmill.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStatsMessage,
    KVTierStatsMessage,
    TokenLogprobs,
)
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.parallel.shards import ShardedModelRunner, ShardWorkers
from tokenmill.plugin_manager import FRONT_END_SLOTS, PluginSystem, Slot, resolve_plugins, slot_selections
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow
from tokenmill.sampling.rejection_sampler import rejection_sample, verify_greedy
from tokenmill.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.scheduler import ModelRunnerOutput, ScheduledRequest, Scheduler, SchedulerOutput
from tokenmill.speculation_policy import DraftPolicy
from tokenmill.speculator import SpeculationInput, Speculator, SpeculatorContext
from tokenmill.weights.cache import model_file_stats

logger = logging.getLogger(__name__)

#: How long a decode engine holds a disaggregated request for its prompt's blocks before computing them itself.
KV_TRANSFER_TIMEOUT_S = 10.0
_GENERATOR = "generator"  # Request.stash key: the request's own torch.Generator when seeded
_DRAFT_PROBS = "draft_probs"  # Request.stash key: the draft distributions of Request.spec_token_ids, if any
#: ``SamplingParams.extra_args`` key (``vllm_xargs`` over HTTP): true turns speculation off for the request.
DISABLE_SPECULATION = "disable_speculation"


@dataclass
class _LaunchedSample:
    """One step's sampling, queued on the device; ``EngineCore._collect`` reads it once the device is done."""

    requests: list[Request]  # the sampling rows, in order
    metadata: SamplingMetadata
    token_ids: torch.Tensor  # [R] int64 on the device: a step that runs ahead reads its input ids here
    host: SamplerOutput  # the sampler's output on the host, valid once ``ready`` has passed
    ready: torch.cuda.Event | None  # recorded after the copies to the host, on a CUDA device


@dataclass
class _InFlightStep:
    """A step that ran ahead (async scheduling): launched, marked in flight, its tokens not read yet."""

    scheduler_output: SchedulerOutput
    sample: _LaunchedSample
    rows: dict[str, int]  # request id -> its row of ``sample.token_ids``


class EngineCore:
    def __init__(self, config: EngineConfig, plugins: PluginSystem | None = None) -> None:
        self.config = config
        self.plugins = plugins if plugins is not None else resolve_plugins(config, skip=FRONT_END_SLOTS)
        tier_classes = [self._kv_tier_class(tier) for tier in config.kv_tiers]  # a bad entry fails before loading
        #: The worker processes of shards 1..N-1 with tensor parallelism (this process runs shard 0).
        self.shards = ShardWorkers(config) if config.parallel.tensor_parallel_size > 1 else None
        try:
            self.runner = self._load(config)
        except BaseException:
            if self.shards is not None:
                self.shards.stop()
            raise
        #: Salts every prefix-cache block hash: what the K/V of the same tokens depends on, so a KV tier that
        #: outlives this process (a disk) never serves blocks of other weights, dtypes or block sizes.
        self.kv_cache_hash_salt = kv_fingerprint(config, self.loaded, self.layout)
        arch = self.loaded.arch
        self.kv_tiers: list[KVTier] = []
        writes = []
        for tier, cls in zip(config.kv_tiers, tier_classes, strict=True):
            self.kv_tiers.append(self.plugins.instantiate(
                Slot.KV_TIER, tier.name, cls, capacity_bytes=tier.capacity_bytes,
                fingerprint=self.kv_cache_hash_salt, **({"path": tier.path} if tier.path else {}),
            ))  # fmt: skip
            writes.append(tier.write or cls.default_write)
        self.kv_tier_stack = KVTierStack(list(zip(self.kv_tiers, writes, strict=True)))
        self.kv_cache: KVCacheManager = self.plugins.create(
            Slot.KV_CACHE_MANAGER, config.cache.kv_cache_manager, self.layout.num_blocks, self.layout.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching, hash_salt=self.kv_cache_hash_salt,
            **({"tiers": self.kv_tier_stack} if self.kv_tiers else {}),
        )  # fmt: skip
        self.scheduler: Scheduler = self.plugins.create(
            Slot.SCHEDULER, config.scheduler.policy, self.kv_cache,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
        )  # fmt: skip
        self.sampler: Sampler = self.plugins.create(Slot.SAMPLER, config.sampler.sampler)
        _, processor_names = slot_selections(config)[Slot.LOGITS_PROCESSOR]
        self.logits_processors: list[LogitsProcessor] = [
            self.plugins.create(Slot.LOGITS_PROCESSOR, name) for name in processor_names
        ]
        #: The logits processors that read token values: while one is active, a request's steps run in order.
        self._history_readers = [p for p in self.logits_processors if p.reads_output_token_ids]
        self.max_model_len = self.loaded.max_model_len
        self.vocab_size = arch.vocab_size
        self.speculator = self._build_speculator()
        self.draft_policy: DraftPolicy | None = None
        if self.speculator is not None and config.speculative_config.draft_policy == "goodput":
            self.draft_policy = DraftPolicy(self.speculator.num_speculative_tokens)
        #: This step's final hidden state of each request that got a token, for a speculator that reads them.
        self._hidden_states: dict[str, torch.Tensor] = {}
        #: The requests of the last ``propose`` call (a new one's first call also reads its prompt).
        self._drafted_last_step: set[str] = set()
        #: Steps that ran the model (the engine process sends stats after each, even with no output).
        self.num_steps = 0
        #: Disaggregated requests held until their prompt's blocks arrive: id -> (request, deadline, hashes).
        self._awaiting_kv: dict[str, tuple[EngineCoreRequest, float, list[bytes]]] = {}
        #: Whether a step may be scheduled and launched while the one before still runs (async scheduling).
        self.async_scheduling = self._async_scheduling()
        self._in_flight: _InFlightStep | None = None
        #: Steps launched ahead of the step before them (async scheduling), for tests and benchmarks.
        self.num_steps_run_ahead = 0

    def _load(self, config: EngineConfig) -> ModelRunner:
        """Load the model (this process's shard of it), size the KV cache and build the runner."""
        shards = self.shards
        self.loaded: LoadedModel = load_model(config, self.plugins, shards.connect if shards is not None else None)
        arch = self.loaded.arch
        # kv_cache_memory is what one device holds: each GPU shard's own, but on the CPU, where the shards share
        # one memory, the whole replica's (then each shard allocates its share of every block).
        num_kv_heads = arch.num_kv_heads if self.loaded.device.type == "cpu" else self.loaded.num_kv_heads
        self.layout: CacheLayout = plan_kv_cache(
            config.cache, self.loaded.device, arch.num_layers, num_kv_heads, arch.head_dim,
            self.loaded.kv_cache_dtype,
        )  # fmt: skip
        if shards is not None:  # no CUDA graphs across shards yet: every step runs eagerly
            return ShardedModelRunner(self.loaded, self.layout.num_blocks, self.layout.block_size, shards)
        graph_batch_sizes = cuda_graph_batch_sizes(
            config.device.cuda_graphs, config.device.cuda_graph_batch_sizes, config.scheduler.max_num_seqs,
            self.loaded.device, self.loaded.attention,
        )  # fmt: skip
        return ModelRunner(
            self.loaded, self.layout.num_blocks, self.layout.block_size, cuda_graph_batch_sizes=graph_batch_sizes
        )

    def _kv_tier_class(self, tier: KVTierConfig) -> type[KVTier]:
        cls: type[KVTier] = self.plugins.load(Slot.KV_TIER, tier.name)
        try:
            check_tier_path(cls, tier.name, tier.capacity, tier.path)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return cls

    def close(self) -> None:
        """Flush the KV tiers' pending writes and release them, and stop the tensor-parallel workers; once,
        when the engine stops."""
        self.kv_tier_stack.close()
        if self.shards is not None:
            self.shards.stop()

    def _async_scheduling(self) -> bool:
        """``scheduler.async_scheduling``, unless a feature that needs each step's tokens on the host before the
        next is scheduled turns it off."""
        if not self.config.scheduler.async_scheduling:
            return False
        blockers = {
            "speculative decoding": self.speculator is not None,
            "KV tiers": bool(self.kv_tiers),
            "tensor parallelism": self.shards is not None,
            f"the {self.scheduler.name!r} scheduler": not type(self.scheduler).supports_async_scheduling,
        }
        blocking = [name for name, blocks in blockers.items() if blocks]
        if blocking:
            logger.warning("async scheduling off: %s needs each step's tokens before the next step", blocking[0])
            return False
        logger.info("async scheduling on: a decode step is launched while the step before runs")
        return True

    def _build_speculator(self) -> Speculator | None:
        spec = self.config.speculative_config
        if spec.method is None:
            return None
        if type(self.sampler).target_probs is Sampler.target_probs:
            logger.warning("sampler %r cannot verify drafts (no target_probs): speculative decoding is off",
                           self.sampler.name)  # fmt: skip
            return None
        cls = self.plugins.load(Slot.SPECULATOR, spec.method)
        k = spec.num_speculative_tokens or cls.default_num_speculative_tokens
        if spec.speculative_token_tree is not None:
            if not cls.supports_draft_trees:
                raise ConfigError(f"speculative_config.speculative_token_tree is set, but speculator {spec.method!r} "
                                  "drafts chains only; unset it")  # fmt: skip
            k = len(parse_token_tree(spec.speculative_token_tree))
        # A sliding window counts positions in the text, which a tree's nodes share; kept out rather than
        # approximated.
        windowed = any(window is not None for window in self.loaded.arch.sliding_windows)
        verifies_trees = self.loaded.attention.supports_draft_trees and not windowed
        if spec.speculative_token_tree is not None and not verifies_trees:
            reason = "the model has sliding-window layers" if windowed else (
                f"attention backend {self.loaded.attention.name!r} cannot verify them; use the 'cpu' or 'torch' "
                "backend, or unset it"
            )  # fmt: skip
            raise ConfigError(f"speculative_config.speculative_token_tree is set, but this engine cannot verify draft "
                              f"trees: {reason}")  # fmt: skip
        layout = self.layout
        context = SpeculatorContext(
            self.config, self.loaded, self.plugins, layout.block_size, layout.num_blocks, verifies_trees
        )
        speculator: Speculator = self.plugins.instantiate(
            Slot.SPECULATOR, spec.method, cls, num_speculative_tokens=k, context=context
        )
        logger.info("speculative decoding: %s, %d draft tokens", spec.method, speculator.num_speculative_tokens)
        return speculator

    # ------------------------------------------------------------------ requests

    def add_request(self, message: EngineCoreRequest) -> None:
        """Queue a request. Raises ``InvalidRequestError`` (and queues nothing) when it can never run."""
        self.check_prompt(message.prompt_token_ids)
        bad = next((t for t in message.params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        if (message.kv_transfer_params or {}).get("do_remote_prefill") and self.kv_tiers:
            # Disaggregated prefill: the prefill engine ships the prompt's blocks; wait for them (bounded).
            prompt = message.prompt_token_ids
            num_blocks = (len(prompt) - 1) // self.layout.block_size  # as many as a prefix lookup can reuse
            hashes = block_hashes(prompt, self.layout.block_size, self.kv_cache_hash_salt, message.cache_salt)
            self._awaiting_kv[message.request_id] = (message, time.monotonic() + KV_TRANSFER_TIMEOUT_S,
                                                     hashes[:num_blocks])  # fmt: skip
            self._admit_arrived()
            return
        self._enqueue(message)

    def _enqueue(self, message: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request_id=message.request_id,
                prompt_token_ids=list(message.prompt_token_ids),
                params=message.params,
                eos_token_ids=tuple(message.eos_token_ids),
                max_model_len=self.max_model_len,
                arrival_time=message.arrival_time,
                priority=message.priority,
                cache_salt=message.cache_salt,
                enqueued_at=time.monotonic(),
            )
        )

    def check_prompt(self, prompt: list[int]) -> None:
        """Raise ``InvalidRequestError`` when a request with this prompt could never run."""
        if not prompt:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; the context window is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        blocks_needed = -(-(len(prompt) + 1) // self.layout.block_size)
        if blocks_needed > self.layout.num_blocks:
            raise InvalidRequestError(
                f"the prompt needs {blocks_needed} KV blocks but the cache has {self.layout.num_blocks}; "
                "raise cache.kv_cache_memory"
            )

    def _admit_arrived(self) -> None:
        """Queue the held disaggregated requests whose blocks have all arrived, or that waited too long (their
        prompt is then computed here: slower, same output)."""
        now = time.monotonic()
        for request_id, (message, deadline, hashes) in list(self._awaiting_kv.items()):
            arrived = all(self.kv_tier_stack.contains(h) for h in hashes)
            if arrived or now > deadline:
                if not arrived:
                    logger.warning("request %s: its prompt's KV blocks did not arrive within %.0f s; computing them",
                                   request_id, KV_TRANSFER_TIMEOUT_S)  # fmt: skip
                del self._awaiting_kv[request_id]
                self._enqueue(message)

    def abort_requests(self, request_ids: list[str], completions_only: bool = False) -> list[EngineCoreOutput]:
        """Finish these requests now and free their blocks: all n completions of each (client gone), or with
        ``completions_only`` just the completions named (a stop string matched)."""
        held = [
            EngineCoreOutput(request_id, [], finish_reason="abort", request_finished=True)
            for request_id in request_ids if self._awaiting_kv.pop(request_id, None) is not None
        ]  # fmt: skip
        outputs = held + self.scheduler.abort_requests(request_ids, completions_only)
        self._store_completed()
        if self.speculator is not None and outputs:
            self.speculator.on_requests_finished([output.request_id for output in outputs])
            if self.draft_policy is not None:
                self.draft_policy.forget([output.request_id for output in outputs])
        return outputs

    def has_unfinished_requests(self) -> bool:
        # A step in flight holds running requests, or only finished ones (aborted): nothing left to do for those.
        return self.scheduler.has_unfinished_requests() or bool(self._awaiting_kv)

    @property
    def only_waiting_for_kv(self) -> bool:
        """Whether all there is to do is wait for disaggregated requests' blocks (nothing to compute yet)."""
        return bool(self._awaiting_kv) and not self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStatsMessage:
        """A snapshot for metrics and routers; cheap to take every step. The prefix cache's changes are not in
        it: the engine process takes them (``take_prefix_cache_delta``) for each connection's summary."""
        stats = self.scheduler.stats()
        num_free_kv_blocks = round((1.0 - stats.kv_cache_usage) * self.layout.num_blocks)
        if not self.kv_tiers:
            return msgspec.structs.replace(stats, num_free_kv_blocks=num_free_kv_blocks)
        tiers = [
            KVTierStatsMessage(tier.name, t.hits, t.misses, t.bytes_read, t.bytes_written, t.rejected, t.errors,
                               t.loads, t.load_seconds)
            for tier in self.kv_tiers for t in [tier.stats]
        ]  # fmt: skip
        return msgspec.structs.replace(stats, kv_tiers=tiers, num_free_kv_blocks=num_free_kv_blocks)

    def take_prefix_cache_delta(self) -> tuple[list[bytes], list[bytes]]:
        """The block hashes the device prefix cache gained and lost since the last call (net)."""
        return self.kv_cache.take_prefix_cache_delta()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, sample, and report what changed.

        With async scheduling (docs/engine.md) a step whose tokens the host need not see at once runs ahead:
        it is launched and left in flight, and the next call schedules and launches the step after it (its
        input ids are read on the device) before waiting for it; each call then reports the step before."""
        in_flight = self._in_flight
        if in_flight is not None and not (self.scheduler.can_schedule_ahead() and self._may_continue(in_flight)):
            return self._finish_in_flight()
        if self._awaiting_kv:
            self._admit_arrived()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            if in_flight is not None:
                return self._finish_in_flight()
            if self.kv_tiers:  # perhaps a prefix being read in the background: let the readers run, not spin
                time.sleep(0.0005)
            return []
        self.num_steps += 1
        if in_flight is not None or self._may_run_ahead(scheduler_output):
            return self._run_ahead(scheduler_output)
        started = time.perf_counter()
        runner_output = self.execute(scheduler_output)
        scheduled = scheduler_output.scheduled
        if self.draft_policy is not None and all(s.samples_token and s.request.output_token_ids for s in scheduled):
            # Decode and verification steps only: a prompt chunk's cost per token says nothing about drafts' (the
            # last chunk of a prompt samples a token too, but its request has none yet).
            seconds, drafted = time.perf_counter() - started, any(s.draft_token_ids for s in scheduled)
            self.draft_policy.observe_step(scheduler_output.num_scheduled_tokens, seconds, drafted)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._store_completed()
        if self.speculator is not None:
            self._propose(self.speculator, scheduler_output, outputs)
        return outputs

    # ------------------------------------------------------------------ async scheduling

    def _may_run_ahead(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a step scheduled with nothing in flight may run ahead: every scheduled request samples one
        token (no drafts, no forks, no prompt logprobs) from logits that no penalty or logits processor reads
        its token history for."""
        if not self.async_scheduling or scheduler_output.kv_transfers or scheduler_output.preempted:
            return False
        if not all(s.samples_token and not s.forks and not s.draft_token_ids for s in scheduler_output.scheduled):
            return False
        return all(self._needs_no_history(s.request) for s in scheduler_output.scheduled)

    def _may_continue(self, in_flight: _InFlightStep) -> bool:
        """Whether the next step, which ``can_schedule_ahead`` says holds only requests of ``in_flight``, may
        run ahead of it: its requests' logits still need no token history (a logits processor may turn on)."""
        scheduled = in_flight.scheduler_output.scheduled
        return all(self._needs_no_history(s.request) for s in scheduled if not s.request.is_finished)

    def _needs_no_history(self, request: Request) -> bool:
        """Whether sampling ``request`` reads no token values (penalties do, and logits processors that say so):
        a placeholder may stand in its history."""
        params = request.params
        if request.needs_prompt_logits or params.repetition_penalty != 1.0:
            return False
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            return False
        if not self._history_readers:
            return True
        row = SamplingRow(request.request_id, params, request.prompt_token_ids, request.output_token_ids,
                          request.eos_token_ids)  # fmt: skip
        return not any(processor.is_active(row) for processor in self._history_readers)

    def _run_ahead(self, scheduler_output: SchedulerOutput) -> list[EngineCoreOutput]:
        """Launch the step (its input ids from the step in flight, if any), then wait for the step in flight
        and report it, then leave this one in flight."""
        in_flight = self._in_flight
        self.num_steps_run_ahead += in_flight is not None
        self.runner.copy_blocks(scheduler_output.block_copies)
        chunks = [self._chunk(s) for s in scheduler_output.scheduled]
        input_ids = None
        if in_flight is not None:  # every scheduled request holds a placeholder: its token is on the device
            index = [in_flight.rows[s.request.request_id] for s in scheduler_output.scheduled]
            input_ids = in_flight.sample.token_ids
            if index != list(range(len(input_ids))):
                input_ids = input_ids[to_device(index, input_ids.device)]
        logits = self.runner.execute(chunks, input_ids=input_ids)
        requests = [request for _, request in scheduler_output.sampling_requests]
        sample = self._launch_sample(requests, logits)
        outputs = self._finish_in_flight() if in_flight is not None else []
        self.scheduler.mark_in_flight(scheduler_output)
        rows = {request.request_id: row for row, request in enumerate(requests)}
        self._in_flight = _InFlightStep(scheduler_output, sample, rows)
        return outputs

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight and apply its tokens (they replace its requests' placeholders)."""
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        return self.scheduler.update_from_output(in_flight.scheduler_output, self._collect(in_flight.sample))

    def _store_completed(self) -> None:
        """Hand the blocks of requests that just left to the ``completion`` tiers, now: before their outputs
        are reported (a decode engine waits for them) and before anything can overwrite the blocks."""
        if not self.kv_tiers:
            return
        transfers = self.kv_cache.take_transfers()
        if transfers.stores:
            blocks = self.runner.read_blocks([block_id for block_id, _ in transfers.stores])
            self.kv_cache.store_blocks([(h, b) for (_, h), b in zip(transfers.stores, blocks, strict=True)])
        assert not transfers.loads, "loads are queued by allocate_slots, during schedule, and taken there"

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the forward pass over the scheduled tokens and sample for every request that needs a token.

        The forward always runs: a step of prompt chunks only samples nothing but writes their K/V.
        Changes no request state."""
        transfers = scheduler_output.kv_transfers
        if transfers:
            # Evicted blocks are read before anything (a load, a copy, the forward) overwrites them.
            if transfers.stores:
                blocks = self.runner.read_blocks([block_id for block_id, _ in transfers.stores])
                self.kv_cache.store_blocks([(h, b) for (_, h), b in zip(transfers.stores, blocks, strict=True)])
            if transfers.loads:
                self.runner.write_blocks(transfers.loads)
                self.kv_tier_stack.loads_written()
        self.runner.copy_blocks(scheduler_output.block_copies)
        chunks = [self._chunk(s) for s in scheduler_output.scheduled]
        # Rows of logits: each sampling request's last token, plus its drafts' positions when verifying.
        logits_indices: list[int] = []
        first_row: dict[int, int] = {}  # scheduled index -> its first logits row
        end = 0
        for index, scheduled in enumerate(scheduler_output.scheduled):
            end += scheduled.num_new_tokens
            if scheduled.samples_token:
                first_row[index] = len(logits_indices)
                logits_indices.extend(range(end - 1 - len(scheduled.draft_token_ids), end))
        num_sampling_rows = len(logits_indices)
        prompt_rows = self._prompt_logits_rows(scheduler_output, logits_indices)  # appended after the sampling rows
        hidden = None
        if self.speculator is not None and self.speculator.needs_hidden_states:
            logits, hidden = self.runner.execute_with_hidden(chunks, logits_indices=logits_indices)
            hidden = hidden[:num_sampling_rows]
        else:
            logits = self.runner.execute(chunks, logits_indices=logits_indices)
        prompt_logprobs = _prompt_logprobs(logits[num_sampling_rows:], prompt_rows) if prompt_rows else {}
        logits = logits[:num_sampling_rows]
        targets = scheduler_output.sampling_requests
        if not targets:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        output = self._sample_or_verify(scheduler_output, logits, hidden, first_row)
        output.prompt_logprobs = prompt_logprobs
        return output

    def _prompt_logits_rows(
        self, scheduler_output: SchedulerOutput, logits_indices: list[int]
    ) -> list[tuple[Request, int, int]]:
        """For requests that asked for prompt logprobs: append to ``logits_indices`` the rows of this step's
        prompt positions not yet scored (position p scores prompt token p + 1); returns (request, first
        position, number of rows) for each, in the order appended."""
        rows: list[tuple[Request, int, int]] = []
        end = 0
        for scheduled in scheduler_output.scheduled:
            request, start = scheduled.request, end
            end += scheduled.num_new_tokens
            # Scored in order with no gap (a prefix that arrived computed, as from a remote prefill, has no logits).
            if not request.needs_prompt_logits or request.num_computed_tokens > len(request.prompt_logprobs):
                continue
            first = len(request.prompt_logprobs)
            last = min(request.num_computed_tokens + scheduled.num_new_tokens, request.num_prompt_tokens - 1)
            if first < last:
                offset = start - request.num_computed_tokens  # flattened index of the chunk's position 0
                logits_indices.extend(range(offset + first, offset + last))
                rows.append((request, first, last - first))
        return rows

    def _sample_or_verify(
        self,
        scheduler_output: SchedulerOutput,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        first_row: dict[int, int],
    ) -> ModelRunnerOutput:
        targets = scheduler_output.sampling_requests
        if any(scheduled.draft_token_ids for scheduled in scheduler_output.scheduled):
            return self._verify(scheduler_output, logits, hidden, first_row)
        if len(targets) != logits.shape[0]:  # forked completions sample from their parent's row
            index_tensor = torch.tensor([first_row[index] for index, _ in targets], device=logits.device)
            logits = logits[index_tensor]
            hidden = hidden[index_tensor] if hidden is not None else None
        requests = [request for _, request in targets]
        if hidden is not None:
            self._hidden_states = {request.request_id: hidden[row] for row, request in enumerate(requests)}
        return self._sample(requests, logits)

    def _chunk(self, scheduled: ScheduledRequest) -> SequenceChunk:
        request = scheduled.request
        start = request.num_computed_tokens
        num_known = scheduled.num_new_tokens - len(scheduled.draft_token_ids)
        tokens = request.all_token_ids[start : start + num_known]
        if scheduled.draft_token_ids:
            tokens += scheduled.draft_token_ids
        return SequenceChunk(tokens, start, self.kv_cache.block_ids(request.request_id), scheduled.draft_parents)

    def _verify(
        self,
        scheduler_output: SchedulerOutput,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        first_row: dict[int, int],
    ) -> ModelRunnerOutput:
        """A step with drafts: every sampling request gets its accepted drafts plus one token of the target's
        (rejection sampling). Each draft position is a sampling row of its own whose token history includes
        the drafts before it, so penalties and logits processors see exactly what plain decoding would."""
        requests: list[Request] = []
        drafts: list[tuple[int, ...]] = []
        parents: list[tuple[int, ...] | None] = []
        row_index: list[int] = []  # logits rows, in verification order
        rows: list[SamplingRow] = []
        for index, request in scheduler_output.sampling_requests:
            scheduled = scheduler_output.scheduled[index]
            is_own = request is scheduled.request  # a fork has no drafts
            own = scheduled.draft_token_ids if is_own else ()
            tree = scheduled.draft_parents if is_own else None
            requests.append(request)
            drafts.append(own)
            parents.append(tree)
            row_index.extend(range(first_row[index], first_row[index] + len(own) + 1))
            history = request.output_token_ids
            for j in range(len(own) + 1):
                # Row j follows draft j - 1: its history holds the drafts on the way there (of a tree, its path).
                before = own[:j] if tree is None else [own[node] for node in path(tree, j - 1)]
                seen = [*history, *before] if j else history
                rows.append(SamplingRow(request.request_id, request.params, request.prompt_token_ids, seen,
                                        request.eos_token_ids))  # fmt: skip
        index_tensor = torch.tensor(row_index, device=logits.device)
        logits = logits[index_tensor]
        metadata = SamplingMetadata.from_requests(
            rows, generators=[None] * len(rows), vocab_size=logits.shape[-1], device=logits.device,
            logits_processors=self.logits_processors,
        )  # fmt: skip
        greedy = [request.params.is_greedy for request in requests]
        if all(greedy):
            # One-hot target rows: the sampler's own greedy tokens decide, without building distributions over
            # the vocabulary (0.2-0.3 ms of a verification step on the default model).
            for request, own in zip(requests, drafts, strict=True):
                self._draft_probs(request, len(own))  # spent either way
            verified = verify_greedy(self.sampler(logits, metadata).token_ids.tolist(), drafts, parents)
        else:
            probs = self.sampler.target_probs(logits, metadata)
            generators = [self._generator(request) for request in requests]
            draft_probs = [self._draft_probs(request, len(own)) for request, own in zip(requests, drafts, strict=True)]
            verified = rejection_sample(probs, drafts, draft_probs, greedy, generators, parents)

        wants_logprobs = any(request.params.logprobs is not None for request in requests)
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
        hidden_rows = hidden[index_tensor] if hidden is not None else None
        self._hidden_states = {}
        output = ModelRunnerOutput()
        start = 0
        for request, own, tree, result in zip(requests, drafts, parents, verified, strict=True):
            failed = [metadata.errors[row] for row in range(start, start + len(own) + 1) if row in metadata.errors]
            if failed:
                output.errors[request.request_id] = failed[0]
            else:
                output.sampled_token_ids[request.request_id] = result.token_ids
                # The rows that gave the tokens: the root's, then each accepted draft's.
                token_rows = [start, *(start + node + 1 for node in result.nodes)]
                if raw_logprobs is not None and request.params.logprobs is not None:
                    output.logprobs[request.request_id] = _verified_logprobs(
                        raw_logprobs[token_rows], result.token_ids, request.params.logprobs
                    )
                if hidden_rows is not None:
                    self._hidden_states[request.request_id] = hidden_rows[token_rows[-1]]
                if own and self.draft_policy is not None:
                    self.draft_policy.observe_verification(request.request_id, len(own), result.num_accepted,
                                                           result.nodes if tree is not None else None)  # fmt: skip
            start += len(own) + 1
        return output

    def _draft_probs(self, request: Request, num_drafts: int) -> torch.Tensor | None:
        """The draft distributions of the request's scheduled drafts (the scheduler may have trimmed them)."""
        probs: torch.Tensor | None = request.stash.pop(_DRAFT_PROBS, None)
        return probs[:num_drafts] if probs is not None and num_drafts else None

    def _propose(
        self, speculator: Speculator, scheduler_output: SchedulerOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        """Forget the requests that left, then draft for the requests that decode next step (they got a token this
        step and are still running), as many tokens each as the draft policy allows. Nothing is drafted in a
        step of ``disable_by_batch_size`` requests or more, or for a request that opted out. A speculator that
        raises drafts nothing this step."""
        gone = [output.request_id for output in outputs if output.finish_reason is not None]
        gone += [request.request_id for request in scheduler_output.preempted]
        if gone:
            speculator.on_requests_finished(gone)
            if self.draft_policy is not None:
                self.draft_policy.forget(gone)
        hidden_states, self._hidden_states = self._hidden_states, {}
        cap = self.config.speculative_config.disable_by_batch_size
        if cap and len(scheduler_output.scheduled) >= cap:
            return
        candidates = [
            request for _, request in scheduler_output.sampling_requests
            if request.status == RequestStatus.RUNNING
            and not (request.params.extra_args or {}).get(DISABLE_SPECULATION)
        ]  # fmt: skip
        limits = [min(_max_draft_tokens(request), speculator.num_speculative_tokens) for request in candidates]
        if self.draft_policy is not None:
            num_drafted = sum(len(s.draft_token_ids) for s in scheduler_output.scheduled)
            limits = self.draft_policy.num_drafts(
                [request.request_id for request in candidates], limits,
                scheduler_output.num_scheduled_tokens - num_drafted,
            )  # fmt: skip
        requests = [request for request, limit in zip(candidates, limits, strict=True) if limit > 0]
        inputs = [
            SpeculationInput(request.request_id, request.all_token_ids, request.num_prompt_tokens, limit,
                             hidden_states.get(request.request_id))
            for request, limit in zip(candidates, limits, strict=True) if limit > 0
        ]  # fmt: skip
        if not inputs:
            return
        started = time.perf_counter()
        try:
            proposal = speculator.propose(inputs)
        except Exception:  # a plugin's failure costs this step's drafts, never the engine
            logger.exception("speculator %r failed; drafting nothing this step", speculator.name)
            return
        drafted = {item.request_id for item in inputs}
        if self.draft_policy is not None and drafted <= self._drafted_last_step:
            longest = max((len(t) for t in proposal.token_ids), default=0)
            self.draft_policy.observe_propose(longest, time.perf_counter() - started)
        self._drafted_last_step = drafted
        draft_probs = proposal.draft_probs or [None] * len(requests)
        tree_parents = proposal.parents or [None] * len(requests)
        for request, item, token_ids, probs, parents in zip(
            requests, inputs, proposal.token_ids, draft_probs, tree_parents, strict=True
        ):
            request.stash.pop(_DRAFT_PROBS, None)  # never verify against an earlier step's distributions
            request.spec_token_ids = list(token_ids[: item.max_num_tokens])
            request.spec_parents = None
            if parents is not None and request.spec_token_ids:
                parents = list(parents[: item.max_num_tokens])
                try:
                    if speculator.context is None or not speculator.context.verifies_draft_trees:
                        raise ValueError("this engine verifies chains of drafts only")
                    if probs is not None:
                        raise ValueError("draft trees are deterministic: it gave draft_probs too")
                    check_parents(parents, request.spec_token_ids)
                except ValueError as exc:  # the plugin's bug costs this request's drafts, never the engine
                    logger.error("speculator %r proposed a bad draft tree for %s (%s); drafting nothing for it",
                                 speculator.name, request.request_id, exc)  # fmt: skip
                    request.spec_token_ids = []
                    continue
                request.spec_parents = parents
            if probs is not None and token_ids:
                request.stash[_DRAFT_PROBS] = probs

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> ModelRunnerOutput:
        return self._collect(self._launch_sample(requests, logits))

    def _launch_sample(self, requests: list[Request], logits: torch.Tensor) -> _LaunchedSample:
        """Queue the sampling of one token per request and its copy to the host, without waiting for it."""
        rows = [
            SamplingRow(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids)
            for r in requests
        ]
        metadata = SamplingMetadata.from_requests(
            rows,
            generators=[self._generator(r) for r in requests],
            vocab_size=logits.shape[-1],
            device=logits.device,
            logits_processors=self.logits_processors,
        )
        sampled = self.sampler(logits, metadata)
        host, ready = _copy_to_host(sampled)
        return _LaunchedSample(requests, metadata, sampled.token_ids, host, ready)

    def _collect(self, launched: _LaunchedSample) -> ModelRunnerOutput:
        """Wait for a launched sampling and read its tokens (and logprobs) into a ``ModelRunnerOutput``."""
        if launched.ready is not None:
            launched.ready.synchronize()  # this step's copies only: a step launched after it keeps running
        requests, metadata = launched.requests, launched.metadata
        token_ids = launched.host.token_ids.tolist()
        logprobs = _logprobs_per_row(launched.host, token_ids, requests)
        output = ModelRunnerOutput()
        for row, request in enumerate(requests):
            error = metadata.errors.get(row)
            if error is not None:
                output.errors[request.request_id] = error
                continue
            output.sampled_token_ids[request.request_id] = [token_ids[row]]
            if logprobs[row] is not None:
                output.logprobs[request.request_id] = [logprobs[row]]  # type: ignore[list-item]
        return output

    def _generator(self, request: Request) -> torch.Generator | None:
        """The request's own generator when it has a seed, made on its first draw. Completion i of a seeded
        n > 1 request draws from its own stream, derived from (seed, i)."""
        seed = request.params.seed
        if seed is None:
            return None
        generator = request.stash.get(_GENERATOR)
        if generator is None:
            stream_seed = seed if request.index == 0 else seed * 1_000_003 + request.index
            generator = request.stash[_GENERATOR] = torch.Generator(self.loaded.device).manual_seed(stream_seed)
        return generator


def _copy_to_host(sampled: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
    """The sampler's output copied into pinned host memory without waiting, and an event recorded after the
    copies; on the CPU, the output itself and no event. (``tolist`` on a device tensor would wait for
    everything queued, a step launched after this one included.)"""
    if sampled.token_ids.device.type != "cuda":
        return sampled, None

    def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    token_ids = copy(sampled.token_ids)
    assert token_ids is not None
    host = SamplerOutput(token_ids, copy(sampled.logprobs), copy(sampled.top_token_ids), copy(sampled.top_logprobs))
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _logprobs_per_row(
    sampled: SamplerOutput, token_ids: list[int], requests: list[Request]
) -> list[TokenLogprobs | None]:
    """Each row's logprobs, as its request asked; tensors are turned into Python once per step, not per row."""
    if sampled.logprobs is None:
        return [None] * len(requests)
    logprobs = sampled.logprobs.tolist()
    top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
    top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    rows: list[TokenLogprobs | None] = []
    for row, request in enumerate(requests):
        wanted = request.params.logprobs
        if wanted is None:
            rows.append(None)
            continue
        rows.append(TokenLogprobs(
            token_id=token_ids[row],
            logprob=logprobs[row],
            top_token_ids=tuple(top_ids[row][:wanted]) if top_ids is not None else (),
            top_logprobs=tuple(top_values[row][:wanted]) if top_values is not None else (),
        ))  # fmt: skip
    return rows


def _max_draft_tokens(request: Request) -> int:
    """Drafts a request may verify next step: one step yields up to drafts + 1 tokens, which must not pass
    ``max_tokens``, and the drafts' positions must fit the context window."""
    limit = request.max_model_len - request.num_tokens
    if request.params.max_tokens is not None:
        limit = min(limit, request.params.max_tokens - len(request.output_token_ids) - 1)
    return limit


def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int, int]]) -> dict[str, list[TokenLogprobs]]:
    """Each request's prompt tokens scored by the positions before them (``rows`` as ``_prompt_logits_rows``
    returns them): logprob, rank and the top alternatives."""
    raw = logits.log_softmax(dim=-1)
    targets: list[int] = []
    for request, first, count in rows:
        targets += request.prompt_token_ids[first + 1 : first + 1 + count]
    index = torch.tensor(targets, device=raw.device)
    chosen = raw[torch.arange(len(targets), device=raw.device), index]
    ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
    num_top = max(request.params.prompt_logprobs or 0 for request, _, _ in rows)
    top_values, top_ids = raw.topk(num_top, dim=-1) if num_top else (None, None)
    chosen_list, rank_list = chosen.tolist(), ranks.tolist()
    values = top_values.tolist() if top_values is not None else None
    ids = top_ids.tolist() if top_ids is not None else None
    result: dict[str, list[TokenLogprobs]] = {}
    row = 0
    for request, _, count in rows:
        wanted = request.params.prompt_logprobs or 0
        result[request.request_id] = [
            TokenLogprobs(
                token_id=targets[r], logprob=chosen_list[r],
                top_token_ids=tuple(ids[r][:wanted]) if ids is not None else (),
                top_logprobs=tuple(values[r][:wanted]) if values is not None else (), rank=rank_list[r],
            )
            for r in range(row, row + count)
        ]  # fmt: skip
        row += count
    return result


def _verified_logprobs(raw_logprobs: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """The target's logprobs of each verified token [len(token_ids), vocab] -> one ``TokenLogprobs`` each."""
    index = torch.tensor(token_ids, device=raw_logprobs.device)
    chosen = raw_logprobs[torch.arange(len(token_ids), device=raw_logprobs.device), index].tolist()
    top_values, top_ids = raw_logprobs.topk(num_top, dim=-1) if num_top else (None, None)
    tops = (
        zip(top_ids.tolist(), top_values.tolist(), strict=True)
        if top_ids is not None and top_values is not None
        else [((), ())] * len(token_ids)
    )
    return [
        TokenLogprobs(token_id=token, logprob=value, top_token_ids=tuple(ids), top_logprobs=tuple(values))
        for token, value, (ids, values) in zip(token_ids, chosen, tops, strict=True)
    ]


def kv_fingerprint(config: EngineConfig, loaded: LoadedModel, layout: CacheLayout) -> str:
    """A digest of what the K/V of given tokens depends on besides them: the model's files (path, size and
    modification time of each), dtypes, quantization and the cache's block geometry."""
    arch = loaded.arch
    parts = {
        "model": str(loaded.path),
        "files": sorted(model_file_stats(Path(loaded.path)).items()),
        "dtype": str(loaded.dtype),
        "kv_cache_dtype": str(loaded.kv_cache_dtype),
        "quantization": config.model.quantization,
        "block": [layout.block_size, arch.num_layers, arch.num_kv_heads, arch.head_dim],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def now() -> float:
    """Arrival timestamps: monotonic, so ordering survives clock changes."""
    return time.monotonic()
