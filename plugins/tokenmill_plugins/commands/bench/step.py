"""``bench step``: where one engine step's time goes, at a given batch size and context length.

A decode step is timed end to end through ``EngineCore.step`` (scheduling, batch building,
forward, logits, sampling, output bookkeeping). Then its parts are timed alone on the same
model with the same shapes: every linear layer call of one decode step, with its rows (the output
projection included), every mixture-of-experts layer's fused experts (``FusedExperts.apply`` or ``apply_routed``: the
experts the step's tokens chose, over their tokens, with the step's routing), and every layer's
attention (cache write plus paged attention) over the model runner's batch layout of the next
decode step. What the parts do not account for is the
rest of the step ("other"), broken down further: the scheduler's two calls (``schedule``,
``update``), the batch layout (``prepare_batch``), sampling (the sampler and its metadata over
the step's logits), the layer kernels (every RMSNorm module of the model with its residual add,
rope over each attention layer's queries and keys, SiLU-and-multiply over each layer's MLP), and
what is left: the forward's Python and its glue operators (splits, views, the embedding).

Timing the parts separately, rather than through a profiler, keeps the numbers honest for
C++ kernels that a profiler does not see and costs nothing in the engine's hot path. Parts timed
alone run with warm caches; inside a step each waits for memory the others evicted. So on a CPU
the parts are also timed where the forward calls them, over as many real decode steps (``*_in_step``:
each linear's, the fused experts', the attention backend's and the layer kernels' calls wrapped in a timer,
about half a microsecond a call): ``other_in_step_ms``, the step less those, is the host time of a step (Python,
glue operators, scheduler, batch layout, sampling), without the parts' cache misses. Those steps run module by
module: a model whose layer kernels run its whole decoder stack in one call (``LayerKernels.fused_decoder``, the
``fused_decoder`` parameter of the report) takes the step timed end to end that way, and the parts inside it
have no calls of their own to time. Only
public API is used: the engine's ``add_request``/``abort_requests``, its step loop's three
calls (what ``EngineCore.step`` runs), its executor's sampler and logits processors, and its
model runner's ``prepare_batch``, model and KV cache tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill_plugins.commands.bench.metrics import build_report
from tokenmill_plugins.commands.bench.workload import random_token_ids

if TYPE_CHECKING:
    import torch

    from tokenmill.engine import EngineCore
    from tokenmill.layers.linear import Linear
    from tokenmill.model_runner import ModelRunner, SequenceChunk


@dataclass(frozen=True)
class StepBreakdown:
    batch_size: int
    context_len: int  # tokens in each request's cache during the timed steps (about)
    step_ms: float  # one decode step through EngineCore.step, median
    linear_ms: float  # every linear call of one decode step outside the fused experts, lm_head included
    experts_ms: float  # every MoE layer's fused experts call (0 for a dense model)
    attention_ms: float  # every layer's K/V write and attention
    other_ms: float  # step - linear - experts - attention, of which:
    schedule_ms: float  # Scheduler.schedule
    update_ms: float  # Scheduler.update_from_output (and drafts or KV tier writes, if any)
    batch_ms: float  # the batch layout and the attention backend's prepare
    sampling_ms: float  # sampling metadata and the sampler over the step's logits
    layer_kernels_ms: float  # norms with their residual adds, rope, SiLU-and-multiply: every layer's
    rest_ms: float  # other - the five above: the forward's Python and glue operators
    # Inside real steps (CPU only; None on a GPU, whose kernels run after their calls return):
    step_in_step_ms: float | None  # a step run module by module with the parts' calls timed, median
    linear_in_step_ms: float | None  # the linears' calls in it (the output projection included)
    experts_in_step_ms: float | None  # the fused experts' calls in it
    attention_in_step_ms: float | None  # the attention backend's calls in it
    layer_kernels_in_step_ms: float | None  # the layer kernels' calls in it
    other_in_step_ms: float | None  # step_in_step - the four above: the step's host time
    output_throughput: float  # batch_size / step time


def run_step(engine: EngineCore, *, batch_size: int, context_len: int, num_steps: int, seed: int) -> dict[str, Any]:
    """Fill ``batch_size`` requests to ``context_len`` tokens, then time decode steps and their parts."""
    import torch

    from tokenmill.parallel import TensorParallelError

    if engine.shards is not None:  # the parts run one process's layers alone, which a sharded model cannot
        raise TensorParallelError("bench step times the layers of one process; run it with tensor_parallel_size = 1")

    from tokenmill.engine import now
    from tokenmill.layers.linear import Linear
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.rotary import RotaryEmbedding
    from tokenmill.messages import EngineCoreRequest
    from tokenmill.sampling.logits_processor import SamplingRow
    from tokenmill.sampling.sampler import SamplingMetadata
    from tokenmill.sampling_params import SamplingParams

    prompts = random_token_ids([context_len] * batch_size, seed=seed, vocab_size=engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=num_steps * 3 + 8, ignore_eos=True)
    request_ids = [f"step-{i}" for i in range(batch_size)]
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(EngineCoreRequest(request_id, prompt, params, [], now()))
    prefilling = set(request_ids)
    while prefilling and engine.has_unfinished_requests():  # the step that ends a prompt samples its first token
        prefilling -= {output.request_id for output in engine.step() if output.new_token_ids}
    for _ in range(2):
        engine.step()  # warm-up decode steps
    device, dtype = engine.loaded.device, engine.loaded.dtype
    # On a GPU the host returns before the kernels finish: every timed call ends in a synchronize.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_ms, schedule_ms, update_ms = _time_step_calls(engine, num_steps, sync)
    in_step = _time_parts_in_steps(engine, num_steps) if device.type == "cpu" else None
    linear_calls, expert_calls = _recorded_calls(engine)
    # The parts below write K/V wherever their batch says: free the requests' blocks first.
    engine.abort_requests(request_ids)

    # The parts, over the same shapes as the steps just timed.
    runner = engine.executor.runner
    model = runner.loaded.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = [(layer, torch.randn(rows, layer.in_features, device=device, dtype=dtype)) for layer, rows in linear_calls]

    hidden = torch.randn(batch_size, runner.loaded.arch.hidden_size, device=device, dtype=dtype)  # [batch, hidden]
    tied_dense_head = getattr(model, "lm_head", None) is None

    def all_linears() -> None:
        for layer, x in inputs:
            layer(x)
        if tied_dense_head:  # the output projection reads the embedding: not a Linear
            model.compute_logits(hidden)

    def all_experts() -> None:
        for call in expert_calls:
            call()

    # The next decode step of the timed ones: each request has context_len + 2 + num_steps tokens cached.
    chunks = _decode_chunks(batch_size, context_len + 2 + num_steps, runner)
    _, metadata = runner.prepare_batch(chunks)
    backend = runner.loaded.attention
    specs = model.attention_specs()
    spec = specs[0]
    num_tokens = metadata.num_tokens
    query = torch.randn(num_tokens, spec.num_heads, spec.head_dim, device=device, dtype=dtype)  # [tokens, heads, dim]
    key = torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, device=device, dtype=dtype)  # [tokens, kv, dim]
    value = torch.randn(num_tokens, spec.num_kv_heads, spec.head_dim, device=device, dtype=dtype)

    def all_attention() -> None:
        for layer_spec, kv_cache in zip(specs, runner.kv_caches, strict=True):
            backend.forward(layer_spec, query, key, value, kv_cache, metadata)

    # The layer kernels as the forward calls them: each norm with a residual, rope over one attention layer's
    # queries and keys per layer, SiLU-and-multiply over one layer's gate and up projections per layer.
    arch = runner.loaded.arch
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    rotary = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    residual = torch.randn_like(hidden)
    query_and_key = torch.randn(batch_size, spec.num_heads + spec.num_kv_heads, spec.head_dim, device=device,
                                dtype=dtype)  # fmt: skip
    gate_up = torch.randn(batch_size, 2 * arch.intermediate_size // runner.loaded.tp.size, device=device, dtype=dtype)
    rotary.set_positions(torch.full((batch_size,), context_len, device=device))

    def all_layer_kernels() -> None:
        for norm in norms:
            if norm.weight.shape[-1] == hidden.shape[-1]:
                norm(hidden, residual)
            else:  # a q/k norm (Qwen3, Gemma 3) over the heads
                norm(query_and_key)
        for _ in specs:
            rotary.rotate(query_and_key)
            rotary.layer_kernels.silu_and_mul(gate_up)

    executor = engine.executor
    logits = torch.randn(batch_size, runner.loaded.arch.vocab_size, device=device)  # [batch, vocab] float32
    rows = [SamplingRow(f"step-{i}", params, prompt, [1, 2, 3], ()) for i, prompt in enumerate(prompts)]

    def sample() -> None:  # as the executor samples a decode step: its metadata, the sampler, the tokens read
        sampling = SamplingMetadata.from_requests(
            rows,
            generators=[None] * batch_size,
            vocab_size=logits.shape[-1],
            device=device,
            logits_processors=executor.logits_processors,
        )
        executor.sampler(logits, sampling).token_ids.tolist()

    with torch.inference_mode():
        linear_ms = _median_ms(all_linears, num_steps, sync)
        experts_ms = _median_ms(all_experts, num_steps, sync) if expert_calls else 0.0
        attention_ms = _median_ms(all_attention, num_steps, sync)
        batch_ms = _median_ms(lambda: runner.prepare_batch(chunks), num_steps, sync)
        sampling_ms = _median_ms(sample, num_steps, sync)
        layer_kernels_ms = _median_ms(all_layer_kernels, num_steps, sync)
    other_ms = step_ms - linear_ms - experts_ms - attention_ms
    summary = StepBreakdown(
        batch_size=batch_size,
        context_len=context_len,
        step_ms=step_ms,
        linear_ms=linear_ms,
        experts_ms=experts_ms,
        attention_ms=attention_ms,
        other_ms=other_ms,
        schedule_ms=schedule_ms,
        update_ms=update_ms,
        batch_ms=batch_ms,
        sampling_ms=sampling_ms,
        layer_kernels_ms=layer_kernels_ms,
        rest_ms=other_ms - schedule_ms - update_ms - batch_ms - sampling_ms - layer_kernels_ms,
        step_in_step_ms=in_step["step"] if in_step else None,
        linear_in_step_ms=in_step["linear"] if in_step else None,
        experts_in_step_ms=in_step["experts"] if in_step else None,
        attention_in_step_ms=in_step["attention"] if in_step else None,
        layer_kernels_in_step_ms=in_step["layer_kernels"] if in_step else None,
        other_in_step_ms=in_step["other"] if in_step else None,
        output_throughput=batch_size / (step_ms / 1000),
    )
    parameters = {
        "batch_size": batch_size,
        "context_len": context_len,
        "num_steps": num_steps,
        "seed": seed,
        "quantization": next(iter(linears)).quantizer.name if linears else None,
        "attention_backend": backend.name,
        "fused_decoder": model.fused_decoder is not None,
        "num_threads": torch.get_num_threads(),
    }
    return build_report("step", parameters, summary)


def _decode_chunks(batch_size: int, num_computed_tokens: int, runner: ModelRunner) -> list[SequenceChunk]:
    """A decode step of ``batch_size`` requests with ``num_computed_tokens`` cached each: one new token
    apiece, each request's blocks consecutive (as a fresh cache hands them out), wrapping around the
    cache if it holds fewer."""
    from tokenmill.model_runner import SequenceChunk

    blocks_per_request = -(-(num_computed_tokens + 1) // runner.block_size)
    return [
        SequenceChunk(
            [0],
            num_computed_tokens,
            [(i * blocks_per_request + j) % runner.num_blocks for j in range(blocks_per_request)],
        )
        for i in range(batch_size)
    ]


def _time_step_calls(engine: EngineCore, repeats: int, sync: Callable[[], Any]) -> tuple[float, float, float]:
    """Medians of whole decode steps and of their scheduler calls (ms): the step, ``schedule``, ``update``.
    Each step runs as ``EngineCore.step`` does, its loop's three calls, each timed."""
    loop = engine.loop
    steps, schedules, updates = [], [], []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        scheduler_output = loop.schedule()
        scheduled = time.perf_counter()
        runner_output = loop.execute(scheduler_output)  # no sync here: a step that runs ahead must not wait
        executed = time.perf_counter()
        loop.update(scheduler_output, runner_output)
        sync()
        finished = time.perf_counter()
        steps.append(finished - started)
        schedules.append(scheduled - started)
        updates.append(finished - executed)
    return _median(steps) * 1000, _median(schedules) * 1000, _median(updates) * 1000


