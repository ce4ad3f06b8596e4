"""The test kit's factories, under the name the tests have always imported them by.

They live in ``tokenmill.testing.factories`` so that plugin packages can use them too.
"""

from __future__ import annotations

from tokenmill.testing.factories import (
    TINY_CONFIGS,
    make_engine,
    make_hf_model,
    make_requests,
    make_scheduler,
    run_to_completion,
    save_hf_model,
    save_tiny_model,
    save_tiny_tokenizer,
)

__all__ = [
    "TINY_CONFIGS",
    "make_engine",
    "make_hf_model",
    "make_requests",
    "make_scheduler",
    "run_to_completion",
    "save_hf_model",
    "save_tiny_model",
    "save_tiny_tokenizer",
]
