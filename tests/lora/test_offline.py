"""Offline adapters as vLLM takes them: ``LLM(enable_lora=True)``, ``generate(..., lora_request=...)``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.sampling_params import InvalidRequestError


def test_generate_with_one_adapter_or_one_per_prompt(lora_model_dir: Path, adapters: list[Path]) -> None:
    llm = LLM(str(lora_model_dir), enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32",
              device="cpu", block_size=4, num_kv_blocks=128)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a, b = LoRARequest("a", 1, str(adapters[0])), LoRARequest("b", 2, str(adapters[1]))
    prompts = ["hello there", "hello there", "hello there"]
    with_a = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False, lora_request=a)]
    mixed = llm.generate(prompts, params, use_tqdm=False, lora_request=[a, b, None])
    base = llm.generate(prompts[:1], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in mixed]
    assert tokens[0] == with_a[0]
    assert tokens[2] == base[0].outputs[0].token_ids
    assert len({tuple(t) for t in tokens}) == 3
    with pytest.raises(InvalidRequestError, match="got 2 LoRA requests for 3 prompts"):
        llm.generate(prompts, params, use_tqdm=False, lora_request=[a, b])
