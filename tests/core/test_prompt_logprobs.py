"""vLLM's ``prompt_logprobs``: every prompt token's logprob, rank and top alternatives under the model, against
transformers on the same weights, through chunked prefill, a batch of other requests and a cached prefix."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.factories import make_engine, save_hf_model
from tokenmill.engine import EngineCore, now
from tokenmill.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from tokenmill.sampling_params import InvalidRequestError, SamplingParams

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    directory = tmp_path_factory.mktemp("llama")
    return save_hf_model("llama-tiny", directory), directory


def _run(engine: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {request.request_id: [] for request in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def _expected(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)  # row p scores token p + 1


def _check(entries: list[TokenLogprobs], expected: torch.Tensor, prompt: list[int], num_top: int) -> None:
    assert [entry.token_id for entry in entries] == prompt[1:]  # token 0 has nothing before it
    for position, entry in enumerate(entries):
        row = expected[position]
        assert abs(entry.logprob - row[prompt[position + 1]].item()) < TOLERANCE
        assert entry.rank == int((row > row[prompt[position + 1]]).sum()) + 1
        top_values, top_ids = row.topk(num_top)
        assert list(entry.top_token_ids) == top_ids.tolist()
        torch.testing.assert_close(torch.tensor(entry.top_logprobs), top_values, atol=TOLERANCE, rtol=0)


def test_prompt_logprobs_match_transformers_through_chunks_batching_and_a_cached_prefix(model) -> None:  # type: ignore[no-untyped-def]
    hf_model, directory = model
    rng = random.Random(3)
    prompt = [rng.randrange(512) for _ in range(45)]
    other = [rng.randrange(512) for _ in range(30)]
    # A 16-token step budget splits the prompt into chunks, batched with another request's prefill.
    engine = make_engine(directory, scheduler={"max_num_batched_tokens": 16})
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    warm = EngineCoreRequest("warm", prompt[:32], SamplingParams(temperature=0, max_tokens=1), [], now())
    _run(engine, [warm])  # caches the first 32 tokens: the request below must not reuse them without logits
    requests = [
        EngineCoreRequest("scored", prompt, params, [], now()),
        EngineCoreRequest("plain", other, SamplingParams(temperature=0, max_tokens=3), [], now()),
    ]
    outputs = _run(engine, requests)
    first = outputs["scored"][0]
    assert first.new_token_ids and first.prompt_logprobs is not None
    assert all(output.prompt_logprobs is None for output in outputs["scored"][1:])  # sent once, with token 1
    assert all(output.prompt_logprobs is None for output in outputs["plain"])
    _check(first.prompt_logprobs, _expected(hf_model, prompt), prompt, num_top=3)


def test_prompt_logprobs_survive_preemption(model) -> None:  # type: ignore[no-untyped-def]
    hf_model, directory = model
    rng = random.Random(4)
    prompts = [[rng.randrange(512) for _ in range(40)] for _ in range(6)]
    # 30 blocks of 4 tokens cannot hold six 40-token prompts growing by 40 tokens each: some are preempted.
    engine = make_engine(directory, cache={"num_kv_blocks": 30}, scheduler={"max_num_batched_tokens": 32})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=0)
    requests = [EngineCoreRequest(str(i), p, params, [], now()) for i, p in enumerate(prompts)]
    outputs = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        reported = [output.prompt_logprobs for output in outputs[str(i)] if output.prompt_logprobs is not None]
        assert len(reported) == 1
        _check(reported[0], _expected(hf_model, prompt), prompt, num_top=0)


def test_prompt_logprobs_out_of_range_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs=21"):
        SamplingParams(prompt_logprobs=21)
