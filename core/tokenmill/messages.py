"""Every message that crosses a process boundary, and nothing else.

``array_like`` makes field order the wire format: add new fields at the end
with defaults, never reorder, and bump ``PROTOCOL_VERSION`` for a breaking change.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
#: Bytes of a block hash that the prefix cache summary in ``EngineStatsMessage`` carries per block.
PREFIX_KEY_SIZE = 8


def completion_request_id(request_id: str, index: int) -> str:
    """The engine's id for completion ``index`` of an ``n > 1`` request (completion 0 keeps the request's id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class TokenLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The sampled token's logprob and the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    #: The token's rank in the distribution (1: the most likely); set for prompt tokens, 0 otherwise.
    rank: int = 0


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False, tag=True):
    """A new request, sent once from the front end to the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    #: Disaggregated prefill (vLLM's names): ``{"do_remote_decode": true}`` on the prefill engine's request,
    #: ``{"do_remote_prefill": true}`` on the decode engine's, which waits for the prompt's blocks to arrive.
    kv_transfer_params: dict[str, Any] | None = None
    #: The LoRA adapter the request runs with (None: the base model); the engine adds it to the prefix-cache salt.
    lora_request: LoRARequest | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: only the new tokens (a delta)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    parent_id: str | None = None  # set on completions 1..n-1 of an n > 1 request
    index: int = 0
    num_cached_tokens: int = 0
    #: Why the engine refused the request (it is then finished with "abort").
    error: str | None = None
    #: Seconds the request waited in the engine before its first step; on its first output only.
    queue_time: float | None = None
    #: True on the last output of a request: this completion and, for n > 1, all its siblings finished.
    request_finished: bool = False
    #: With ``params.prompt_logprobs``, on the request's first output: prompt tokens 1.. (token 0 has none).
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AbortRequests(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """Front end -> engine: finish these requests now: all n completions of each (client gone), or with
    ``completions_only`` just the completions named (a stop string matched)."""

    request_ids: list[str]
    completions_only: bool = False


class Hello(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """Front end -> engine, first message on a connection: the handshake. Sent again on a live connection, it
    asks for a full snapshot of the prefix cache summary (``EngineStatsMessage.prefix_cache_reset``)."""

    protocol_version: int


class KVTierStatsMessage(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One KV tier's counters (``tokenmill.kv_cache.tier.KVTierStats``), by the tier's position in ``kv_tiers``."""

    name: str
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    rejected: int
    errors: int
    loads: int = 0
    load_seconds: float = 0.0


class EngineStatsMessage(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An engine's counters and gauges, sent with every output batch and heartbeat."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    #: Speculative decoding counters (vLLM's spec_decode_* metrics); zero without a speculator.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    #: KV tiers, nearest first; empty without tiers.
    kv_tiers: list[KVTierStatsMessage] = msgspec.field(default_factory=list)
    #: Messages the engine's endpoint dropped instead of serving, by reason (``malformed``: not a message of
    #: the engine's types; ``oversized``: over ``transport.max_message_size``; ``multipart``: not one frame).
    num_dropped_messages: dict[str, int] = msgspec.field(default_factory=dict)
    #: Connections refused during the transport's handshake (CURVE: an unknown key, or no CURVE at all).
    num_refused_connections: int = 0
    #: Work left in the engine, in tokens: over its running and waiting requests, prompt tokens not computed
    #: yet plus tokens still to generate (``max_tokens``, or up to the context window, less those generated).
    num_outstanding_tokens: int = 0
    #: KV blocks an allocation can take now (free, plus cached ones not in use); routers' KV headroom.
    num_free_kv_blocks: int = 0
    #: Bytes of the KV cache handed out at least once since start: on a CPU, about the cache's share of the
    #: engine's RSS (its pages are mapped as blocks are first written).
    kv_cache_touched_bytes: int = 0
    #: The prefix cache's contents as deltas, per connection (vLLM's KV events, compacted): the first 8 bytes
    #: (``PREFIX_KEY_SIZE``) of each block hash the cache gained (``prefix_cache_added``) or lost
    #: (``prefix_cache_removed``) since the last message to this front end, concatenated. With
    #: ``prefix_cache_reset`` the message instead carries every hash the cache holds (after a ``Hello``).
    #: ``prefix_cache_seq`` counts the messages sent on the connection, so a receiver sees a gap (a dropped
    #: message) and asks for a full snapshot again with a ``Hello``.
    prefix_cache_seq: int = 0
    prefix_cache_reset: bool = False
    prefix_cache_added: bytes = b""
    prefix_cache_removed: bytes = b""
    #: With LoRA: the adapters (``lora_name``) of the running and of the waiting requests, each once, in order of
    #: first appearance (vLLM's ``running_lora_adapters``/``waiting_lora_adapters``), and ``lora.max_loras``.
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    max_loras: int = 0


class Ready(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """Engine -> front end, answering ``Hello``: what the engine serves."""

    protocol_version: int
    model_path: str
    max_model_len: int
    max_num_seqs: int
    error: str | None = None  # set when the handshake is refused (protocol mismatch)
    #: How the engine's prefix cache hashes blocks, so routers can compute the same hashes.
    block_size: int = 16
    hash_salt: str = ""


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Engine -> front end, after each step and as a heartbeat when idle."""

    outputs: list[EngineCoreOutput]
    stats: EngineStatsMessage


#: What the front end sends to an engine, and what an engine sends back.
ToEngine = EngineCoreRequest | AbortRequests | Hello
FromEngine = EngineCoreOutputs | Ready


# Rank 0 of a tensor-parallel replica (the engine) -> each other shard's worker process, over its stdin.


class ShardStart(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """The worker's first message: what to load and how to join the shards."""

    config: dict[str, Any]  # the resolved EngineConfig as builtins
    rank: int
    store_host: str
    store_port: int


class ShardSetup(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """Once the model is loaded: the KV cache's size, as rank 0 planned it (every shard holds the same block ids)."""

    num_blocks: int
    block_size: int


class ShardChunk(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One request's share of a step (``tokenmill.step_batch.SequenceChunk``)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    draft_parents: tuple[int, ...] | None = None  # a draft tree's parents (``SequenceChunk.draft_parents``)


class ShardStep(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False, tag=True):
    """Run the forward of one step, as rank 0 does (``ModelRunner.execute``); once per step."""

    chunks: list[ShardChunk]
    logits_indices: list[int] | None = None
    all_logits: bool = False


class ShardCopyBlocks(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """Copy-on-write of KV blocks (src, dst), before the next step's forward."""

    copies: list[tuple[int, int]]


class ShardStop(msgspec.Struct, array_like=True, frozen=True, gc=False, tag=True):
    """The engine is closing: exit."""


ToShard = ShardStart | ShardSetup | ShardStep | ShardCopyBlocks | ShardStop
