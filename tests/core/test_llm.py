"""The offline API on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.tokenizer.thinking_model import PROMPT_START, THINKING_OFF, save_thinking_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.sampling_params import InvalidRequestError

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a village by the sea,"]


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    return LLM(str(smollm2_gguf), device="cpu", kv_cache_memory="256MiB", max_num_batched_tokens=64)


def test_greedy_64_tokens_match_transformers(smollm2_gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    # The float path (weights dequantized, as transformers holds them) with the default attention
    # backend; the default int4 path is compared with this one in tests/plugins/test_quantizers.py.
    llm = LLM(str(smollm2_gguf), device="cpu", kv_cache_memory="256MiB", max_num_batched_tokens=64, quantization="none")
    # min_tokens bans EOS for 64 tokens, exactly what transformers' min_new_tokens does.
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, min_tokens=64), use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    for output in outputs:
        prompt = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            expected = reference.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, prompt.shape[1] :].tolist()


def test_outputs_in_prompt_order_with_text_and_reasons(llm: LLM) -> None:
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        (completion,) = output.outputs
        assert completion.finish_reason in ("stop", "length")
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert output.prompt_token_ids == llm.tokenizer.encode(output.prompt)


def test_logprobs_of_sampled_and_top_tokens(llm: LLM) -> None:
    (output,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        values = sorted((lp.logprob for lp in entry.values()), reverse=True)
        assert token_id in entry and 3 <= len(entry) <= 4
        assert entry[token_id].logprob == values[0]  # greedy picked the most likely token
        assert all(v <= 0 for v in values) and math.exp(values[0]) <= 1


def test_chat_applies_the_template(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    (output,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    expected_prompt = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    assert output.prompt == expected_prompt
    assert output.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in output.outputs[0].text
    assert output.outputs[0].finish_reason == "stop"  # ended by <|im_end|>, the chat's EOS


def test_chat_template_kwargs_over_the_configs_default(tmp_path: Path) -> None:
    model_dir = save_thinking_model(tmp_path / "thinking")
    llm = LLM(str(model_dir), device="cpu", num_kv_blocks=64, block_size=4,
              default_chat_template_kwargs={"persona": "a pirate"})  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1)
    conversation = [{"role": "user", "content": "hi"}]
    (plain,) = llm.chat(conversation, params, use_tqdm=False)
    assert plain.prompt == PROMPT_START + "As a pirate: "
    off = {"enable_thinking": False, "persona": "a parrot"}  # vLLM's argument, over the default key by key
    (thinking_off,) = llm.chat(conversation, params, use_tqdm=False, chat_template_kwargs=off)
    assert thinking_off.prompt == PROMPT_START + "As a parrot: " + THINKING_OFF
    assert thinking_off.prompt_token_ids == llm.tokenizer.encode(thinking_off.prompt, add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="^chat_template_kwargs cannot set 'messages'"):
        llm.chat(conversation, params, use_tqdm=False, chat_template_kwargs={"messages": []})


def test_stop_string_end_to_end(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (full,) = llm.generate(PROMPTS[1], params, use_tqdm=False)
    text = full.outputs[0].text
    stop = text[10:14]
    (stopped,) = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False
    )
    completion = stopped.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert llm.engine.kv_cache.usage == 0  # the aborted request freed its blocks


def test_n_seeded_completions(llm: LLM) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    first = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    second = llm.generate([PROMPTS[0], PROMPTS[2]], [SamplingParams(max_tokens=3), params], use_tqdm=False)[1]
    assert [c.index for c in first.outputs] == [0, 1]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert [c.token_ids for c in second.outputs] == [c.token_ids for c in first.outputs]


def test_unknown_setting_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'blok_size'"):
        LLM(blok_size=16)
