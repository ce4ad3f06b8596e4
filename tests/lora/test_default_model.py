"""A rank-16 PEFT adapter on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF), against PEFT over transformers'
own load of the same file.

The float path (``--quantization none``) holds the same dequantized float32 weights as transformers, and PEFT runs
in float64, so the logits differ only by tokenmill's own float32 rounding over 30 layers: measured 5.5e-5 at most
with the adapter (8.7e-5 on what the adapter adds), on logits up to about 40; the tolerance is the issue's 1e-4,
which a dense matmul summing all of K in one register (2.5e-4) fails. The default int4 path, with ``--lora-dtype
auto``'s float16 slots, is checked on what the adapter changes: measured 1.3% of the change at most."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.factories import make_engine
from tests.lora.conftest import ALL_TARGETS
from tokenmill import LoRARequest
from tokenmill.engine import EngineCore
from tokenmill.model_runner import SequenceChunk

pytestmark = pytest.mark.slow

PeftRun = tuple[Path, torch.Tensor, torch.Tensor]
# A chat prompt's first tokens ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...").
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> PeftRun:
    """The adapter's directory (random non-zero A and B on every target), and PEFT's logits for PROMPT with it and
    without it, computed in float64."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    config = LoraConfig(r=16, lora_alpha=32, target_modules=ALL_TARGETS, init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        directory = tmp_path_factory.mktemp("smollm2-adapter")
        model.save_pretrained(directory)
        model.double()  # the reference's own float32 rounding is not ours to match: compare against float64
        with_adapter = model(torch.tensor([PROMPT])).logits[0].float()
        with model.disable_adapter():
            without = model(torch.tensor([PROMPT])).logits[0].float()
    return directory, with_adapter, without


def _logits(engine: EngineCore, lora: LoRARequest | None) -> torch.Tensor:
    assert engine.lora is not None
    engine.lora.set_batch([lora], [len(PROMPT)])
    return engine.executor.runner.execute([SequenceChunk(PROMPT, 0, list(range(8)))], all_logits=True)


def test_the_float_path_gives_peft_logits(smollm2_gguf: Path, peft_run: PeftRun) -> None:
    directory, expected, peft_base = peft_run
    engine = make_engine(smollm2_gguf, model={"quantization": "none"}, lora={"enable_lora": True, "max_lora_rank": 16})
    assert engine.lora is not None and engine.lora.dtype == torch.float32
    lora = LoRARequest("a", 1, str(directory))
    engine.lora.add_adapter(lora)
    logits, base = _logits(engine, lora), _logits(engine, None)
    assert (expected - peft_base).abs().max() > 1.0  # the adapter moves the logits far past the tolerances
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    # What the adapter adds: the difference of two logits, each within 1e-4.
    torch.testing.assert_close(logits - base, expected - peft_base, atol=2e-4, rtol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_the_default_path_adds_what_peft_adds(smollm2_gguf: Path, peft_run: PeftRun) -> None:
    """int4 weights with int16 activations, and float16 slots: the adapter's change to the logits within 4% of
    PEFT's, and the greedy tokens PEFT picks."""
    directory, expected, peft_base = peft_run
    engine = make_engine(smollm2_gguf, lora={"enable_lora": True, "max_lora_rank": 16})
    assert engine.lora is not None and engine.lora.dtype == torch.float16
    lora = LoRARequest("a", 1, str(directory))
    engine.lora.add_adapter(lora)
    logits, base = _logits(engine, lora), _logits(engine, None)
    effect = expected - peft_base
    error = ((logits - base) - effect).abs().max().item()
    assert error < 0.04 * effect.abs().max().item(), error
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
