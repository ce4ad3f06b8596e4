"""``tokenmill bench kv-tiers``: time to first token with and without KV tiers, in one process.

Two workloads (``--workload``):

- ``multi-turn``: conversations over shared long documents (RAG, agents); each
  turn's prompt is its document, the turns so far and a new question. The
  conversations advance in turn, so the prefixes they reuse add up to more
  than the device KV cache holds (the device gets a quarter of it unless
  ``--num-kv-blocks`` says otherwise) and are evicted before they come back.
  The same requests run on an engine without tiers and on one with the
  config's ``kv_tiers`` (``cpu:4GiB`` when none is given), alternating; the
  report gives each side's TTFT percentiles and the tier hits. It also checks
  the tiered engine's greedy outputs against a third, untimed engine whose
  device cache holds every prefix: loading a block from a tier must give what
  finding it on the device gives, token for token. (The engine without tiers
  is no reference for that: it recomputes evicted prefixes in other chunks,
  and on random-token prompts, whose next tokens are near-ties, a difference
  in the last bits of the K/V can change a greedy token.)
- ``restart``: a ``disk`` tier (the config's, or one in a temporary directory):
  one engine runs a long prompt and stops; a new engine over the same directory
  (a restart) then runs that prompt and a cold one of the same length. The
  report gives both TTFTs, and whether the reloaded prompt's greedy tokens equal
  those of the first engine finding it in its device cache.

Prompts are random token ids (seeded): the model's cost does not depend on
what the tokens say, and the outputs are compared, not read.
"""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
import time
from typing import Any

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.config.cache import KVTierConfig

logger = logging.getLogger(__name__)


def _engine(config: EngineConfig) -> Any:
    from tokenmill.engine import EngineCore

    return EngineCore(config)


def _run(engine: Any, prompt: list[int], output_len: int, request_id: str) -> tuple[float, list[int]]:
    """One greedy request alone on the engine: (seconds to its first token, its tokens)."""
    from tokenmill.messages import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(EngineCoreRequest(request_id, prompt, params, [], time.monotonic()))
    ttft: float | None = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.new_token_ids:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                tokens.extend(output.new_token_ids)
    assert ttft is not None, "the request produced no token"
    return ttft, tokens


