"""Every architecture's greedy tokens against transformers' float32 greedy decoding, up to a near tie: through
``LLM`` alone and batched, and through ``tokenmill serve`` with the official ``openai`` client, one request at a
time and all at once.

A near tie is where transformers' best two logits are within ``NEAR_TIE``: there tokenmill's float sums, added in
another order, may pick the other token, and the two continuations part from there on, so the comparison ends.
The logits themselves are held to 1e-4 in ``test_reference_match``.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.factories import TINY_CONFIGS, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.outputs import CompletionOutput

pytestmark = pytest.mark.multiproc

NEAR_TIE = 1e-3
MAX_TOKENS = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(length)] for length in (5, 17, 9)]


def _transformers_greedy(directory: Path, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens (EOS ignored) and its logits before each."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
            output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def _assert_greedy_equal(got: list[int], expected: list[int], logits: list[torch.Tensor]) -> None:
    """``got`` equals ``expected`` up to the first position where transformers' best two are a near tie."""
    for position, (token, reference) in enumerate(zip(got, expected, strict=True)):
        if token != reference:
            margin = (logits[position][reference] - logits[position][token]).item()
            assert margin <= NEAR_TIE, f"token {position}: {token} where transformers picks {reference} by {margin}"
            return


@dataclass
class Case:
    """One architecture's tiny model, transformers' greedy tokens and logits per prompt, and ``LLM``'s outputs."""

    directory: Path
    references: list[tuple[list[int], list[torch.Tensor]]]
    alone: list[CompletionOutput]
    batched: list[CompletionOutput]


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    directory = save_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    references = [_transformers_greedy(directory, prompt) for prompt in _prompts()]
    llm = LLM(str(directory), device="cpu", kv_cache_memory="64MiB")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": prompt} for prompt in _prompts()]
    alone = [llm.generate([request], params, use_tqdm=False)[0].outputs[0] for request in requests]
    batched = [output.outputs[0] for output in llm.generate(requests, params, use_tqdm=False)]
    return Case(directory, references, alone, batched)


def test_llm_alone_and_batched(case: Case) -> None:
    for output in (*case.alone, *case.batched):
        assert len(output.token_ids) == MAX_TOKENS
    for output, (expected, logits) in zip([*case.alone, *case.batched], case.references * 2, strict=True):
        _assert_greedy_equal(list(output.token_ids), expected, logits)


def test_server_alone_and_concurrently(case: Case, tokenmill_server: Any) -> None:
    """The server's texts equal ``LLM``'s (whose tokens are checked against transformers above; the prompts are
    random bytes, so texts, decoded with the prompts' last tokens as context, are compared rather than re-decoded
    tokens)."""
    texts = [output.text for output in case.alone]
    server = tokenmill_server("--kv-cache-memory", "64MiB", model=case.directory)
    extra = {"ignore_eos": True}
    alone = [
        server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        .choices[0]
        .text
        for prompt in _prompts()
    ]
    assert alone == texts

    async def concurrently() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        responses = await asyncio.gather(*(
            client.completions.create(model=server.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=extra)
            for p in _prompts() * 2
        ))  # fmt: skip
        return [response.choices[0].text for response in responses]

    assert asyncio.run(concurrently()) == texts * 2
