"""``tokenmill eval perplexity`` against the same sliding-window perplexity computed by hand with
transformers on a tiny random model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from tokenmill_plugins.commands.eval.perplexity import PerplexityError, default_text, perplexity_windows, run_perplexity

from tests.factories import save_tiny_model
from tokenmill.cli import main
from tokenmill.config import load_config

_TEXT = "the quick brown fox jumps over the lazy dog while a small cat sleeps in the warm sun " * 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama-tiny", seed=3)


def _hf_perplexity(model_dir: Path, token_ids: list[int], context_length: int, stride: int) -> float:
    """Hugging Face's perplexity guide, transcribed: labels -100 for the tokens an earlier window scored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([token_ids])
    nll_sum, num_scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(token_ids), stride):
        end = min(begin + context_length, len(token_ids))
        target_len = end - prev_end
        input_ids = ids[:, begin:end]
        labels = input_ids.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(input_ids, labels=labels).loss
        num_valid = int((labels[:, 1:] != -100).sum())
        nll_sum += float(loss) * num_valid
        num_scored += num_valid
        prev_end = end
        if end == len(token_ids):
            break
    return math.exp(nll_sum / num_scored)


@pytest.mark.parametrize(("context_length", "stride"), [(32, 16), (40, 40), (512, 256)])
def test_matches_transformers_by_hand(tiny_model: Path, context_length: int, stride: int) -> None:
    from tokenmill.tokenizer import Tokenizer

    config = load_config(overrides={"model": {"model": str(tiny_model)}, "device": {"device": "cpu"}})
    result = run_perplexity(config, _TEXT, context_length=context_length, stride=stride)
    token_ids = Tokenizer.from_path(tiny_model).encode(_TEXT)
    assert result.num_tokens == len(token_ids) > context_length or context_length == 512
    expected = _hf_perplexity(tiny_model, token_ids, context_length, stride)
    assert result.perplexity == pytest.approx(expected, rel=1e-5)
    assert result.size_bytes == (tiny_model / "model.safetensors").stat().st_size
    assert result.quantization == "none"


def test_windows_score_each_token_once() -> None:
    for num_tokens, context_length, stride in [(100, 32, 16), (100, 32, 32), (5, 32, 16), (33, 32, 1)]:
        windows = perplexity_windows(num_tokens, context_length, stride)
        scored = [t for w in windows for t in range(w.first_scored, w.end)]
        unscored = {w.begin for w in windows} if stride == context_length else {0}  # tokens without context
        assert scored == [t for t in range(num_tokens) if t not in unscored]
        assert all(w.end - w.begin <= context_length and w.first_scored > w.begin for w in windows)


@pytest.mark.parametrize(
    ("args", "message"),
    [((1, 32, 16), "at least 2"), ((10, 32, 40), "--stride 40"), ((10, 1, 1), "--context-length 1")],
)
def test_bad_windows(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(PerplexityError, match=message):
        perplexity_windows(*args)


def test_default_text_is_bundled() -> None:
    text = default_text()
    assert len(text.split()) > 1500 and "Lighthouse" in text


def test_cli_json(tiny_model: Path, tmp_path: Path) -> None:
    text_file = tmp_path / "text.txt"
    text_file.write_text(_TEXT)
    result = CliRunner().invoke(
        main,
        ["eval", "perplexity", str(tiny_model), "--text", str(text_file), "--context-length", "32", "--json",
         "--device", "cpu"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["num_windows"] > 1 and report["stride"] == 16 and report["text"] == str(text_file)
    assert math.isclose(report["perplexity"], math.exp(-report["mean_logprob"]))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/model"], "Error: model '/nonexistent/model' not found"),
        (["--text", "/nonexistent.txt"], "does not exist"),
        (["--stride", "600"], "Error: --stride 600"),
    ],
)
def test_cli_errors_are_one_line(tiny_model: Path, args: list[str], message: str) -> None:
    model = [] if args[0].startswith("/nonexistent/") else [str(tiny_model)]
    result = CliRunner().invoke(main, ["eval", "perplexity", *model, *args, "--device", "cpu"])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1
