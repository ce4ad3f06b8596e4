"""``EngineCore``: the engine loop. Requests in, token deltas out, no I/O.

Every component is the implementation the config names for its slot, built through the plugin system: the
KV cache manager and its KV tiers, the scheduler, the sampler and the logits processors, the speculator
(plus, inside the model loader, the architecture, weight format, quantizer and attention backend). This
module only wires them together; each ``step`` is three calls (docs/engine.md)::

    scheduler_output = loop.schedule()                            # Scheduler: which requests, how many tokens
    runner_output = loop.execute(scheduler_output)                # ModelExecutor: forward, sampling, drafts
    outputs = loop.update(scheduler_output, runner_output)        # Scheduler: tokens appended, stops, frees

The loop variant (``tokenmill.step_loop``: synchronous, with KV tiers and disaggregated prefill, or with async
scheduling) is chosen once, here. The same object runs in-process (offline ``LLM``) and, behind a transport,
inside an engine process.
"""

from __future__ import annotations

import logging
import time

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.executor import ModelExecutor, load_runner
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.kv_cache.tier import KVTier
from tokenmill.kv_cache.tier_stack import build_tier_stack, kv_fingerprint, load_tier_classes
from tokenmill.lora.manager import LoRAManager, build_lora_manager, with_adapter
from tokenmill.messages import EngineCoreOutput, EngineCoreRequest, EngineStatsMessage
from tokenmill.model_loader import LoadedModel
from tokenmill.parallel.shards import ShardWorkers
from tokenmill.plugin_manager import FRONT_END_SLOTS, PluginSystem, Slot, resolve_plugins, slot_selections
from tokenmill.request import Request
from tokenmill.sampling.logits_processor import LogitsProcessor
from tokenmill.sampling.sampler import Sampler
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.scheduler import Scheduler
from tokenmill.speculative.proposer import build_proposer
from tokenmill.step_loop import AsyncSchedulingLoop, KVTierLoop, SyncLoop, uses_async_scheduling
from tokenmill.structured_output.manager import build_structured_outputs

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, plugins: PluginSystem | None = None) -> None:
        self.config = config
        self.plugins = plugins if plugins is not None else resolve_plugins(config, skip=FRONT_END_SLOTS)
        tier_classes = load_tier_classes(config, self.plugins)  # a bad entry fails before loading
        #: The worker processes of shards 1..N-1 with tensor parallelism (this process runs shard 0).
        self.shards = ShardWorkers(config) if config.parallel.tensor_parallel_size > 1 else None
        try:
            runner, self.layout = load_runner(config, self.plugins, self.shards)
        except BaseException:
            if self.shards is not None:
                self.shards.stop()
            raise
        self.loaded: LoadedModel = runner.loaded
        self.max_model_len = self.loaded.max_model_len
        self.vocab_size = self.loaded.arch.vocab_size
        #: With ``lora.enable_lora``: the adapters, in host memory and in the model's slots.
        self.lora: LoRAManager | None = build_lora_manager(config, self.plugins, self.loaded)
        #: Salts every prefix-cache block hash with what the K/V of the same tokens depends on.
        self.kv_cache_hash_salt = kv_fingerprint(config, self.loaded, self.layout)
        self.kv_tier_stack = build_tier_stack(config, self.plugins, tier_classes, self.kv_cache_hash_salt)
        self.kv_cache: KVCacheManager = self.plugins.create(
            Slot.KV_CACHE_MANAGER, config.cache.kv_cache_manager, self.layout.num_blocks, self.layout.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching, hash_salt=self.kv_cache_hash_salt,
            **({"tiers": self.kv_tier_stack} if self.kv_tier_stack else {}),
        )  # fmt: skip
        self.scheduler: Scheduler = self.plugins.create(
            Slot.SCHEDULER, config.scheduler.policy, self.kv_cache,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            max_num_seqs=config.scheduler.max_num_seqs,
            **({"max_loras": config.lora.max_loras} if self.lora is not None else {}),
        )  # fmt: skip
        sampler: Sampler = self.plugins.create(Slot.SAMPLER, config.sampler.sampler)
        _, processor_names = slot_selections(config)[Slot.LOGITS_PROCESSOR]
        processors: list[LogitsProcessor] = [self.plugins.create(Slot.LOGITS_PROCESSOR, n) for n in processor_names]
        proposer = build_proposer(config, sampler, self.loaded, self.plugins, self.layout)
        self.executor = ModelExecutor(
            runner, self.kv_cache, sampler, processors, proposer, self.kv_tier_stack or None, self.lora
        )
        self.loop = self._choose_loop()
        #: Compiles requests' constraints (structured outputs) off the loop.
        self.structured_outputs = build_structured_outputs(config, self.plugins, self.vocab_size)

    @property
    def kv_tiers(self) -> list[KVTier]:
        """The KV tiers below the device cache, nearest first."""
        return self.kv_tier_stack.tiers

    def _choose_loop(self) -> SyncLoop:
        """The loop variant, once: with KV tiers, with async scheduling when nothing rules it out, else plain."""
        if self.kv_tier_stack:
            return KVTierLoop(self.scheduler, self.executor, self._enqueue, self.layout.block_size,
                              self.kv_cache_hash_salt)  # fmt: skip
        blockers = {
            "speculative decoding": self.executor.proposer is not None,
            "tensor parallelism": self.shards is not None,
        }
        if uses_async_scheduling(self.config, self.scheduler, blockers):
            return AsyncSchedulingLoop(self.scheduler, self.executor)
        return SyncLoop(self.scheduler, self.executor)

    def close(self) -> None:
        """Flush the KV tiers' pending writes and release them, and stop the tensor-parallel workers; once,
        when the engine stops."""
        self.structured_outputs.close()
        self.kv_tier_stack.close()
        if self.shards is not None:
            self.shards.stop()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report what changed (token deltas)."""
        scheduler_output = self.loop.schedule()
        runner_output = self.loop.execute(scheduler_output)
        return self.loop.update(scheduler_output, runner_output)

    # ------------------------------------------------------------------ requests

    def add_request(self, message: EngineCoreRequest) -> None:
        """Queue a request. Raises ``InvalidRequestError`` (and queues nothing) when it can never run."""
        self.check_prompt(message.prompt_token_ids)
        bad = next((t for t in message.params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        message = with_adapter(self.lora, message)
        if not self.loop.hold(message):
            self._enqueue(message)

    def _enqueue(self, message: EngineCoreRequest) -> None:
        constraint = message.params.structured_outputs
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
                lora_request=message.lora_request,
                lora_load=self.lora.load_adapter(message.lora_request)
                if self.lora is not None and message.lora_request is not None
                else None,
                structured_output=(
                    self.structured_outputs.request(constraint, message.prompt_token_ids)
                    if constraint is not None
                    else None
                ),
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

    def abort_requests(self, request_ids: list[str], completions_only: bool = False) -> list[EngineCoreOutput]:
        """Finish these requests now and free their blocks: all n completions of each (client gone), or with
        ``completions_only`` just the completions named (a stop string matched)."""
        return self.loop.abort(request_ids, completions_only)

    def has_unfinished_requests(self) -> bool:
        # A step in flight holds running requests, or only finished ones (aborted): nothing left to do for those.
        return self.scheduler.has_unfinished_requests() or self.loop.num_held > 0

    @property
    def only_waiting_for_kv(self) -> bool:
        """Whether all there is to do is wait for disaggregated requests' blocks (nothing to compute yet)."""
        return self.loop.num_held > 0 and not self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ stats

    @property
    def num_steps(self) -> int:
        """Steps that ran the model (the engine process sends stats after each, even with no output)."""
        return self.executor.num_steps

    def stats(self) -> EngineStatsMessage:
        """A snapshot for metrics and routers; cheap to take every step. The prefix cache's changes are not in
        it: the engine process takes them (``take_prefix_cache_delta``) for each connection's summary."""
        touched = self.kv_cache.num_touched_blocks
        touched_bytes = (self.layout.num_blocks if touched is None else touched) * self.layout.bytes_per_block
        return msgspec.structs.replace(
            self.scheduler.stats(), kv_cache_touched_bytes=touched_bytes, kv_tiers=self.kv_tier_stack.stats()
        )

    def take_prefix_cache_delta(self) -> tuple[list[bytes], list[bytes]]:
        """The block hashes the device prefix cache gained and lost since the last call (net)."""
        return self.kv_cache.take_prefix_cache_delta()


def now() -> float:
    """Arrival timestamps: monotonic, so ordering survives clock changes."""
    return time.monotonic()
