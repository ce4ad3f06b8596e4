"""The API server and the engines behind it."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from tokenmill.config.base import ConfigSection, NonNegativeInt, PositiveInt, describe

#: ``backend``'s default: engine processes on this host, started by the core itself (no engine backend plugin).
LOCAL_BACKEND = "local"


class ServerConfig(ConfigSection, frozen=True):
    host: Annotated[str, describe("Address the HTTP server listens on.")] = "127.0.0.1"
    port: Annotated[Annotated[int, msgspec.Meta(ge=0, le=65535)], describe("HTTP port (0 picks a free one).")] = 8000
    api_key: Annotated[
        str | None, describe("When set, requests must send `Authorization: Bearer <key>` (else 401).")
    ] = None
    api_keys: Annotated[
        str | None,
        describe(
            "A file of API keys, one entry per key (key, tenant, optional requests_per_minute, tokens_per_minute, "
            "max_concurrent_requests): TOML `[[keys]]` tables when it ends in .toml, else JSON lines. Requests "
            "must send one of them (or api_key's, tenant 'default'), else 401; a key over a limit gets 429 with "
            "Retry-After. Usage is counted per tenant in /metrics (docs/serving.md#tenants)."
        ),
    ] = None
    tenant_prefix_caching: Annotated[
        Literal["isolated", "shared"],
        describe(
            "With api_keys: 'isolated' salts each tenant's prefix cache apart, so one tenant's cached prefix never "
            "shortens another's time to first token (which would tell it what others sent); 'shared' lets tenants "
            "hit each other's cached prefixes (faster, and that side channel open)."
        ),
    ] = "isolated"
    public_metrics: Annotated[
        bool,
        describe("Serve /metrics without the API key (Prometheus scrapers rarely carry one); /health always is."),
    ] = True
    max_request_body: Annotated[
        Annotated[int, msgspec.Meta(gt=0)],
        describe("Largest request body accepted, in bytes; a larger one gets 413 before it is read in full."),
    ] = 16 * 2**20
    served_model_name: Annotated[
        str | None, describe("Model name clients use; unset uses the model file or folder name.")
    ] = None
    default_chat_template_kwargs: Annotated[
        dict[str, Any],
        describe(
            "Variables every chat request's template sees, as a JSON object (vLLM's flag), e.g. "
            "'{\"enable_thinking\": false}' for Qwen3's templates; a request's chat_template_kwargs override "
            "them key by key. Not messages, tools, documents, add_generation_prompt, chat_template or tokenize.",
            flag="--default-chat-template-kwargs",
        ),
    ] = msgspec.field(default_factory=dict)
    max_waiting: Annotated[
        Annotated[int, msgspec.Meta(ge=0)],
        describe("Requests allowed to wait beyond those running; more get 429."),
    ] = 256
    data_parallel_size: Annotated[
        PositiveInt,
        describe("Engines to start, each a full model replica: processes on this host, or placed by backend."),
    ] = 1
    backend: Annotated[
        str,
        describe(
            "Where the data_parallel_size engines run: 'local' starts them as processes on this host; any other "
            "name is an engine backend plugin: 'ray' (first-party plugin ray_backend) places them as actors on a "
            "Ray cluster (ray_address), each serving ZeroMQ tcp:// with CURVE keys, and Ray restarts one that "
            "dies (`pip install tokenmill[ray]`; docs/deployment.md)."
        ),
    ] = LOCAL_BACKEND
    ray_address: Annotated[
        str | None,
        describe(
            "With backend 'ray': the Ray cluster to place the engines on, as `ray.init` takes it ('auto', "
            "'10.0.0.1:6379'); unset: the RAY_ADDRESS environment variable, else a Ray cluster on this host "
            "that the server starts and stops."
        ),
    ] = None
    ray_num_cpus_per_replica: Annotated[
        Annotated[float, msgspec.Meta(gt=0)],
        describe("With backend 'ray': CPUs each engine replica reserves on its Ray node."),
    ] = 1.0
    ray_num_gpus_per_replica: Annotated[
        Annotated[float, msgspec.Meta(ge=0)] | None,
        describe(
            "With backend 'ray': GPUs each engine replica reserves; unset: parallel.tensor_parallel_size when "
            "device is 'cuda' (or 'auto' and the cluster has GPUs), else 0."
        ),
    ] = None
    ray_placement_strategy: Annotated[
        Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"],
        describe(
            "With backend 'ray': how the replicas' placement group lays them out over nodes: SPREAD puts them "
            "on different nodes where it can, STRICT_SPREAD only so, PACK and STRICT_PACK as few as possible."
        ),
    ] = "SPREAD"
    engines: Annotated[
        list[str],
        describe(
            "Addresses of engines already running (`tokenmill engine --listen ADDR`), e.g. tcp://host:5555; "
            "when given, no local engine is started.",
            flag="--engine",
        ),
    ] = msgspec.field(default_factory=list)
    router: Annotated[str, describe("Routing policy plugin that picks an engine per request.")] = "round-robin"
    disaggregated_prefill: Annotated[
        bool,
        describe(
            "Start a prefill engine and a decode engine instead of one: the prefill engine computes each prompt's "
            "KV and ships its blocks to the decode engine over a KV connector (zmq-push/zmq-pull KV tiers), so "
            "long prompts never stall the decode steps (docs/kv_cache.md#disaggregated-prefill)."
        ),
    ] = False
    kv_transfer_buffer: Annotated[
        str,
        describe("With disaggregated_prefill: host memory the decode engine keeps received KV blocks in."),
    ] = "2GiB"
    drain_timeout: Annotated[
        Annotated[float, msgspec.Meta(ge=0)],
        describe(
            "On SIGTERM or Ctrl-C, seconds to let running requests finish (new ones get 503) before the rest "
            "fail and the engines stop; a second signal stops at once."
        ),
    ] = 30.0
    max_engine_restarts: Annotated[
        NonNegativeInt,
        describe(
            "Restarts of a dead engine that may fail in a row before the server gives up and exits with status "
            "1. A restart fails when the engine does not start, or dies again before it finished a request or "
            "stayed up a minute; the waits before attempts are 1, 2, 4, ... s (at most 30). Engines given by "
            "--engine are connected to again instead (each attempt waits up to engine_timeout). 0: an engine "
            "that dies stops the server."
        ),
    ] = 5
    engine_timeout: Annotated[
        Annotated[float, msgspec.Meta(gt=0)],
        describe(
            "Seconds without a heartbeat after which an engine counts as dead (its requests get 503). An "
            "engine answers between steps, so this must exceed the longest step (a 2,048-token prefill chunk "
            "takes seconds on a small CPU); an engine process that exits is noticed at once regardless."
        ),
    ] = 60.0

    def __post_init__(self) -> None:
        if self.default_chat_template_kwargs:
            from tokenmill.tokenizer.chat_template import check_template_kwargs  # jinja2 and tokenizers: only if set

            check_template_kwargs(self.default_chat_template_kwargs, "server.default_chat_template_kwargs")
        if self.backend != LOCAL_BACKEND and (self.engines or self.disaggregated_prefill):
            setting = "server.engines (--engine)" if self.engines else "server.disaggregated_prefill"
            raise ValueError(
                f"server.backend = {self.backend!r} starts its own engines where that backend runs them: it cannot "
                f"be combined with {setting}; unset one of them"
            )
