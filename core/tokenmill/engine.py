"""``EngineCore``: the engine loop. Requests in, token deltas out, no I/O.

Each ``step`` schedules a batch, runs the model once over it, samples a token
for every request that finished reading its known tokens, and applies
token-level stopping. The same object runs in-process (offline ``LLM``) and,
behind a transport, inside an engine process.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.cuda_graphs import cuda_graph_batch_sizes
from tokenmill.kv_cache.manager import KVCacheManager
from tokenmill.memory import CacheLayout, plan_kv_cache
from tokenmill.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStatsMessage,
    TokenLogprobs,
    completion_request_id,
)
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.plugin_manager import PluginSystem
from tokenmill.request import Request
from tokenmill.sampler import Sampler, SamplerOutput, SamplingMetadata
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.scheduler import ScheduledRequest, Scheduler

logger = logging.getLogger(__name__)

_GENERATOR = "generator"  # Request.stash key: the request's own torch.Generator when seeded


class EngineCore:
    def __init__(self, config: EngineConfig, plugins: PluginSystem | None = None) -> None:
        self.config = config
        self.loaded: LoadedModel = load_model(config, plugins)
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
        self.kv_cache = KVCacheManager(
            self.layout.num_blocks,
            self.layout.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            hash_salt=f"{self.loaded.path}:{self.loaded.dtype}:{self.loaded.kv_cache_dtype}",
        )
        self.scheduler = Scheduler(
            self.kv_cache, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs
        )
        self.sampler = Sampler()
        self.max_model_len = self.loaded.max_model_len
        self.vocab_size = arch.vocab_size
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, message: EngineCoreRequest) -> None:
        """Queue a request. Raises ``InvalidRequestError`` (and queues nothing) when it can never run."""
        if message.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {message.request_id!r} is already in use")
        prompt = message.prompt_token_ids
        self.check_prompt(prompt)
        request = Request(
            request_id=message.request_id,
            prompt_token_ids=list(prompt),
            params=message.params,
            eos_token_ids=tuple(message.eos_token_ids),
            max_model_len=self.max_model_len,
            arrival_time=message.arrival_time,
            priority=message.priority,
            cache_salt=message.cache_salt,
            enqueued_at=time.monotonic(),
        )
        if message.params.seed is not None:
            request.stash[_GENERATOR] = torch.Generator(self.loaded.device).manual_seed(message.params.seed)
        self.scheduler.add_request(request)

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

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Finish these requests now (client gone, stop string matched); frees their blocks."""
        outputs = []
        for request_id in request_ids:
            request = self.scheduler.abort_request(request_id)
            if request is not None:
                outputs.append(self._output(request, [], None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStatsMessage:
        """A snapshot for metrics; cheap to take every step."""
        return EngineStatsMessage(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
        )

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, sample, and report what changed."""
        schedule = self.scheduler.schedule()
        if not schedule.scheduled:
            return []
        self.runner.copy_blocks(schedule.block_copies)
        started = time.monotonic()
        for scheduled in schedule.scheduled:
            if scheduled.request.queue_time is None:
                scheduled.request.queue_time = started - scheduled.request.enqueued_at
        chunks = [self._chunk(s) for s in schedule.scheduled]
        sampling = [i for i, s in enumerate(schedule.scheduled) if s.samples_token]
        # The forward always runs: a step of prompt chunks only samples nothing but writes their K/V.
        logits = self.runner.execute(chunks, logits_indices=sampling)
        for scheduled in schedule.scheduled:
            self.scheduler.finish_computed(scheduled)
        if not sampling:
            return []
        rows = [schedule.scheduled[i].request for i in sampling]
        return self._sample_and_update(rows, logits)

    def _chunk(self, scheduled: ScheduledRequest) -> SequenceChunk:
        request = scheduled.request
        start = request.num_computed_tokens
        tokens = request.all_token_ids[start : start + scheduled.num_new_tokens]
        return SequenceChunk(tokens, start, self.kv_cache.block_ids(request.request_id))

    def _sample_and_update(self, requests: list[Request], logits: torch.Tensor) -> list[EngineCoreOutput]:
        # A request with n > 1 forks its other completions now, before its first token: they share
        # its blocks and sample their own first tokens from the same logits row.
        targets: list[Request] = []
        logits_rows: list[int] = []
        for row, request in enumerate(requests):
            group = [request]
            if request.params.n > 1 and request.parent_id is None and not request.output_token_ids:
                group += [self._fork(request, index) for index in range(1, request.params.n)]
            targets += group
            logits_rows += [row] * len(group)
        if len(targets) != len(requests):
            logits = logits[torch.tensor(logits_rows, device=logits.device)]
        metadata = SamplingMetadata.from_requests(
            params=[t.params for t in targets],
            prompt_token_ids=[t.prompt_token_ids for t in targets],
            output_token_ids=[t.output_token_ids for t in targets],
            generators=[t.stash.get(_GENERATOR) for t in targets],
            banned_token_ids=[self._banned_tokens(t) for t in targets],
            vocab_size=logits.shape[-1],
            device=logits.device,
        )
        sampled = self.sampler(logits, metadata)
        token_ids = sampled.token_ids.tolist()
        logprobs = _logprobs_per_row(sampled, token_ids, targets)
        return [self._append(target, token_ids[row], logprobs[row]) for row, target in enumerate(targets)]

    def _fork(self, parent: Request, index: int) -> Request:
        child = Request(
            request_id=completion_request_id(parent.request_id, index),
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params,
            eos_token_ids=parent.eos_token_ids,
            max_model_len=parent.max_model_len,
            arrival_time=parent.arrival_time,
            priority=parent.priority,
            cache_salt=parent.cache_salt,
            parent_id=parent.request_id,
            index=index,
            num_computed_tokens=parent.num_computed_tokens,
            num_cached_tokens=parent.num_cached_tokens,
        )
        if parent.params.seed is not None:
            # Completion i of a seeded request draws from its own stream, derived from (seed, i).
            child_seed = parent.params.seed * 1_000_003 + index
            child.stash[_GENERATOR] = torch.Generator(self.loaded.device).manual_seed(child_seed)
        self.kv_cache.fork(parent.request_id, child.request_id)
        self.scheduler.add_running(child)
        return child

    def _banned_tokens(self, request: Request) -> list[int]:
        if len(request.output_token_ids) >= request.params.min_tokens:
            return []
        return [*request.eos_token_ids, *request.params.stop_token_ids]

    def _append(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> EngineCoreOutput:
        request.append_token(token_id, logprobs)
        self._num_generation_tokens += 1
        if len(request.output_token_ids) == 1 and request.parent_id is None:
            self._num_prompt_tokens += request.num_prompt_tokens
        status = request.check_stop()
        if status is not None:
            self.scheduler.finish(request, status)
        return self._output(request, [token_id], [logprobs] if logprobs is not None else None)

    @staticmethod
    def _output(request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_logprobs=logprobs,
            finish_reason=request.status.finish_reason,
            parent_id=request.parent_id,
            index=request.index,
            num_cached_tokens=request.num_cached_tokens,
            # Reported once, with the first token, for the queue-time metric.
            queue_time=request.queue_time if len(request.output_token_ids) == 1 and token_ids else None,
        )


def _logprobs_per_row(
    sampled: SamplerOutput, token_ids: list[int], targets: list[Request]
) -> list[TokenLogprobs | None]:
    """Each row's logprobs, as its request asked; tensors are turned into Python once per step, not per row."""
    if sampled.logprobs is None:
        return [None] * len(targets)
    logprobs = sampled.logprobs.tolist()
    top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
    top_values = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    rows: list[TokenLogprobs | None] = []
    for row, target in enumerate(targets):
        wanted = target.params.logprobs
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