def _fields(struct: msgspec.Struct) -> dict[str, Any]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_multi_turn(
    config: EngineConfig,
    *,
    documents: int,
    document_len: int,
    conversations_per_document: int,
    turns: int,
    turn_len: int,
    output_len: int,
    rounds: int,
    seed: int,
) -> dict[str, Any]:
    """TTFT over the multi-turn workload on an engine without tiers and one with them; returns the report."""
    tiers = config.kv_tiers or [KVTierConfig("cpu", "4GiB")]
    rng = random.Random(seed)
    probe = _engine(msgspec.structs.replace(config, kv_tiers=[]))
    vocab = probe.vocab_size
    block_size = probe.layout.block_size
    del probe
    docs = [[rng.randrange(3, vocab) for _ in range(document_len)] for _ in range(documents)]
    questions = [[[rng.randrange(3, vocab) for _ in range(turn_len)] for _ in range(turns)]
                 for _ in range(documents * conversations_per_document)]  # fmt: skip
    total_tokens = documents * document_len + len(questions) * turns * (turn_len + output_len)
    num_blocks = config.cache.num_kv_blocks or max(64, total_tokens // block_size // 4)
    cache = msgspec.structs.replace(config.cache, num_kv_blocks=num_blocks)
    sides = {
        "no tiers": _engine(msgspec.structs.replace(config, cache=cache, kv_tiers=[])),
        "tiers": _engine(msgspec.structs.replace(config, cache=cache, kv_tiers=tiers)),
    }
    ttfts: dict[str, list[float]] = {side: [] for side in sides}
    outputs: dict[str, list[list[int]]] = {side: [] for side in sides}
    everything = msgspec.structs.replace(config.cache, num_kv_blocks=2 * total_tokens // block_size + 64)
    reference = _engine(msgspec.structs.replace(config, cache=everything, kv_tiers=[]))
    for round_ in range(rounds):
        for side, engine in (*sides.items(), *((("reference", reference),) if round_ == 0 else ())):
            engine.kv_cache.reset_prefix_cache()
            histories = [list(docs[i // conversations_per_document]) for i in range(len(questions))]
            for turn in range(turns):
                for conversation, history in enumerate(histories):
                    history.extend(questions[conversation][turn])
                    ttft, tokens = _run(engine, history, output_len, f"{side}-{round_}-{conversation}-{turn}")
                    history.extend(tokens)
                    if side in ttfts and (turn > 0 or conversation % conversations_per_document):
                        ttfts[side].append(ttft)  # (the first sight of a document is cold on every side)
                    if round_ == 0:
                        outputs.setdefault(side, []).append(tokens)
    stats = sides["tiers"].stats()
    report_sides = {
        side: {"ttft_p50_s": round(_percentile(values, 0.5), 4), "ttft_p90_s": round(_percentile(values, 0.9), 4),
               "ttft_mean_s": round(statistics.mean(values), 4), "requests": len(values)}
        for side, values in ttfts.items()
    }  # fmt: skip
    return {
        "workload": "multi-turn",
        "model": config.model.model,
        "kv_tiers": [msgspec.to_builtins(t) for t in tiers],
        "device_kv_blocks": num_blocks,
        "block_size": block_size,
        "total_prefix_tokens": total_tokens,
        "documents": documents, "document_len": document_len, "conversations": len(questions), "turns": turns,
        "rounds": rounds,
        "sides": report_sides,
        "ttft_p50_ratio": round(report_sides["tiers"]["ttft_p50_s"] / report_sides["no tiers"]["ttft_p50_s"], 3),
        "identical_to_device_cache": outputs["tiers"] == outputs["reference"],
        "requests_differing_from_no_tiers": sum(a != b for a, b in zip(*(outputs[s] for s in sides), strict=True)),
        "tier_stats": [_fields(t) for t in stats.kv_tiers],
        "tier_loads": sum(t.loads for t in stats.kv_tiers),
        "tier_load_seconds": round(sum(t.load_seconds for t in stats.kv_tiers), 4),
    }  # fmt: skip


def run_restart(config: EngineConfig, *, input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    """TTFT of a long prompt after a restart over a disk tier, against a cold prompt; returns the report."""
    tiers = config.kv_tiers
    scratch = None
    if not any(t.name == "disk" for t in tiers):
        scratch = tempfile.TemporaryDirectory(prefix="tokenmill-bench-kv-")
        tiers = [*tiers, KVTierConfig("disk", "4GiB", scratch.name)]
    config = msgspec.structs.replace(config, kv_tiers=tiers)
    rng = random.Random(seed)
    first = _engine(config)
    vocab = first.vocab_size
    seen, cold, warmup = ([rng.randrange(3, vocab) for _ in range(n)] for n in (input_len, input_len, 64))
    _run(first, warmup, 1, "warmup")
    first_ttft, _ = _run(first, seen, output_len, "seen")
    _, cached_tokens = _run(first, seen, output_len, "seen-cached")  # what a device-cache hit gives
    first.close()  # the disk tier's writes land
    del first
    restarted = _engine(config)
    _run(restarted, warmup[::-1], 1, "warmup")
    warm_ttft, warm_tokens = _run(restarted, seen, output_len, "seen-again")
    cold_ttft, _ = _run(restarted, cold, output_len, "cold")
    stats = restarted.stats()
    restarted.close()
    if scratch is not None:
        scratch.cleanup()
    return {
        "workload": "restart",
        "model": config.model.model,
        "kv_tiers": [msgspec.to_builtins(t) for t in tiers],
        "input_len": input_len,
        "first_run_ttft_s": round(first_ttft, 4),
        "after_restart_ttft_s": round(warm_ttft, 4),
        "cold_ttft_s": round(cold_ttft, 4),
        "ttft_ratio": round(warm_ttft / cold_ttft, 3),
        "identical_to_device_cache": warm_tokens == cached_tokens,
        "tier_stats": [_fields(t) for t in stats.kv_tiers],
    }


def format_kv_tiers(report: dict[str, Any]) -> str:
    """The report as a short table."""
    tiers = ", ".join(f"{t['name']}:{t['capacity']}" for t in report["kv_tiers"])
    if report["workload"] == "restart":
        return "\n".join([
            f"restart over kv_tiers [{tiers}], {report['input_len']}-token prompt",
            "",
            "| first run TTFT s | after restart TTFT s | cold TTFT s | ratio | identical to a device-cache hit |",
            "|---|---|---|---|---|",
            f"| {report['first_run_ttft_s']} | {report['after_restart_ttft_s']} | {report['cold_ttft_s']} | "
            f"{report['ttft_ratio']}x | {'yes' if report['identical_to_device_cache'] else 'NO'} |",
        ])  # fmt: skip
    lines = [
        f"multi-turn: {report['conversations']} conversations over {report['documents']} documents of "
        f"{report['document_len']} tokens, {report['turns']} turns; {report['total_prefix_tokens']} prefix tokens "
        f"against {report['device_kv_blocks']} device blocks of {report['block_size']}; kv_tiers [{tiers}]",
        "",
        "| side | TTFT p50 s | TTFT p90 s | mean s | requests |",
        "|---|---|---|---|---|",
    ]
    for side, values in report["sides"].items():
        lines.append(f"| {side} | {values['ttft_p50_s']} | {values['ttft_p90_s']} | {values['ttft_mean_s']} | "
                     f"{values['requests']} |")  # fmt: skip
    hits = ", ".join(f"{t['name']} {t['hits']} hits" for t in report["tier_stats"])
    lines += ["", f"TTFT p50 ratio {report['ttft_p50_ratio']}x; {hits}; {report['tier_loads']} loads in "
              f"{report['tier_load_seconds']} s; outputs identical to an engine holding every prefix on the device: "
              f"{'yes' if report['identical_to_device_cache'] else 'NO'} "
              f"({report['requests_differing_from_no_tiers']} differ from the engine without tiers, which "
              "recomputes evicted prefixes)"]  # fmt: skip
    return "\n".join(lines)
