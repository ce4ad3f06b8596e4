"""Helpers shared by the speculator tests: an engine with a test speculator swapped in, sampled tokens, and a
chi-square test of two samples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenmill.engine import EngineCore
from tokenmill.messages import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.speculator import Speculator
from tokenmill.testing import make_engine, run_to_completion


def speculative_engine(
    model_path: Path, speculator: Speculator | None = None, **sections: dict[str, Any]
) -> EngineCore:
    """An engine with ``speculator`` in place of its own (none: no speculation), verifying every draft: the
    constant policy exercises the mechanics whatever pays."""
    spec: dict[str, Any] = {"method": "ngram", "draft_policy": "constant"} if speculator is not None else {}
    engine = make_engine(model_path, speculative_config=spec, **sections)
    if speculator is not None:  # in place of the ngram one, with its context (whether trees are verified, ...)
        proposer = engine.executor.proposer
        assert proposer is not None
        speculator.context = proposer.speculator.context
        proposer.speculator = speculator
    return engine


def chi_square_p(a: list[int], b: list[int], vocab_size: int) -> float:
    """p-value of Pearson's chi-square test that two samples of tokens come from one distribution."""
    counts = torch.stack([torch.bincount(torch.tensor(x), minlength=vocab_size) for x in (a, b)]).double()
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2))


def sampled_tokens(model: Path, speculator: Speculator | None, count: int, seed: int) -> list[list[int]]:
    """``count`` requests sampling 3 tokens at temperature 1 from one prompt: each one's tokens."""
    torch.manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    requests = [EngineCoreRequest(request_id=f"s{i}", prompt_token_ids=[3, 5, 7, 9], params=params, eos_token_ids=[],
                                  arrival_time=float(i)) for i in range(count)]  # fmt: skip
    limits = {"max_num_seqs": 512, "max_num_batched_tokens": 4096}
    engine = speculative_engine(model, speculator, scheduler=limits, cache={"num_kv_blocks": 2048})
    tokens = run_to_completion(engine, requests)
    return [tokens[r.request_id] for r in requests]
