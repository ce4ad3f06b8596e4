"""``tokenmill eval perplexity``: how well a model, as tokenmill loads and runs it, predicts a text.

The text is tokenized once (with the tokenizer's own special tokens, e.g. a BOS where the model adds
one) and scored in windows of ``context_length`` tokens that start ``stride`` tokens apart, the
sliding-window method of Hugging Face's perplexity guide: each window is run as a fresh sequence from
position 0 through the engine's model runner (paged KV cache, the configured attention backend and
quantizer), and only the tokens that no earlier window scored count, so every token after the first is
scored exactly once, with up to ``context_length - stride`` tokens of context before the first scored
one (with ``stride == context_length`` the windows do not overlap, and the first token of each, which
has no context, is not scored, as in the guide).
Perplexity is ``exp(-mean log p(token | tokens before it in its window))``.

``bench accuracy`` scores a short fixed text one token per step (the decode path) against transformers;
this command scores whole windows per step (the prefill path), for texts of any length, and reports the
model's size on disk beside it, so quantized formats can be compared on one line each.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.errors import TokenmillError

if TYPE_CHECKING:  # torch loads with the engine
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Files counted as a model's weights when the model is a directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


class PerplexityError(TokenmillError, ValueError):
    """A perplexity setting or text that cannot be scored (too short, windows that do not fit)."""


@dataclass(frozen=True)
class Window:
    """One forward: tokens ``[begin, end)`` from position 0; tokens ``[first_scored, end)`` are scored."""

    begin: int
    end: int
    first_scored: int


@dataclass(frozen=True)
class PerplexityResult:
    model: str
    perplexity: float
    num_tokens: int  # tokens of the text
    num_scored: int  # tokens scored: all but the first (and each window's first when windows do not overlap)
    mean_logprob: float  # nats per scored token
    context_length: int
    stride: int
    num_windows: int
    size_bytes: int  # the model's weight files on disk
    quantization: str  # of the linears, as loaded
    dtype: str
    seconds: float  # scoring only, not loading

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else math.inf


def default_text() -> str:
    """The bundled text (``tokenmill_plugins/commands/eval/data/perplexity.txt``, CC0; see the README beside it)."""
    text = resources.files("tokenmill_plugins.commands.eval").joinpath("data/perplexity.txt")
    return text.read_text(encoding="utf-8")


def perplexity_windows(num_tokens: int, context_length: int, stride: int) -> list[Window]:
    """The windows that score each of ``num_tokens`` tokens after the first once (see the module docstring)."""
    if num_tokens < 2:
        raise PerplexityError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    if context_length < 2:
        raise PerplexityError(f"--context-length {context_length}: need at least 2 tokens per window")
    if not 1 <= stride <= context_length:
        raise PerplexityError(f"--stride {stride}: must be between 1 and --context-length ({context_length})")
    windows = []
    scored_until = 1  # the first token has nothing before it
    for begin in range(0, num_tokens, stride):
        end = min(begin + context_length, num_tokens)
        windows.append(Window(begin, end, max(scored_until, begin + 1)))
        scored_until = end
        if end == num_tokens:
            break
    return windows


def score_windows(runner: ModelRunner, token_ids: Sequence[int], windows: Sequence[Window]) -> torch.Tensor:
    """Float64 log-probabilities of the scored tokens of every window, in text order [num_scored]:
    each window runs as a fresh sequence through ``runner``, which must hold ``context_length`` tokens."""
    import torch

    from tokenmill.model_runner import SequenceChunk

    blocks = list(range(runner.num_blocks))
    logprobs = []
    for window in windows:
        chunk = SequenceChunk(list(token_ids[window.begin : window.end]), 0, blocks)
        # The logits at offset i predict the token at offset i + 1.
        rows = list(range(window.first_scored - window.begin - 1, window.end - window.begin - 1))
        logits = runner.execute([chunk], logits_indices=rows)  # [num_scored, vocab] float32
        targets = torch.tensor(token_ids[window.first_scored : window.end], device=logits.device)
        chosen = torch.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None])[:, 0]
        logprobs.append(chosen.cpu())
    return torch.cat(logprobs)  # [num_scored]


def model_size_bytes(path: Path) -> int:
    """Bytes of the model's weights on disk: the file itself, or a directory's weight files."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.suffix in _WEIGHT_SUFFIXES)


def run_perplexity(
    config: EngineConfig, text: str | None = None, *, context_length: int = 512, stride: int | None = None
) -> PerplexityResult:
    """Load the configured model with tokenmill's loader and score ``text`` (default: the bundled text)."""
    from tokenmill.layers.linear import Linear
    from tokenmill.model_files import resolve_tokenizer
    from tokenmill.model_loader import load_model
    from tokenmill.model_runner import ModelRunner
    from tokenmill.tokenizer import Tokenizer

    stride = stride if stride is not None else max(1, context_length // 2)
    tokenizer = Tokenizer.from_path(resolve_tokenizer(config.model.model, config.model.tokenizer))
    token_ids = tokenizer.encode(default_text() if text is None else text)
    windows = perplexity_windows(len(token_ids), context_length, stride)
    loaded = load_model(config)
    if context_length > loaded.max_model_len:
        raise PerplexityError(
            f"--context-length {context_length} exceeds the model's max_model_len {loaded.max_model_len}"
        )
    block_size = config.cache.block_size
    runner = ModelRunner(loaded, num_blocks=-(-context_length // block_size), block_size=block_size)
    started = time.perf_counter()
    logprobs = score_windows(runner, token_ids, windows)
    seconds = time.perf_counter() - started
    assert len(logprobs) == sum(w.end - w.first_scored for w in windows)
    mean = float(logprobs.mean())
    quantizers = sorted({m.quantizer.name for m in loaded.model.modules() if isinstance(m, Linear)})
    result = PerplexityResult(
        model=str(loaded.path),
        perplexity=math.exp(-mean),
        num_tokens=len(token_ids),
        num_scored=len(logprobs),
        mean_logprob=mean,
        context_length=context_length,
        stride=stride,
        num_windows=len(windows),
        size_bytes=model_size_bytes(loaded.path),
        quantization="+".join(quantizers) or "none",
        dtype=str(loaded.dtype).removeprefix("torch."),
        seconds=seconds,
    )
    logger.info("perplexity %.4f over %d tokens in %.2f s", result.perplexity, result.num_tokens, seconds)
    return result


def format_perplexity(result: PerplexityResult) -> str:
    """One line per fact, for the terminal."""
    return "\n".join([
        f"model: {result.model}",
        f"quantization: {result.quantization} ({result.dtype})",
        f"size on disk: {result.size_bytes / 2**20:.1f} MiB",
        f"tokens: {result.num_tokens} ({result.num_windows} windows of {result.context_length}, "
        f"stride {result.stride})",
        f"perplexity: {result.perplexity:.4f}",
        f"time: {result.seconds:.2f} s ({result.tokens_per_second:.0f} tokens/s)",
    ])  # fmt: skip
