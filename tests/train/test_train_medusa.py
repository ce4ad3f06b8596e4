"""``tokenmill train medusa``: heads trained on a tiny model's own answers load back in the published layout, and
the engine accepts their drafts far more often than those of untrained heads; bad input fails in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tokenmill_plugins.commands.train.medusa import MedusaTrainingOptions, read_prompts, train_medusa
from tokenmill_plugins.speculators.medusa import MedusaSpeculator
from tokenmill_plugins.speculators.medusa_heads import write_medusa_heads

from tokenmill.cli import main
from tokenmill.config import load_config
from tokenmill.llm import LLM
from tokenmill.model_loader import load_model
from tokenmill.plugin_manager import resolve_plugins
from tokenmill.sampling_params import SamplingParams
from tokenmill.speculative.draft_tree import parse_token_tree
from tokenmill.speculative.speculator import SpeculatorContext

MAX_NEW_TOKENS = 24


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run faster on one thread (and `--num-threads 1` sets it for the whole process); restored."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(read_prompts()[:12]) + "\n")
    return path


def _acceptance(model_dir: Path, heads_dir: Path, prompts: list[str], tree: str | None = None) -> tuple[float, float]:
    """Accepted drafts per draft, and per verification, when the engine answers ``prompts`` greedily with
    these heads (and ``tree`` as speculative_token_tree)."""
    llm = LLM(
        str(model_dir),
        device="cpu",
        num_threads=1,
        # Every step drafts k tokens for every request: the goodput policy would draft by measured timings.
        speculative_config={
            "method": "medusa",
            "model": str(heads_dir),
            "draft_policy": "constant",
            "speculative_token_tree": tree,
        },  # fmt: skip
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS)
    llm.chat([[{"role": "user", "content": prompt}] for prompt in prompts], params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    accepted = stats.spec_decode_num_accepted_tokens
    return accepted / stats.spec_decode_num_draft_tokens, accepted / stats.spec_decode_num_drafts


def test_trained_heads_load_and_their_drafts_are_accepted(
    tiny_model_dir: Path, prompts_file: Path, tmp_path: Path, one_thread: None
) -> None:
    output = tmp_path / "heads"
    args = [
        "train", "medusa", str(tiny_model_dir), "--output", str(output), "--prompts", str(prompts_file),
        "--num-heads", "2", "--num-layers", "2", "--max-new-tokens", str(MAX_NEW_TOKENS), "--epochs", "20",
        "--batch-size", "32",
        "--lr", "1e-2", "--held-out", "0.25", "--no-progress", "--device", "cpu", "--num-threads", "1",
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "held-out top-1 accuracy" in result.output.splitlines()[-1]

    config = json.loads((output / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 2
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    assert (config["hidden_size"], config["vocab_size"], config["version"]) == (64, 512, "2")
    tensors = load_file(str(output / "medusa_lm_head.safetensors"))
    assert sorted(tensors) == [
        f"{h}.{layer}.linear.{kind}" for h in (0, 1) for layer in (0, 1) for kind in ("bias", "weight")
    ]
    assert tensors["0.0.linear.weight"].abs().sum() > 0  # trained away from the zero start

    # The tokens the heads learnt to predict, most frequent first: the drafts come from them.
    draft_vocab = config["draft_vocab"]
    assert 0 < len(draft_vocab) <= 8192 and len(set(draft_vocab)) == len(draft_vocab)
    assert "a draft vocabulary of" in result.output.splitlines()[-1]
    # The draft tree the held-out answers would have accepted most of: likeliest nodes first, parents first.
    tree = [tuple(node) for node in config["medusa_choices"]]
    assert 0 < len(tree) <= 16 and tree[0] == (0,) and parse_token_tree(str(tree)) == tuple(tree)
    assert "with a tree of" in result.output.splitlines()[-1]

    # On the answers it was trained on, the engine accepts the heads' drafts far more often than the drafts of
    # untrained heads (the model's own lm_head guessing one token further ahead).
    untrained = tmp_path / "untrained"
    write_medusa_heads(untrained, torch.zeros(2, 1, 64, 64), torch.zeros(2, 1, 64), {"vocab_size": 512})
    prompts = read_prompts(prompts_file)
    chain = "[(0,), (0, 0)]"
    trained_rate, trained_per_step = _acceptance(tiny_model_dir, output, prompts, chain)
    untrained_rate, _ = _acceptance(tiny_model_dir, untrained, prompts)
    assert trained_rate > max(0.15, 2 * untrained_rate), (trained_rate, untrained_rate)
    # The stored tree (used when none is configured) gets more accepted per step than the chain of top-1s.
    _, tree_per_step = _acceptance(tiny_model_dir, output, prompts)
    assert tree_per_step > trained_per_step, (tree_per_step, trained_per_step)


def test_saved_projection_is_the_lm_head_and_shared(
    tiny_model_dir: Path, prompts_file: Path, tmp_path: Path, one_thread: None
) -> None:
    config = load_config(
        overrides={"model": {"model": str(tiny_model_dir)}, "device": {"device": "cpu", "num_threads": 1}}
    )
    options = MedusaTrainingOptions(
        num_heads=2,
        num_layers=1,
        prompts=prompts_file,
        max_new_tokens=8,
        epochs=1,
        save_projection=True,
        progress=False,
    )
    result = train_medusa(config, tmp_path / "heads", options)
    assert len(result.accuracies) == 2 and result.num_held_out_positions > 0

    tensors = load_file(str(tmp_path / "heads" / "medusa_lm_head.safetensors"))
    lm_head = load_file(str(tiny_model_dir / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(tensors["0.1.weight"], lm_head) and torch.equal(tensors["1.1.weight"], lm_head)
    assert "version" not in json.loads((tmp_path / "heads" / "config.json").read_text())

    serving = load_config(
        overrides={
            "model": {"model": str(tiny_model_dir)},
            "device": {"device": "cpu"},
            "speculative_config": {"method": "medusa", "model": str(tmp_path / "heads")},
        }
    )
    plugins = resolve_plugins(serving)
    speculator = MedusaSpeculator(3, SpeculatorContext(serving, load_model(serving, plugins), plugins, 4, 64))
    assert speculator.num_speculative_tokens == 2
    assert speculator.shared_heads == [0, 1]


def test_bundled_prompts() -> None:
    prompts = read_prompts()
    assert 100 <= len(prompts) <= 200
    assert len(set(prompts)) == len(prompts)


def _tokenmill(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True)


def test_bad_input_is_a_one_line_error(tmp_path: Path, prompts_file: Path) -> None:
    missing = _tokenmill("train", "medusa", str(tmp_path / "no-such-model"), "--output", str(tmp_path / "out"))
    assert missing.returncode == 1
    assert missing.stderr.startswith("Error: ") and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert not (tmp_path / "out").exists()

    heads = _tokenmill("train", "medusa", "--output", str(tmp_path / "out"), "--num-heads", "0")
    assert heads.returncode == 2
    assert "Error: Invalid value for '--num-heads': 0 is not in the range x>=1." in heads.stderr.splitlines()

    one_prompt = tmp_path / "one.txt"
    one_prompt.write_text("Only one prompt.\n")
    few = _tokenmill("train", "medusa", "--output", str(tmp_path / "out"), "--prompts", str(one_prompt))
    assert few.returncode == 1
    assert few.stderr.strip() == f"Error: {one_prompt}: need at least 2 prompts (one line each), found 1"


def test_flag_defaults_are_the_options_defaults() -> None:
    """The command's defaults are written out (so `--help` needs no torch); they must be the library's."""
    from tokenmill_plugins.commands.train.cli import medusa

    defaults = {param.name: param.default for param in medusa.params}
    names = (
        "num_heads",
        "num_layers",
        "max_new_tokens",
        "temperature",
        "num_sampled_answers",
        "sample_temperature",
        "epochs",
        "batch_size",
        "lr",
        "held_out",
        "seed",
        "tree_nodes",
        "draft_vocab_size",
    )
    for name in names:
        assert defaults[name] == getattr(MedusaTrainingOptions(), name), name


def test_labels_are_the_models_greedy_choices(tiny_model_dir: Path, one_thread: None) -> None:
    """Head i at position p learns transformers' argmax at p + 1 + i over the same (here random, as if sampled)
    answer: an offset off by one, or the answer's own tokens, would differ on almost every position."""
    from tokenmill_plugins.commands.train.medusa import _IGNORE, _hidden_states
    from transformers import AutoModelForCausalLM

    config = load_config(overrides={"model": {"model": str(tiny_model_dir)}, "device": {"device": "cpu"}})
    loaded = load_model(config)
    generator = torch.Generator().manual_seed(0)
    token_ids = torch.randint(0, 512, (30,), generator=generator).tolist()
    num_prompt = 10
    _, targets, _ = _hidden_states(loaded, [(token_ids, num_prompt)], num_heads=2, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        choices = reference(torch.tensor([token_ids])).logits[0].argmax(-1)  # [seq_len]: choice for position q + 1
    positions = range(num_prompt - 1, len(token_ids) - 2)
    assert targets.shape == (len(positions), 2)
    for row, p in enumerate(positions):
        for head in range(2):
            expected = int(choices[p + 1 + head]) if p + 2 + head < len(token_ids) else _IGNORE
            assert int(targets[row, head]) == expected, (p, head)
    assert sum(int(targets[row, 0]) == token_ids[p + 2] for row, p in enumerate(positions)) < len(positions) / 2


def test_held_out_prompts_are_out_of_training_with_all_their_answers() -> None:
    """Answer j answers prompt j % 4 (a greedy answer, then 2 sampled rounds); 3 rows per answer."""
    from tokenmill_plugins.commands.train.medusa import _split

    sequence_of_row = torch.arange(12).repeat_interleave(3)  # 12 answers = 4 prompts x 3
    train_rows, held_out_rows = _split(sequence_of_row, 4, MedusaTrainingOptions(held_out=0.25))
    held_out_answers = set(sequence_of_row[held_out_rows].tolist())
    assert len(held_out_answers) == 1 and next(iter(held_out_answers)) < 4  # the held-out prompt's first answer
    prompt = next(iter(held_out_answers))
    assert {int(a) % 4 for a in sequence_of_row[train_rows]} == {0, 1, 2, 3} - {prompt}
    assert len(train_rows) == 3 * 3 * 3  # every answer of the 3 other prompts


def test_draft_vocabulary_is_the_most_frequent_labels_and_its_held_out_coverage() -> None:
    from tokenmill_plugins.commands.train.medusa import _IGNORE, _draft_vocab

    train = torch.tensor([[5, 5], [5, 7], [9, _IGNORE], [7, 5], [2, _IGNORE]])  # 5 x4, 7 x2, 9 and 2 once
    held_out = torch.tensor([5, 9, 3, _IGNORE])
    assert _draft_vocab(train, held_out, 2) == ([5, 7], pytest.approx(1 / 3))
    vocab, coverage = _draft_vocab(train, held_out, 100)  # only tokens that occur
    assert sorted(vocab) == [2, 5, 7, 9] and vocab[0] == 5 and coverage == pytest.approx(2 / 3)


def test_heads_learn_and_are_measured_over_the_draft_vocabulary() -> None:
    """With a draft vocabulary the heads score its tokens only, as the speculator serves them: targets become
    positions in it, a token it lacks is never learnt and always counts as a miss."""
    from tokenmill_plugins.commands.train.medusa import (
        _IGNORE,
        _OUTSIDE,
        _evaluate,
        _Heads,
        _in_draft_vocab,
        _Projection,
    )

    targets = torch.tensor([[7, 3], [4, _IGNORE], [9, 9]])
    assert _in_draft_vocab(targets, [7, 9, 4], 10).tolist() == [[0, _OUTSIDE], [2, _IGNORE], [1, 1]]
    # Untrained heads (zero ResBlocks) score the hidden state against the draft vocabulary's rows: one-hot hidden
    # states pick rows 0, 2 and 1, every head 0 target; head 1 has a token outside (a miss) and row 1 (right).
    hidden = torch.eye(3)[[0, 2, 1]]
    projection = _Projection(torch.eye(3))
    mapped = _in_draft_vocab(targets, [7, 9, 4], 10)
    accuracies, _ = _evaluate(_Heads(2, 1, 3), projection, hidden, mapped)
    assert accuracies == [1.0, pytest.approx(1 / 2)]
