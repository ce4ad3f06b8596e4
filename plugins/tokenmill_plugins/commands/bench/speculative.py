"""``tokenmill bench speculative``: one workload with and without speculative decoding, in one process.

Two offline engines are built from the same config, one with its
``speculative_config`` and one without, and the workload runs on each in
turn, alternating (plain, speculative, plain, speculative, ...) so that both
sides see the same machine state; the best round of each side is reported.
Requests are greedy, so both sides must produce the same tokens: the report
says whether they did. At concurrency ``c`` the engine gets ``c`` requests at
once; at c=1 the workload's conversations run one after another.

Workloads (``--workload``):

- ``copy``: rewrite, proofread or summarise a passage given in the prompt, and
  edit code with repeated identifiers. The answer copies long runs of the
  prompt: what prompt lookup (``ngram``) is for.
- ``chat``: open questions whose answers copy nothing from the prompt.

The passages and code below were written for this benchmark.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from tokenmill.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.llm import LLM

logger = logging.getLogger(__name__)

_PASSAGES = [
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened his shutters, "
    "and the ferry sounded its horn twice before leaving for the far bank. By nine the market square was full "
    "of carts, and the smell of bread and smoke hung over the water until the wind turned in the afternoon.",
    "A cache keeps recently used data close to the processor. When the data is found in the cache, the access "
    "is fast; when it is not, the data is fetched from main memory, which takes much longer, and a line of the "
    "cache is evicted to make room. Programs that reuse the same data soon after they first use it run faster.",
    "Our team met on Tuesday to plan the release. We agreed to freeze features on Friday, to spend next week on "
    "testing and documentation, and to publish the release notes on the following Monday. Maria will own the "
    "changelog, Tom will run the test matrix, and everyone will review at least two pull requests per day.",
    "Bees visit flowers to collect nectar and pollen. As a bee moves from one flower to the next, pollen sticks "
    "to its body and rubs off on the next flower, which lets the plant make seeds. Many crops depend on this, "
    "so farmers sometimes rent hives and place them near their fields while the plants are in bloom.",
]
_CODE = [
    "def total_price(items):\n    total = 0\n    for item in items:\n"
    "        total = total + item.price * item.quantity\n    return total\n\n\n"
    "def average_price(items):\n    total = total_price(items)\n    count = len(items)\n"
    "    return total / count if count else 0\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, word):\n"
    "        self.counts[word] = self.counts.get(word, 0) + 1\n\n    def most_common(self, n):\n"
    "        ordered = sorted(self.counts.items(), key=lambda pair: pair[1], reverse=True)\n"
    "        return ordered[:n]\n",
]
_COPY_PROMPTS = [
    *(f"Rewrite the following passage in your own words, keeping every detail:\n\n{p}" for p in _PASSAGES[:2]),
    *(f"Repeat the following passage exactly, fixing only spelling mistakes:\n\n{p}" for p in _PASSAGES[2:]),
    f"Rename the function total_price to sum_prices everywhere in this code and show the whole result:\n\n{_CODE[0]}",
    f"Add a docstring to every method of this class and show the whole class:\n\n{_CODE[1]}",
    f"Summarise this passage in two sentences:\n\n{_PASSAGES[1]}",
    f"Rename the variable total to subtotal in this code and show the whole result:\n\n{_CODE[0]}",
]
_CHAT_PROMPTS = [
    "What are three good habits for staying focused while studying?",
    "Explain how a bicycle stays upright when it is moving.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple vegetable soup.",
    "Why do leaves change colour in autumn?",
    "Describe the rules of chess for a beginner.",
    "What should I pack for a three-day hiking trip?",
]
WORKLOADS: dict[str, list[str]] = {"copy": _COPY_PROMPTS, "chat": _CHAT_PROMPTS}


def _conversations(workload: str, count: int) -> list[list[dict[str, str]]]:
    prompts = WORKLOADS[workload]
    return [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(count)]


def _run_once(llm: LLM, conversations: list[list[dict[str, str]]], concurrency: int, output_len: int) -> tuple[
    float, list[list[int]]
]:  # fmt: skip
    """Wall time and tokens of the conversations at ``concurrency`` (1: one after another)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len)
    batches = [conversations] if concurrency > 1 else [[c] for c in conversations]
    tokens: list[list[int]] = []
    started = time.perf_counter()
    for batch in batches:
        for output in llm.chat(batch, params, use_tqdm=False):
            tokens.append(list(output.outputs[0].token_ids))
    return time.perf_counter() - started, tokens


