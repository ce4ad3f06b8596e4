"""Offline benchmarks of the in-process engine (``tokenmill.LLM``): ``bench latency`` and ``bench throughput``.

Prompts are random token ids, so no tokenizer work is timed, and every request
generates exactly its output length (``min_tokens`` = ``max_tokens``). Each timed
generate call gets prompts it has not seen, so the prefix cache never turns a
repeated prompt into a free prefill.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.sampling_params import SamplingParams
from tokenmill_plugins.commands.bench.metrics import Stats, build_report
from tokenmill_plugins.commands.bench.workload import random_token_ids, sample_lengths

if TYPE_CHECKING:  # the engine imports torch; only the commands that run it load it
    from tokenmill.llm import LLM
    from tokenmill.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LatencySummary:
    num_iters: int
    latency_s: Stats  # of one generate call for the whole batch
    output_throughput: float  # generated tokens per second, at the mean latency
    total_token_throughput: float  # prompt + generated tokens per second, at the mean latency
    iteration_latencies_s: list[float]  # every timed iteration, in order, to see warm-up or noise


@dataclass(frozen=True)
class ThroughputSummary:
    num_completed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float


def run_latency(
    llm: LLM,
    *,
    input_len: int,
    output_len: int,
    batch_size: int,
    num_iters: int,
    num_iters_warmup: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Time ``num_iters`` generate calls of ``batch_size`` prompts (after the warm-up ones)
    and return the report."""
    latencies = []
    for i in range(num_iters_warmup + num_iters):
        # A fresh seed per iteration: new prompts, so no iteration reuses another's cached prefix.
        prompts = _prompts(llm, [input_len] * batch_size, seed=seed + i)
        start = time.perf_counter()
        outputs = _generate(llm, prompts, [output_len] * batch_size)
        elapsed = time.perf_counter() - start
        _check_lengths(outputs, [output_len] * batch_size)
        if i >= num_iters_warmup:
            latencies.append(elapsed)
        logger.debug("iteration %d: %.3f s%s", i, elapsed, " (warm-up)" if i < num_iters_warmup else "")
    stats = Stats.of(latencies)
    assert stats is not None, "num_iters must be at least 1"
    summary = LatencySummary(
        num_iters=num_iters,
        latency_s=stats,
        output_throughput=batch_size * output_len / stats.mean,
        total_token_throughput=batch_size * (input_len + output_len) / stats.mean,
        iteration_latencies_s=latencies,
    )
    parameters = {
        "model": llm.config.model.model,
        "device": llm.config.device.device,
        "input_len": input_len,
        "output_len": output_len,
        "batch_size": batch_size,
        "num_iters": num_iters,
        "num_iters_warmup": num_iters_warmup,
        "seed": seed,
        "config": llm.config.to_dict(),
    }
    return build_report("latency", parameters, summary)


def run_throughput(
    llm: LLM,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    mixed: bool = False,
    seed: int = 0,
    warmup: bool = True,
) -> dict[str, Any]:
    """Time one generate call over ``num_prompts`` prompts, all submitted at once, and return the report."""
    input_lens = sample_lengths(num_prompts, input_len, seed=seed, mixed=mixed, stream=0)
    output_lens = sample_lengths(num_prompts, output_len, seed=seed, mixed=mixed, stream=1)
    if warmup:
        # One small request first, so one-time costs (lazy init, first kernels) are not timed.
        _generate(llm, _prompts(llm, [min(input_len, 16)], seed=seed + 1), [min(output_len, 4)])
    prompts = _prompts(llm, input_lens, seed=seed)
    start = time.perf_counter()
    outputs = _generate(llm, prompts, output_lens)
    duration = time.perf_counter() - start
    _check_lengths(outputs, output_lens)
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    summary = ThroughputSummary(
        num_completed=len(outputs),
        duration_s=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(outputs) / duration,
        output_throughput=output_tokens / duration,
        total_token_throughput=(input_tokens + output_tokens) / duration,
    )
    parameters = {
        "model": llm.config.model.model,
        "device": llm.config.device.device,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "mixed": mixed,
        "seed": seed,
        "kv_cache": _kv_cache_layout(llm),
        "config": llm.config.to_dict(),
    }
    return build_report("throughput", parameters, summary)


def _kv_cache_layout(llm: LLM) -> dict[str, Any]:
    """The KV cache as sized at start-up: what ``cache.kv_cache_memory`` bought in this dtype."""
    layout = llm.engine.layout
    return {
        "dtype": str(llm.engine.loaded.kv_cache_dtype).removeprefix("torch."),
        "num_blocks": layout.num_blocks,
        "num_tokens": layout.num_tokens,
        "bytes_per_token": layout.bytes_per_block // layout.block_size,
        "num_bytes": layout.num_bytes,
    }


def _prompts(llm: LLM, lengths: list[int], *, seed: int) -> list[dict[str, Any]]:
    ids = random_token_ids(lengths, seed=seed, vocab_size=llm.engine.vocab_size)
    return [{"prompt_token_ids": token_ids} for token_ids in ids]


def _generate(llm: LLM, prompts: list[dict[str, Any]], output_lens: list[int]) -> list[RequestOutput]:
    # min_tokens = max_tokens: EOS cannot end a request early, so every run does the same work.
    params = [SamplingParams(temperature=0, max_tokens=m, min_tokens=m) for m in output_lens]
    return llm.generate(prompts, params, use_tqdm=False)


def _check_lengths(outputs: list[RequestOutput], output_lens: list[int]) -> None:
    for output, expected in zip(outputs, output_lens, strict=True):
        got = len(output.outputs[0].token_ids)
        # Only the context window can stop a request before max_tokens here.
        if got != expected:
            logger.warning(
                "request %s generated %d tokens, not %d; is input_len + output_len above max_model_len?",
                output.request_id,
                got,
                expected,
            )
