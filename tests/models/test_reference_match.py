"""The Llama family against Hugging Face transformers on the same weights (float32).

Logits of a full forward, and of chunked prefill plus step-by-step decode
through the paged KV cache batched with other requests, must match within 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.factories import TINY_CONFIGS, save_hf_model
from tokenmill.config import load_config
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk

TOLERANCE = 1e-4
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def model_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(request.param, directory)
    loaded = load_model(load_config(overrides={"model": {"model": str(directory)}, "device": {"device": "cpu"}}))
    return hf_model, loaded


def _hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()  # [seq_len, vocab]


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lengths]


def test_full_forward_matches_transformers(model_pair) -> None:
    hf_model, loaded = model_pair
    prompts = _prompts([23, 5, 40], seed=1)
    runner = ModelRunner(loaded, num_blocks=64, block_size=BLOCK_SIZE)
    # Disjoint block ranges per request, all prompts in one flattened batch.
    chunks, next_block = [], 0
    for prompt in prompts:
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        chunks.append(SequenceChunk(prompt, 0, list(range(next_block, next_block + num_blocks))))
        next_block += num_blocks
    logits = runner.execute(chunks, all_logits=True)
    start = 0
    for prompt in prompts:
        expected = _hf_logits(hf_model, prompt)
        torch.testing.assert_close(logits[start : start + len(prompt)], expected, atol=TOLERANCE, rtol=0)
        start += len(prompt)


def test_chunked_prefill_and_paged_decode_match_transformers(model_pair) -> None:
    """Two requests with shuffled, interleaved blocks: chunked prefill, then decode one token a step."""
    hf_model, loaded = model_pair
    runner = ModelRunner(loaded, num_blocks=40, block_size=BLOCK_SIZE)
    first, second = _prompts([30, 26], seed=2)
    blocks = list(range(40))
    random.Random(3).shuffle(blocks)
    tables = [blocks[0:16:2], blocks[1:16:2]]  # interleaved and out of order
    expected = [_hf_logits(hf_model, first), _hf_logits(hf_model, second)]
    # Step 1: a 7-token chunk of the first prompt only. Step 2: the rest of the first prompt's
    # first 12 tokens with a 9-token chunk of the second. Then both advance a token per step.
    progress = [0, 0]
    schedule = [[7, 0], [5, 9]] + [[1, 1]] * 17
    got: list[list[torch.Tensor]] = [[], []]
    for step in schedule:
        chunks, owners = [], []
        for i, count in enumerate(step):
            if count == 0:
                continue
            prompt = (first, second)[i]
            chunks.append(SequenceChunk(prompt[progress[i] : progress[i] + count], progress[i], tables[i]))
            owners.append(i)
        logits = runner.execute(chunks)  # last token of each chunk
        for row, i in enumerate(owners):
            progress[i] += step[i]
            got[i].append((progress[i] - 1, logits[row]))
    for i in range(2):
        for position, row_logits in got[i]:
            torch.testing.assert_close(row_logits, expected[i][position], atol=TOLERANCE, rtol=0)
    assert progress == [29, 26]
