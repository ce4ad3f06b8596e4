"""The model executor: everything of a step that touches tensors.

``ModelExecutor.execute`` takes the scheduler's decision for one step and returns what it produced, changing no
request state (vLLM's model runner role)::

    KV tier transfers (write-backs, prefix loads) -> copy-on-write block copies -> batch layout and forward
    (ModelRunner) -> prompt logprobs -> grammar masks -> sampling, or verification of drafts -> ModelRunnerOutput

It owns the model runner (the model and the KV cache tensors), the sampler and logits processors, the token
masks of constrained requests (structured outputs, applied to the logits before sampling), each seeded
request's generator, and the reads and writes of KV blocks to the KV tiers. With async scheduling, ``launch``
and ``collect`` split a step in two so the next one is scheduled while it runs (``tokenmill.step_loop``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.cuda_graphs import cuda_graph_batch_sizes
from tokenmill.device_copy import to_device
from tokenmill.kv_cache.manager import KVCacheManager, KVTransfers
from tokenmill.kv_cache.tier_stack import KVTierStack
from tokenmill.lora.manager import LoRAManager
from tokenmill.memory import CacheLayout, plan_kv_cache
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.parallel.shards import ShardedModelRunner, ShardWorkers
from tokenmill.plugin_manager import PluginSystem
from tokenmill.request import Request
from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow
from tokenmill.sampling.logprobs import prompt_logprobs, sampled_logprobs
from tokenmill.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata
from tokenmill.scheduler import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tokenmill.speculative.proposer import Proposer
from tokenmill.speculative.verification import verify_drafts
from tokenmill.structured_output.bitmask import mask_logits

logger = logging.getLogger(__name__)

_GENERATOR = "generator"  # Request.stash key: the request's own torch.Generator when seeded


def load_runner(
    config: EngineConfig, plugins: PluginSystem, shards: ShardWorkers | None
) -> tuple[ModelRunner, CacheLayout]:
    """Load the model (this process's shard of it), size the KV cache and build the runner over it."""
    loaded = load_model(config, plugins, shards.connect if shards is not None else None)
    arch = loaded.arch
    # kv_cache_memory is what one device holds: each GPU shard's own, but on the CPU, where the shards share one
    # memory, the whole replica's (then each shard allocates its share of every block).
    num_kv_heads = arch.num_kv_heads if loaded.device.type == "cpu" else loaded.num_kv_heads
    layout = plan_kv_cache(
        config.cache, loaded.device, arch.num_layers, num_kv_heads, arch.head_dim, loaded.kv_cache_dtype
    )
    if shards is not None:  # no CUDA graphs across shards yet: every step runs eagerly
        runner: ModelRunner = ShardedModelRunner(loaded, layout.num_blocks, layout.block_size, shards)
    else:
        graph_batch_sizes = cuda_graph_batch_sizes(
            config.device.cuda_graphs and not config.lora.enable_lora,  # adapters run eagerly
            config.device.cuda_graph_batch_sizes, config.scheduler.max_num_seqs,
            loaded.device, loaded.attention, loaded.model,
        )  # fmt: skip
        runner = ModelRunner(loaded, layout.num_blocks, layout.block_size, cuda_graph_batch_sizes=graph_batch_sizes)
    if runner.cuda_graphs is None:  # capturing the graphs ran the model already
        runner.warm_up()
    return runner, layout


@dataclass
class LaunchedStep:
    """A step launched on the device whose tokens are not read yet (async scheduling)."""

    scheduler_output: SchedulerOutput
    requests: list[Request]  # the sampling rows, in order
    metadata: SamplingMetadata
    token_ids: torch.Tensor  # [R] int64 on the device: the step after it reads its input ids here
    host: SamplerOutput  # the sampler's output on the host, valid once ``ready`` has passed
    ready: torch.cuda.Event | None  # recorded after the copies to the host, on a CUDA device
    rows: dict[str, int]  # request id -> its row of ``token_ids``


class ModelExecutor:
    """Runs each step's forward pass and produces its tokens. Built once per engine process."""

    def __init__(
        self,
        runner: ModelRunner,
        kv_cache: KVCacheManager,
        sampler: Sampler,
        logits_processors: list[LogitsProcessor],
        proposer: Proposer | None = None,
        kv_tier_stack: KVTierStack | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.logits_processors = logits_processors
        self.proposer = proposer
        self.kv_tier_stack = kv_tier_stack
        #: With LoRA enabled: puts each step's adapters in slots before its forward.
        self.lora = lora
        #: Steps that ran the model (the engine process sends stats after each, even with no output).
        self.num_steps = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the forward pass over the scheduled tokens and sample (or verify drafts) for every request that
        needs a token. A step of prompt chunks only samples nothing but writes their K/V; an empty step runs
        nothing. Changes no request state."""
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        started = time.perf_counter()
        self.num_steps += 1
        self.transfer_kv(scheduler_output.kv_transfers)
        self.runner.copy_blocks(scheduler_output.block_copies)
        chunks = [self._chunk(s) for s in scheduler_output.scheduled]
        if self.lora is not None:
            self.lora.set_step(scheduler_output.scheduled)
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
        prompt_rows = _prompt_logits_rows(scheduler_output, logits_indices)  # appended after the sampling rows
        hidden = None
        if self.proposer is not None and self.proposer.needs_hidden_states:
            logits, hidden = self.runner.execute_with_hidden(chunks, logits_indices=logits_indices)
            hidden = hidden[:num_sampling_rows]
        else:
            logits = self.runner.execute(chunks, logits_indices=logits_indices)
        scored = prompt_logprobs(logits[num_sampling_rows:], prompt_rows) if prompt_rows else {}
        logits = logits[:num_sampling_rows]
        if not scheduler_output.sampling_requests:
            return ModelRunnerOutput(prompt_logprobs=scored)
        if any(scheduled.draft_token_ids for scheduled in scheduler_output.scheduled):
            assert self.proposer is not None, "drafts come from the proposer"
            output = verify_drafts(scheduler_output, logits, hidden, first_row, self.sampler,
                                   self.logits_processors, self._generator, self.proposer)  # fmt: skip
        else:
            output = self._sample(scheduler_output, logits, hidden, first_row)
        output.prompt_logprobs = scored
        if self.proposer is not None:
            self.proposer.observe_step(scheduler_output, time.perf_counter() - started)
        return output

    def launch(self, scheduler_output: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Queue a decode step on the device without waiting for it: its forward, its sampling and the copy of
        its tokens to the host. Its input ids are read on the device from ``previous``, the step launched
        before it, when there is one (every request then holds a placeholder). ``collect`` reads its tokens."""
        self.num_steps += 1
        self.runner.copy_blocks(scheduler_output.block_copies)
        chunks = [self._chunk(s) for s in scheduler_output.scheduled]
        if self.lora is not None:
            self.lora.set_step(scheduler_output.scheduled)
        input_ids = None
        if previous is not None:
            index = [previous.rows[s.request.request_id] for s in scheduler_output.scheduled]
            input_ids = previous.token_ids
            if index != list(range(len(input_ids))):
                input_ids = input_ids[to_device(index, input_ids.device)]
        logits = self.runner.execute(chunks, input_ids=input_ids)
        requests = [request for _, request in scheduler_output.sampling_requests]
        metadata = self._sampling_metadata(requests, logits)
        sampled = self.sampler(logits, metadata)
        host, ready = _copy_to_host(sampled)
        rows = {request.request_id: row for row, request in enumerate(requests)}
        return LaunchedStep(scheduler_output, requests, metadata, sampled.token_ids, host, ready, rows)

    def collect(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step and read its tokens (and logprobs)."""
        if launched.ready is not None:
            launched.ready.synchronize()  # this step's copies only: a step launched after it keeps running
        return _sampled_output(launched.requests, launched.metadata, launched.host)

    def transfer_kv(self, transfers: KVTransfers) -> None:
        """Move blocks between the device cache and the KV tiers, as the KV cache manager queued them: blocks to
        store are read first (before a load, a copy or the forward overwrites them), then loaded blocks are
        written. Called before each forward, and after each update for the blocks of requests that left."""
        if transfers.stores:
            blocks = self.runner.read_blocks([block_id for block_id, _ in transfers.stores])
            self.kv_cache.store_blocks([(h, b) for (_, h), b in zip(transfers.stores, blocks, strict=True)])
        if transfers.loads:
            self.runner.write_blocks(transfers.loads)
            assert self.kv_tier_stack is not None, "loads come from the KV tiers"
            self.kv_tier_stack.loads_written()

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        first_row: dict[int, int],
    ) -> ModelRunnerOutput:
        """One token for each sampling request of a step without drafts."""
        targets = scheduler_output.sampling_requests
        if len(targets) != logits.shape[0]:  # forked completions sample from their parent's row
            index_tensor = torch.tensor([first_row[index] for index, _ in targets], device=logits.device)
            logits = logits[index_tensor]
            hidden = hidden[index_tensor] if hidden is not None else None
        requests = [request for _, request in targets]
        logits = mask_logits(logits, requests)  # structured outputs: what each grammar allows
        metadata = self._sampling_metadata(requests, logits)
        output = _sampled_output(requests, metadata, self.sampler(logits, metadata))
        if hidden is not None:
            output.hidden_states = {request.request_id: hidden[row] for row, request in enumerate(requests)}
        return output

    def _sampling_metadata(self, requests: list[Request], logits: torch.Tensor) -> SamplingMetadata:
        rows = [
            SamplingRow(r.request_id, r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids)
            for r in requests
        ]
        return SamplingMetadata.from_requests(
            rows,
            generators=[self._generator(r) for r in requests],
            vocab_size=logits.shape[-1],
            device=logits.device,
            logits_processors=self.logits_processors,
        )

    def _chunk(self, scheduled: ScheduledRequest) -> SequenceChunk:
        request = scheduled.request
        start = request.num_computed_tokens
        num_known = scheduled.num_new_tokens - len(scheduled.draft_token_ids)
        tokens = request.all_token_ids[start : start + num_known]
        if scheduled.draft_token_ids:
            tokens += scheduled.draft_token_ids
        return SequenceChunk(tokens, start, self.kv_cache.block_ids(request.request_id), scheduled.draft_parents)

    def _generator(self, request: Request) -> torch.Generator | None:
        """The request's own generator when it has a seed, made on its first draw. Completion i of a seeded
        n > 1 request draws from its own stream, derived from (seed, i)."""
        seed = request.params.seed
        if seed is None:
            return None
        generator = request.stash.get(_GENERATOR)
        if generator is None:
            stream_seed = seed if request.index == 0 else seed * 1_000_003 + request.index
            device = self.runner.loaded.device
            generator = request.stash[_GENERATOR] = torch.Generator(device).manual_seed(stream_seed)
        return generator


def _sampled_output(requests: list[Request], metadata: SamplingMetadata, sampled: SamplerOutput) -> ModelRunnerOutput:
    """One sampled token (and its logprobs) per request, or the error a logits processor raised for it."""
    token_ids = sampled.token_ids.tolist()
    logprobs = sampled_logprobs(sampled, token_ids, requests)
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


def _prompt_logits_rows(scheduler_output: SchedulerOutput, logits_indices: list[int]) -> list[tuple[Request, int, int]]:
    """For requests that asked for prompt logprobs: append to ``logits_indices`` the rows of this step's prompt
    positions not yet scored (position p scores prompt token p + 1); returns (request, first position, number
    of rows) for each, in the order appended."""
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
