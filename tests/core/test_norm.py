"""RMSNorm against transformers' own (LlamaRMSNorm) in every dtype the engine computes in."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tokenmill.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_transformers(dtype: torch.dtype) -> None:
    """bf16/fp16: normalised in float32, rounded, then scaled in the half dtype, as transformers does; on the CPU
    the same operations, so the same bits."""
    torch.manual_seed(0)
    x = (3 * torch.randn(7, 64)).to(dtype)  # [tokens, hidden]
    weight = (1 + 0.1 * torch.randn(64)).to(dtype)
    ours, theirs = RMSNorm(64, 1e-5, dtype), LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    expected = theirs(x)
    assert ours(x).dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(ours(x), expected)
