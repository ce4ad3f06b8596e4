"""The engine on a CUDA GPU with its default settings, against transformers on the same GPU.

Marked ``gpu``; everything here skips without CUDA. Models: a tiny random Llama (always), and the models listed
in ``TOKENMILL_GPU_MODELS`` (paths separated by ``os.pathsep``: a Hugging Face directory or a ``.gguf`` file),
such as the default model's GGUF or the Llama-3-8B-shaped model ``scripts/gpu/make_llama3_8b.py`` writes.

Greedy output in bf16 matches transformers' up to the first near tie: where the two first differ, transformers'
own logits must rank tokenmill's token within ``near_tie`` of its top token. ``near_tie`` is 8 bf16 steps at the
top logit's magnitude (2**-5 of it, at least 2**-5): the logits of two bf16 implementations differ by a few
steps (transformers rounds its output projection to bf16), so a closer race may go either way. A wider bf16
margin still passes when the race is close in transformers' float32 logits, closer than twice transformers' own
bf16 error there: on a random Llama-3-8B-shaped model (flat logits, 32 layers of bf16 rounding) the first
divergence came at bf16 margins up to 0.19 with top logits near 5.2 (an H200, 2026-11-26).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from tokenmill.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the engine on a CUDA GPU"),
]

NUM_TOKENS = 32
PROMPT_LENS = (7, 31, 64, 130)


def near_tie(top_logit: float) -> float:
    return max(abs(top_logit), 1.0) * 2**-5


def _models() -> list[str]:
    listed = os.environ.get("TOKENMILL_GPU_MODELS", "")
    return ["tiny", *(path for path in listed.split(os.pathsep) if path)]


def test_defaults_pick_the_gpu_paths(tiny_model: Path) -> None:
    """``LLM(model)`` with nothing else set runs on CUDA in bf16 with the Triton kernels (attention and layer
    kernels) and decode graphs."""
    from tokenmill.llm import LLM

    llm = LLM(str(tiny_model), kv_cache_memory="1GiB")
    runner = llm.engine.executor.runner
    assert (runner.loaded.device.type, runner.loaded.dtype) == ("cuda", torch.bfloat16)
    assert runner.loaded.attention.name == "triton"
    assert runner.loaded.model.model.norm.layer_kernels.name == "triton"
    assert runner.cuda_graphs is not None


@pytest.mark.parametrize("model", _models())
def test_greedy_matches_transformers_up_to_a_near_tie(model: str, tiny_model: Path) -> None:
    from tokenmill_plugins.commands.bench.hf_baseline import HFModel

    from tokenmill.llm import LLM

    path = tiny_model if model == "tiny" else Path(model)
    llm = LLM(str(path), kv_cache_memory="4GiB")
    vocab_size = llm.engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, min(vocab_size, 30000)) for _ in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # one batch
    ours = [list(output.outputs[0].token_ids) for output in outputs]
    del llm, outputs
    torch.cuda.empty_cache()

    reference = HFModel.load(path, device="cuda", dtype="bfloat16").model
    report, close_races = [], []
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            result = reference.generate(
                torch.tensor([prompt], device="cuda"),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"),
                do_sample=False, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        theirs = result.sequences[0, len(prompt) :].tolist()
        parts = next((i for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), None)
        if parts is None:
            report.append(f"{len(prompt)}: all {NUM_TOKENS} equal")
            continue
        logits = result.logits[parts][0].float()  # transformers' logits where the two first differ
        margin, top = (logits.max() - logits[tokens[parts]]).item(), logits.max().item()
        report.append(f"{len(prompt)}: equal for {parts}, then bf16 margin {margin:.4f} (near tie {near_tie(top):.4f})")
        if margin > near_tie(top):
            close_races.append((prompt + tokens[:parts], tokens[parts], theirs[parts], logits, len(report) - 1))
    del reference
    torch.cuda.empty_cache()
    if close_races:
        _judge_in_float32(path, close_races, report)
    print(model, "; ".join(report))


def _judge_in_float32(path: Path, races: list, report: list[str]) -> None:
    """Where the bf16 margin is wider than ``near_tie``: the race must still be closer, in transformers' float32
    logits, than twice transformers' own bf16 error there (its largest over the float32 top 20 tokens). Then
    bf16 rounding alone, on either side, may decide it."""
    from tokenmill_plugins.commands.bench.hf_baseline import HFModel

    exact = HFModel.load(path, device="cuda", dtype="float32").model
    for context, ours, theirs, bf16_logits, line in races:
        with torch.inference_mode():
            logits = exact(torch.tensor([context], device="cuda"), logits_to_keep=1).logits[0, -1].float()
        noise = (bf16_logits - logits)[logits.topk(20).indices].abs().max().item()
        margin = abs(logits[ours] - logits[theirs]).item()
        report[line] += f"; float32 margin {margin:.4f}, transformers' bf16 error {noise:.4f}"
        assert margin <= 2 * noise, report
