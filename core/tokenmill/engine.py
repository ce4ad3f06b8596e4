"""``EngineCore``: the engine loop. Requests in, token deltas out, no I/O.

Every component is the implementation the config names for its slot, built
through the plugin system: the KV cache manager, the scheduler, the sampler
and the logits processors (plus, inside the model loader, the architecture,
weight format, quantizer and attention backend). Each ``step`` is three calls::

    scheduler_output = scheduler.schedule()
    runner_output = self.execute(scheduler_output)       # model runner, logits processors, sampler
    outputs = scheduler.update_from_output(scheduler_output, runner_output)

The scheduler owns everything that changes a request's state; this module
only turns a schedule into a forward pass and sampled tokens. The same object
runs in-process (offline ``LLM``) and, behind a transport, inside an engine
process.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.config.cache import kv_tier_spec
from tokenmill.cuda_graphs import cuda_graph_batch_sizes
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.kv_cache.tier import KVTier
from tokenmill.memory import CacheLayout, plan_kv_cache
from tokenmill.messages import EngineCoreOutput, EngineCoreRequest, EngineStatsMessage, TokenLogprobs
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.plugin_manager import FRONT_END_SLOTS, PluginSystem, Slot, resolve_plugins, slot_selections
from tokenmill.request import Request
from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow
from tokenmill.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.scheduler import ModelRunnerOutput, ScheduledRequest, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

_GENERATOR = "generator"  # Request.stash key: the request's own torch.Generator when seeded


class EngineCore:
    def __init__(self, config: EngineConfig, plugins: PluginSystem | None = None) -> None:
        self.config = config
        self.plugins = plugins if plugins is not None else resolve_plugins(config, skip=FRONT_END_SLOTS)
        self.loaded: LoadedModel = load_model(config, self.plugins)
        arch = self.loaded.arch
        self.layout: CacheLayout = plan_kv_cache(
            config.cache, self.loaded.device, arch.num_layers, arch.num_kv_heads, arch.head_dim,
            self.loaded.kv_cache_dtype,
        )  # fmt: skip
        graph_batch_sizes = cuda_graph_batch_sizes(
            config.device.cuda_graphs, config.device.cuda_graph_batch_sizes, config.scheduler.max_num_seqs,
            self.loaded.device, self.loaded.attention,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.loaded, self.layout.num_blocks, self.layout.block_size, cuda_graph_batch_sizes=graph_batch_sizes
        )
        #: Salts every prefix-cache block hash: anything that changes the K/V values of the same tokens.
        self.kv_cache_hash_salt = f"{self.loaded.path}:{self.loaded.dtype}:{self.loaded.kv_cache_dtype}"
        self.kv_tiers: list[KVTier] = []
        for entry in config.cache.kv_tiers:
            name, capacity_bytes = kv_tier_spec(entry)
            self.kv_tiers.append(self.plugins.create(Slot.KV_TIER, name, capacity_bytes=capacity_bytes))
        self.kv_cache: KVCacheManager = self.plugins.create(
            Slot.KV_CACHE_MANAGER, config.cache.kv_cache_manager, self.layout.num_blocks, self.layout.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching, hash_salt=self.kv_cache_hash_salt,
            **({"tiers": self.kv_tiers} if self.kv_tiers else {}),
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
        self.max_model_len = self.loaded.max_model_len
        self.vocab_size = arch.vocab_size

    # ------------------------------------------------------------------ requests

    def add_request(self, message: EngineCoreRequest) -> None:
        """Queue a request. Raises ``InvalidRequestError`` (and queues nothing) when it can never run."""
        self.check_prompt(message.prompt_token_ids)
        bad = next((t for t in message.params.logit_bias or () if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
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

    def abort_requests(self, request_ids: list[str], completions_only: bool = False) -> list[EngineCoreOutput]:
        """Finish these requests now and free their blocks: all n completions of each (client gone), or with
        ``completions_only`` just the completions named (a stop string matched)."""
        return self.scheduler.abort_requests(request_ids, completions_only)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStatsMessage:
        """A snapshot for metrics and routers; cheap to take every step."""
        return self.scheduler.stats()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, sample, and report what changed."""
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return []
        runner_output = self.execute(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the forward pass over the scheduled tokens and sample for every request that needs a token.

        The forward always runs: a step of prompt chunks only samples nothing but writes their K/V.
        Changes no request state."""
        transfers = scheduler_output.kv_transfers
        if transfers:
            # Evicted blocks are read before anything (a load, a copy, the forward) overwrites them.
            if transfers.stores:
                blocks = self.runner.read_blocks([block_id for block_id, _ in transfers.stores])
                self.kv_cache.store_evicted([(h, b) for (_, h), b in zip(transfers.stores, blocks, strict=True)])
            if transfers.loads:
                self.runner.write_blocks(transfers.loads)
        self.runner.copy_blocks(scheduler_output.block_copies)
        chunks = [self._chunk(s) for s in scheduler_output.scheduled]
        logits_indices = [i for i, s in enumerate(scheduler_output.scheduled) if s.samples_token]
        logits = self.runner.execute(chunks, logits_indices=logits_indices)
        targets = scheduler_output.sampling_requests
        if not targets:
            return ModelRunnerOutput()
        if len(targets) != len(logits_indices):  # forked completions sample from their parent's row
            row_of = {index: row for row, index in enumerate(logits_indices)}
            logits = logits[torch.tensor([row_of[index] for index, _ in targets], device=logits.device)]
        return self._sample([request for _, request in targets], logits)

    def _chunk(self, scheduled: ScheduledRequest) -> SequenceChunk:
        request = scheduled.request
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start : start + scheduled.num_new_tokens]
        return SequenceChunk(tokens, start, self.kv_cache.block_ids(request.request_id))

    def _sample(self, requests: list[Request], logits: torch.Tensor) -> ModelRunnerOutput:
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
        token_ids = sampled.token_ids.tolist()
        logprobs = _logprobs_per_row(sampled, token_ids, requests)
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


def now() -> float:
    """Arrival timestamps: monotonic, so ordering survives clock changes."""
    return time.monotonic()
