"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the same file.

Tolerance: both sides dequantize the same Q4_1 blocks with the same formula, so the float32 weights are identical,
and transformers runs in float64: the logits differ only by tokenmill's float32 rounding, accumulated over 30
layers. Measured: 4.9e-5 (the whole prompt) and 3.4e-5 (chunked prefill, then decode) max abs on logits of
magnitude up to ~42; transformers' own float32 logits are about 5.6e-5 off. We allow 1e-4, which a dense matmul
summing all of K in one register (1.8e-4) fails, and require the same greedy token at every position.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.config import load_config
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk

TOLERANCE = 1e-4

pytestmark = pytest.mark.slow

# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
#  <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n" and a few more tokens.
PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    20,
    18,
    11,
    3728,
    1789,
    30,
    2,
    198,
    1,
    520,
    9531,
    198,
]


@pytest.fixture(scope="module")
def models(smollm2_gguf: Path):
    from transformers import AutoModelForCausalLM

    # The float path: weights dequantized to float32, as transformers holds them. The default int4
    # path is checked against this one in tests/plugins/test_quantizers.py.
    overrides = {"model": {"model": str(smollm2_gguf), "quantization": "none"}, "device": {"device": "cpu"}}
    loaded = load_model(load_config(overrides=overrides))
    reference = (
        AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32)
        .eval()
        .double()
    )
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].float()  # [len(PROMPT), vocab]
    return loaded, expected


def test_architecture_read_from_gguf(models) -> None:
    loaded, _ = models
    arch = loaded.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_word_embeddings and arch.rope.theta == 100000.0 and arch.vocab_size == 49152


def test_full_forward_matches_transformers(models) -> None:
    loaded, expected = models
    logits = ModelRunner(loaded, num_blocks=8, block_size=16).execute(
        [SequenceChunk(PROMPT, 0, [5, 2, 7])], all_logits=True
    )
    torch.testing.assert_close(logits, expected, atol=TOLERANCE, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_chunked_prefill_then_decode_matches_transformers(models) -> None:
    loaded, expected = models
    runner = ModelRunner(loaded, num_blocks=8, block_size=16)
    blocks = [6, 0, 3]
    got = [runner.execute([SequenceChunk(PROMPT[:20], 0, blocks)])[0]]
    positions = [19]
    for position in range(20, len(PROMPT)):
        got.append(runner.execute([SequenceChunk([PROMPT[position]], position, blocks)])[0])
        positions.append(position)
    torch.testing.assert_close(torch.stack(got), expected[positions], atol=TOLERANCE, rtol=0)
