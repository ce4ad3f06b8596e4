"""Kernel tests run on CPU under the Triton interpreter when no GPU is visible.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, that
is when a kernel module is first imported. pytest imports this conftest before
the test modules of this folder, so setting it here, at import time, comes
first; the test modules import the kernel modules only after it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
