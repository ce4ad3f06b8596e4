"""Model evaluation: ``tokenmill eval perplexity``."""

from __future__ import annotations

from tokenmill_plugins.commands.eval.perplexity import (
    PerplexityError,
    PerplexityResult,
    Window,
    default_text,
    format_perplexity,
    model_size_bytes,
    perplexity_windows,
    run_perplexity,
    score_windows,
)

__all__ = [
    "PerplexityError",
    "PerplexityResult",
    "Window",
    "default_text",
    "format_perplexity",
    "model_size_bytes",
    "perplexity_windows",
    "run_perplexity",
    "score_windows",
]