def _recorded_calls(engine: EngineCore) -> tuple[list[tuple[Linear, int]], list[Callable[[], Any]]]:
    """What one eager decode step calls, in order: each linear outside the fused experts with its call's rows, and
    each call of the fused experts (``apply``, ``apply_routed``), as a call of the same with copies of its inputs."""
    import torch

    from tokenmill.layers.fused_experts import UsesFusedExperts
    from tokenmill.layers.linear import Linear  # noqa: F811  # at run time too

    model = engine.executor.runner.loaded.model
    calls: list[tuple[Linear, int]] = []
    expert_calls: list[Callable[[], Any]] = []
    inside_experts = [False]  # the reference's experts run through their own linears: those are the experts' time

    def recorded(layer: Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        forward = layer.forward

        def call(x: torch.Tensor) -> torch.Tensor:
            if not inside_experts[0]:
                calls.append((layer, x.shape[0]))
            return forward(x)

        return call

    def recorded_experts(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(experts: Any, *args: Any) -> Any:
            if inside_experts[0]:
                return method(experts, *args)
            copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            inside_experts[0] = True
            try:
                result = method(experts, *args)
            finally:
                inside_experts[0] = False
            if result is not None:  # apply_routed's None: the block routes and calls apply, recorded then
                expert_calls.append(lambda: method(experts, *copies))
            return result

        return call

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    fused = list({id(m.fused_experts): m.fused_experts for m in model.modules() if isinstance(m, UsesFusedExperts)}
                 .values())  # fmt: skip
    for layer in linears:
        layer.forward = recorded(layer)  # type: ignore[method-assign,assignment]
    for kernels in fused:
        kernels.apply = recorded_experts(kernels.apply)  # type: ignore[method-assign]
        kernels.apply_routed = recorded_experts(kernels.apply_routed)  # type: ignore[method-assign]
    runner = engine.executor.runner
    graphs, runner.cuda_graphs = runner.cuda_graphs, None  # a replayed graph calls no module: one eager step,
    fused_decoder, model.fused_decoder = model.fused_decoder, None  # module by module
    try:
        engine.step()
    finally:
        runner.cuda_graphs, model.fused_decoder = graphs, fused_decoder
        for layer in linears:
            del layer.forward  # the instance attributes: the classes' methods again
        for kernels in fused:
            del kernels.apply, kernels.apply_routed
    return calls, expert_calls


def _time_parts_in_steps(engine: EngineCore, repeats: int) -> dict[str, float]:
    """Medians over ``repeats`` decode steps (ms) of the step and of the time inside it spent in calls to each
    part, timed where the forward makes them, and the step's median less the parts' (``other``). CPU only: the
    calls return when their work is done. The timers are instance attributes over the parts' methods, removed at
    the end."""
    from tokenmill.layers.fused_experts import UsesFusedExperts
    from tokenmill.layers.kernels import UsesLayerKernels
    from tokenmill.layers.linear import Linear

    model = engine.executor.runner.loaded.model
    fused_decoder, model.fused_decoder = model.fused_decoder, None  # the parts' calls are timed in the modules
    spent = dict.fromkeys(("linear", "experts", "attention", "layer_kernels"), 0.0)
    inside = [False]  # a part calling another (a norm calling a norm) is timed once, as the outer one

    def timed(kind: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:
                return function(*args, **kwargs)
            inside[0] = True
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[kind] += time.perf_counter() - started
                inside[0] = False

        return call

    targets: list[tuple[object, str, str]] = [
        (m, "forward", "linear") for m in model.modules() if isinstance(m, Linear)
    ]
    if getattr(model, "lm_head", None) is None:  # a tied output projection reads the embedding: not a Linear
        targets.append((model, "compute_logits", "linear"))
    targets.append((engine.executor.runner.loaded.attention, "forward", "attention"))
    fused = {id(m.fused_experts): m.fused_experts for m in model.modules() if isinstance(m, UsesFusedExperts)}
    targets += [(kernels, name, "experts") for kernels in fused.values() for name in ("apply", "apply_routed")]
    kernels = {id(m.layer_kernels): m.layer_kernels for m in model.modules() if isinstance(m, UsesLayerKernels)}
    for layer_kernels in kernels.values():
        targets += [(layer_kernels, name, "layer_kernels") for name in ("rms_norm", "add_rms_norm", "rotary",
                                                                         "silu_and_mul")]  # fmt: skip
    for target, name, kind in targets:
        setattr(target, name, timed(kind, getattr(target, name)))
    samples: dict[str, list[float]] = {key: [] for key in ("step", *spent)}
    try:
        for _ in range(repeats):
            before = dict(spent)
            started = time.perf_counter()
            engine.step()
            samples["step"].append(time.perf_counter() - started)
            for kind in spent:
                samples[kind].append(spent[kind] - before[kind])
    finally:
        for target, name, _ in targets:
            delattr(target, name)  # the instance attribute: the class's method again
        model.fused_decoder = fused_decoder
    medians = {kind: _median(values) * 1000 for kind, values in samples.items()}
    medians["other"] = medians["step"] - sum(medians[kind] for kind in spent)  # so that the parts add up
    return medians


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _median_ms(function: Callable[[], Any], repeats: int, sync: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        function()
        sync()
        times.append((time.perf_counter() - started) * 1000)
    return _median(times)
