"""The transformers baseline on a tiny random model: exact token counts, EOS ignored, threads restored."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from tokenmill_plugins.commands.bench.hf_baseline import (
    HFBaselineError,
    HFModel,
    check_transformers,
    run_hf_generate,
    run_hf_prefill,
)

from tests.factories import save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model("llama-tiny", directory, vocab_size=20000)  # the benchmark's prompt ids go up to 19999
    return directory


def test_batched_generate_makes_exactly_output_len_tokens_per_row(model_dir: Path) -> None:
    threads = torch.get_num_threads()
    result = run_hf_generate(model_dir, batch_size=3, input_len=8, output_len=5, seed=1, num_threads=1)
    assert torch.get_num_threads() == threads  # pinned for the measurement only
    assert (result["batch_size"], result["num_input_tokens"]) == (3, 24)
    assert (result["generated_tokens_per_row"], result["num_output_tokens"], result["num_generated_tokens"]) == (
        5,
        15,
        15,
    )
    assert result["output_throughput"] == pytest.approx(15 / result["duration_s"])
    assert result["ttft_ms"] is None and result["itl_ms"] is None  # per-token latency only for a single stream


def test_eos_cannot_end_a_row_early_and_mixed_rows_count_their_own_lengths(model_dir: Path) -> None:
    model = HFModel.load(model_dir, num_threads=1)
    prompt = [1000 + i for i in range(6)]
    with torch.inference_mode():
        first = int(model.model(input_ids=torch.tensor([prompt])).logits[0, -1].argmax())
    # The greedy first token is now EOS: only min_new_tokens keeps the row going.
    model.model.generation_config.eos_token_id = first
    single = model.generate([prompt], [4])
    assert (single["generated_tokens_per_row"], single["num_output_tokens"]) == (4, 4)
    assert single["ttft_ms"] > 0 and single["itl_ms"] is not None
    # A static batch: left-padded, every row runs to the longest output, only asked-for tokens count.
    mixed = model.generate([prompt, prompt[:3]], [2, 7])
    assert (mixed["generated_tokens_per_row"], mixed["num_output_tokens"], mixed["num_generated_tokens"]) == (7, 9, 14)
    assert mixed["output_throughput"] == pytest.approx(9 / mixed["duration_s"])


@pytest.mark.parametrize(("device", "calls"), [("cpu", 1), ("cuda", 2)])
def test_on_a_gpu_each_timed_generate_follows_an_untimed_one(
    device: str, calls: int, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The static cache compiles the forward per shape on a GPU: the timed call must not be the first."""
    model = HFModel(object(), model_dir, device, "bfloat16", None)
    seen: list[tuple[int, int]] = []

    def generate(prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
        seen.append((len(prompts), max_new_tokens))
        return 1.0, max_new_tokens

    monkeypatch.setattr(model, "_generate", generate)
    model.generate([[1, 2], [3]], [4, 4])
    assert seen == [(2, 4)] * calls


def test_prefill_times_one_forward(model_dir: Path) -> None:
    result = run_hf_prefill(model_dir, input_len=40, num_threads=1, num_iters=2)
    assert (result["input_len"], result["num_iters"], len(result["iteration_s"])) == (40, 2, 2)
    assert result["prefill_throughput"] == pytest.approx(40 / result["prefill_s"])


def test_missing_transformers_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails, find_spec says absent
    for call in (check_transformers, lambda: HFModel.load(model_dir)):
        with pytest.raises(HFBaselineError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message and "pip install transformers" in message and "--no-hf-baseline" in message


def test_unloadable_model_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HFBaselineError, match="could not load") as error:
        HFModel.load(tmp_path)
    assert "\n" not in str(error.value)


def test_loads_an_asymmetric_compressed_tensors_checkpoint_as_its_tool_runs_it() -> None:
    """transformers refuses llm-compressor's asymmetric W4A16 unless it decompresses at load; decompressed, it
    gives the logits llm-compressor's environment stored."""
    from safetensors.torch import load_file

    checkpoint = Path(__file__).parents[1] / "models" / "quantized" / "checkpoints" / "ct-w4a16-asym-awq"
    model = HFModel.load(checkpoint)
    reference = load_file(checkpoint / "reference.safetensors")
    prompt = [17, 260, 301, 45, 99, 400, 12, 7, 388, 261, 262, 263]  # make_checkpoints.PROMPTS[0]
    with torch.no_grad():
        logits = model.model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, reference["logits.0"], atol=1e-5, rtol=0)


def test_keeps_activation_quantization_of_w8a8_and_fp8_checkpoints() -> None:
    """Decompressing at load would drop their int8 / FP8 activation rounding; the reference must keep it.

    The stored logits are matched to 5e-2: activations that land next to a rounding boundary of int8 or FP8
    round differently with the CPU and torch's thread count, which changes the order of float sums (up to
    2.5e-3 seen on a Sapphire Rapids Xeon; 2.5e-2 for int8 with one thread instead of two), while the
    decompressed model, whose activations stay float, is off by over 0.1 on both checkpoints."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    prompt = torch.tensor([[17, 260, 301, 45, 99, 400, 12, 7, 388, 261, 262, 263]])
    for name in ("ct-w8a8-int8", "ct-fp8-dynamic"):
        checkpoint = Path(__file__).parents[1] / "models" / "quantized" / "checkpoints" / name
        reference = load_file(checkpoint / "reference.safetensors")["logits.0"]
        decompressed = AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
        )
        with torch.no_grad():
            error = (HFModel.load(checkpoint).model(prompt).logits[0] - reference).abs().max().item()
            dropped = (decompressed.eval()(prompt).logits[0] - reference).abs().max().item()
        assert error < 5e-2 < 0.1 < dropped, (name, error, dropped)
