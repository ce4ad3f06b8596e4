"""Speculative decoding through the server: vLLM's --speculative-config, the official openai client, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.cli_errors import serve_error
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.testing.server import TokenmillServer, start_server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PROMPT = "Repeat exactly: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."


@pytest.fixture(scope="module")
def ngram_server(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[TokenmillServer]:
    server = start_server(
        tmp_path_factory.mktemp("spec-server"), str(smollm2_gguf), "--kv-cache-memory", "256MiB",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}',
    )  # fmt: skip
    yield server
    server.stop()


def test_streamed_greedy_chat_equals_plain_decoding_and_the_metrics_move(
    ngram_server: TokenmillServer, smollm2_gguf: Path
) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    plain = LLM(str(smollm2_gguf), device="cpu", kv_cache_memory="128MiB")
    expected = plain.chat(messages, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0].text

    client = openai.OpenAI(base_url=f"{ngram_server.url}/v1", api_key="none", max_retries=0, timeout=120)
    before = ngram_server.metrics()
    stream = client.chat.completions.create(
        model=ngram_server.model,
        messages=messages,
        max_tokens=48,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == expected
    after = ngram_server.metrics()
    accepted = "tokenmill:spec_decode_num_accepted_tokens_total"
    assert after["tokenmill:spec_decode_num_drafts_total"] > before.get("tokenmill:spec_decode_num_drafts_total", 0)
    assert after[accepted] > before.get(accepted, 0)
    assert any(key.startswith("tokenmill:spec_decode_num_accepted_tokens_per_pos_total") for key in after)

    # A request may opt out (vLLM's vllm_xargs carries the flag): same text, no drafts.
    before = ngram_server.metrics()
    response = client.chat.completions.create(
        model=ngram_server.model, messages=messages, max_tokens=48, temperature=0,  # type: ignore[arg-type]
        extra_body={"vllm_xargs": {"disable_speculation": True}},
    )  # fmt: skip
    assert response.choices[0].message.content == expected
    assert (
        ngram_server.metrics()["tokenmill:spec_decode_num_drafts_total"]
        == before["tokenmill:spec_decode_num_drafts_total"]
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"method": "ngram", "bogus": 1}', "unknown setting 'speculative_config.bogus'"),
        ('{"method": "medusa"}', "method 'medusa' needs model"),
        ('{"method": "nope"}', "speculative_config.method: unknown speculator 'nope'"),
        ('{"method": ', "not valid JSON"),
    ],
)
def test_a_bad_speculative_config_is_one_line_before_the_model_loads(config: str, message: str) -> None:
    assert message in serve_error("--speculative-config", config)
