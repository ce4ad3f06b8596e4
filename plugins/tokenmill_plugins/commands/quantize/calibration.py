"""Calibration samples: what the model reads while it is being quantized.

The text is tokenized once, without special tokens, and cut into consecutive windows of ``seq_len``
tokens (the tail that does not fill a window is dropped); the first ``num_samples`` windows are the
samples. ``tests/quantize/make_reference_checkpoints.py`` builds llm-compressor's samples the same way.
"""

from __future__ import annotations

import logging
from importlib import resources

from tokenmill.tokenizer import Tokenizer
from tokenmill_plugins.commands.quantize.schemes import QuantizeError

logger = logging.getLogger(__name__)


def default_calibration_text() -> str:
    """The bundled text (``tokenmill_plugins/commands/quantize/data/calibration.txt``, CC0; see the README beside
    it)."""
    text = resources.files("tokenmill_plugins.commands.quantize").joinpath("data/calibration.txt")
    return text.read_text(encoding="utf-8")


def calibration_samples(tokenizer: Tokenizer, text: str, num_samples: int, seq_len: int) -> list[list[int]]:
    """Up to ``num_samples`` windows of ``seq_len`` token ids from ``text``."""
    if num_samples < 1 or seq_len < 1:
        raise QuantizeError(f"--num-samples {num_samples} and --seq-len {seq_len} must both be at least 1")
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    windows = [token_ids[i : i + seq_len] for i in range(0, len(token_ids) - seq_len + 1, seq_len)]
    if not windows:
        raise QuantizeError(
            f"the calibration text has {len(token_ids)} tokens, fewer than one --seq-len window of {seq_len}; "
            "give a longer --calibration file or a smaller --seq-len"
        )
    if len(windows) < num_samples:
        logger.warning(
            "the calibration text holds %d windows of %d tokens, fewer than --num-samples %d: using %d",
            len(windows), seq_len, num_samples, len(windows),
        )  # fmt: skip
    return windows[:num_samples]