def _spec_counters(llm: LLM) -> tuple[int, int, int, list[int]]:
    stats = llm.engine.stats()
    return (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
            list(stats.spec_decode_num_accepted_tokens_per_pos))  # fmt: skip


def run_speculative(
    config: EngineConfig,
    *,
    workload: str,
    concurrency_levels: list[int],
    output_len: int,
    num_prompts: int,
    rounds: int,
) -> dict[str, Any]:
    """Both sides of the comparison at each concurrency level; returns the report."""
    from tokenmill.llm import LLM

    if config.speculative_config.method is None:
        raise ConfigError("give --speculative-config: there is nothing to compare without a speculator")
    speculative = LLM.from_config(config)
    plain = LLM.from_config(msgspec.structs.replace(config, speculative_config=SpeculativeConfig()))
    levels = []
    for concurrency in concurrency_levels:
        conversations = _conversations(workload, max(concurrency, num_prompts if concurrency == 1 else concurrency))
        _run_once(plain, conversations[:1], 1, 8)  # warm both engines up
        _run_once(speculative, conversations[:1], 1, 8)
        best = {"plain": float("inf"), "speculative": float("inf")}
        outputs: dict[str, list[list[int]]] = {}
        before = _spec_counters(speculative)
        for _ in range(rounds):
            for side, llm in (("plain", plain), ("speculative", speculative)):
                seconds, outputs[side] = _run_once(llm, conversations, concurrency, output_len)
                best[side] = min(best[side], seconds)
        after = _spec_counters(speculative)
        num_tokens = sum(len(t) for t in outputs["plain"])
        drafts, draft_tokens, accepted = (a - b for a, b in zip(after[:3], before[:3], strict=True))
        per_pos = [a - (before[3][i] if i < len(before[3]) else 0) for i, a in enumerate(after[3])]
        plain_rate, spec_rate = num_tokens / best["plain"], num_tokens / best["speculative"]
        levels.append({
            "concurrency": concurrency,
            "num_requests": len(conversations),
            "output_tokens": num_tokens,
            "plain_tok_s": round(plain_rate, 2),
            "speculative_tok_s": round(spec_rate, 2),
            "speedup": round(spec_rate / plain_rate, 3),
            "identical_outputs": outputs["plain"] == outputs["speculative"],
            "num_drafts": drafts,
            "acceptance_rate": round(accepted / draft_tokens, 3) if draft_tokens else None,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_per_position": [round(n / drafts, 3) for n in per_pos] if drafts else [],
        })  # fmt: skip
        logger.info("c=%d: %s", concurrency, levels[-1])
    return {
        "workload": workload,
        "speculative_config": msgspec.to_builtins(config.speculative_config),
        "model": config.model.model,
        "quantization": config.model.quantization,
        "output_len": output_len,
        "rounds": rounds,
        "levels": levels,
    }


def format_speculative(report: dict[str, Any]) -> str:
    """The report as a table, one row per concurrency level."""
    spec = {k: v for k, v in report["speculative_config"].items() if v is not None}
    lines = [
        f"workload {report['workload']}, speculative_config {spec}, output_len {report['output_len']}",
        "",
        "| c | plain tok/s | speculative tok/s | speedup | identical | acceptance | mean accepted length | "
        "acceptance per position |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level in report["levels"]:
        lines.append(
            f"| {level['concurrency']} | {level['plain_tok_s']} | {level['speculative_tok_s']} | "
            f"{level['speedup']}x | {'yes' if level['identical_outputs'] else 'NO'} | {level['acceptance_rate']} | "
            f"{level['mean_accepted_length']} | {level['acceptance_per_position']} |"
        )
    return "\n".join(lines)
