"""The ``medusa`` speculator: heads in FasterDecoding's published layout load and draft what their weights imply,
the target's lm_head stands in for a head's projection only when the two are equal, and a checkpoint for
another model fails with one line.

Checkpoints are written here with ``safetensors`` from a module built the way FasterDecoding's
``medusa_model.py`` builds its heads (``nn.Sequential(*[ResBlock] * L, nn.Linear(hidden, vocab, bias=False))``
in an ``nn.ModuleList``), so the tensor names are the ones ``state_dict()`` gives that structure.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenmill_plugins.speculators.medusa import MedusaSpeculator, _FloatResBlocks, _QuantizedResBlocks
from tokenmill_plugins.speculators.medusa_heads import apply_resblocks
from torch import nn

from tokenmill.config import ConfigError, EngineConfig, load_config
from tokenmill.model_loader import LoadedModel, load_model
from tokenmill.plugin_manager import Slot, resolve_plugins
from tokenmill.speculative.speculator import Proposal, SpeculationInput, SpeculatorContext
from tokenmill.testing import check_speculator, make_engine, run_to_completion, save_tiny_model
from tokenmill.weights.format import WeightsError

HIDDEN = 64  # the tiny models' hidden size
VOCAB = 512  # and vocabulary
BLOCK_SIZE = 4


class _ResBlock(nn.Module):
    """FasterDecoding's ResBlock: ``x + SiLU(Linear(x))``, the linear with a bias."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def _reference_heads(num_heads: int, num_layers: int, seed: int = 0, vocab: int = VOCAB) -> nn.ModuleList:
    """Medusa-1 heads as FasterDecoding's module tree holds them, with random weights."""
    torch.manual_seed(seed)
    heads = nn.ModuleList(
        nn.Sequential(*[_ResBlock(HIDDEN) for _ in range(num_layers)], nn.Linear(HIDDEN, vocab, bias=False))
        for _ in range(num_heads)
    )
    with torch.no_grad():
        for param in heads.parameters():
            param.copy_(0.3 * torch.randn_like(param))
    return heads


def _write(directory: Path, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file({key: value.detach().contiguous().clone() for key, value in tensors.items()},
              str(directory / "medusa_lm_head.safetensors"))  # fmt: skip
    num_heads = 1 + max(int(key.split(".")[0]) for key in tensors if key[0].isdigit())
    settings = {"medusa_num_heads": num_heads, "medusa_num_layers": 1, "base_model_name_or_path": "tiny", **config}
    (directory / "config.json").write_text(json.dumps(settings))
    return directory


def _config(
    model_dir: Path, heads_dir: Path, k: int | None = None, tree: str | None = None,
    heads_quantization: str | None = None, **model: Any,
) -> EngineConfig:  # fmt: skip
    spec = {"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": k, "speculative_token_tree": tree,
            "quantization": heads_quantization}  # fmt: skip
    return load_config(
        overrides={"model": {"model": str(model_dir), **model}, "device": {"device": "cpu"}, "speculative_config": spec}
    )


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose lm_head is its embedding: ``compute_logits`` is a float matmul with it."""
    return save_tiny_model(tmp_path_factory.mktemp("tied"), "llama-tied")


@pytest.fixture(scope="module")
def target(tied_dir: Path) -> LoadedModel:
    return load_model(_config(tied_dir, tied_dir))


Factory = Callable[..., MedusaSpeculator]


@pytest.fixture
def make(tied_dir: Path, target: LoadedModel) -> Factory:
    """``make(heads_dir, k=None, cls=MedusaSpeculator, tree=None, verifies_trees=True, quantization="none")``: the
    speculator as the engine builds it over ``target``, with float heads unless told otherwise (the tests compare
    its drafts with FasterDecoding's float module)."""

    def build(
        heads_dir: Path,
        k: int | None = None,
        cls: type[MedusaSpeculator] = MedusaSpeculator,
        tree: str | None = None,
        verifies_trees: bool = True,
        quantization: str | None = "none",
    ) -> MedusaSpeculator:
        config = _config(tied_dir, heads_dir, k, tree, heads_quantization=quantization)
        context = SpeculatorContext(config, target, resolve_plugins(config), BLOCK_SIZE, 64, verifies_trees)
        return cls(k or cls.default_num_speculative_tokens, context)

    return build


def _inputs(hidden: torch.Tensor, max_num_tokens: list[int] | None = None) -> list[SpeculationInput]:
    limits = max_num_tokens or [8] * len(hidden)
    return [
        SpeculationInput(f"r{i}", [1, 2, 3], 2, limit, state)
        for i, (state, limit) in enumerate(zip(hidden, limits, strict=True))
    ]


def _hidden(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))  # [n, hidden]


def _embedding(target: LoadedModel) -> torch.Tensor:
    return target.model.model.embed_tokens.weight.detach()  # type: ignore[union-attr]  # [vocab, hidden]


def test_registered_as_medusa(make: Factory, tmp_path: Path) -> None:
    speculator = make(_write(tmp_path, {"0.0.weight": torch.zeros(VOCAB, HIDDEN)}, medusa_num_layers=0))
    assert speculator.context is not None
    assert speculator.context.plugins.load(Slot.SPECULATOR, "medusa") is MedusaSpeculator
    assert MedusaSpeculator.needs_hidden_states


def test_known_weights_draft_the_tokens_they_imply(make: Factory, tmp_path: Path) -> None:
    """Zero ResBlocks pass the hidden state through; a projection with one row of ones and the rest zero then
    makes that row's token the argmax for any hidden state with a positive sum."""
    planted = [7, 300, 42]
    tensors = {}
    for head, token in enumerate(planted):
        tensors[f"{head}.0.linear.weight"] = torch.zeros(HIDDEN, HIDDEN)
        tensors[f"{head}.0.linear.bias"] = torch.zeros(HIDDEN)
        projection = torch.zeros(VOCAB, HIDDEN)
        projection[token] = 1.0
        tensors[f"{head}.1.weight"] = projection
    speculator = make(_write(tmp_path, tensors))
    assert speculator.num_speculative_tokens == 3  # unset: one draft per head
    assert speculator.shared_heads == []
    hidden = _hidden(4).abs() + 0.1  # positive sums
    inputs = _inputs(hidden, max_num_tokens=[8, 2, 1, 0])
    inputs.append(SpeculationInput("no-hidden-state", [1, 2, 3], 2, 8))
    proposal = speculator.propose(inputs)
    assert proposal.token_ids == [planted, planted[:2], planted[:1], [], []]
    assert proposal.draft_probs == []  # deterministic drafts


@pytest.mark.parametrize("num_layers", [1, 2])
def test_drafts_are_the_argmax_of_fasterdecodings_module(make: Factory, tmp_path: Path, num_layers: int) -> None:
    reference = _reference_heads(3, num_layers)
    head_0 = {key for key in reference.state_dict() if key.startswith("0.")}
    resblocks = {f"0.{layer}.linear.{kind}" for layer in range(num_layers) for kind in ("weight", "bias")}
    assert head_0 == resblocks | {f"0.{num_layers}.weight"}  # the published names
    speculator = make(_write(tmp_path, reference.state_dict(), medusa_num_layers=num_layers), k=2)
    hidden = _hidden(16)
    with torch.no_grad():
        expected = torch.stack([head(hidden).argmax(-1) for head in reference[:2]], dim=1).tolist()  # [16, 2]
    assert speculator.propose(_inputs(hidden)).token_ids == expected


TREE = "[(0,), (1,), (0, 0), (2,), (1, 0), (0, 0, 0), (0, 1)]"


def test_tree_nodes_are_each_heads_ranked_candidates(make: Factory, tmp_path: Path) -> None:
    """Node (r_0, ..., r_d) drafts head d's candidate of rank r_d (FasterDecoding's module computes the heads);
    a request gets the tree's first min(k, max_num_tokens) nodes, with their parents."""
    reference = _reference_heads(3, 1)
    speculator = make(_write(tmp_path, reference.state_dict()), tree=TREE)
    assert speculator.num_speculative_tokens == 7
    hidden = _hidden(5)
    with torch.no_grad():
        ranked = [head(hidden).topk(3, dim=-1).indices.tolist() for head in reference]  # [head][row][rank]
    proposal = speculator.propose(_inputs(hidden, max_num_tokens=[8, 7, 3, 1, 0]))
    nodes = [(0,), (1,), (0, 0), (2,), (1, 0), (0, 0, 0), (0, 1)]
    parents = [-1, -1, 0, -1, 1, 2, 0]
    for row, count in enumerate([7, 7, 3, 1, 0]):
        assert proposal.token_ids[row] == [ranked[len(node) - 1][row][node[-1]] for node in nodes[:count]]
        assert proposal.parents[row] == (parents[:count] if count else None)


def test_stored_medusa_choices_are_the_default_tree_and_chains_where_trees_cannot_be_verified(
    make: Factory, tmp_path: Path
) -> None:
    reference = _reference_heads(2, 1)
    heads_dir = _write(tmp_path, reference.state_dict(), medusa_choices=[[0], [1], [0, 0]])
    inputs = _inputs(_hidden(3))
    tree = make(heads_dir).propose(inputs)
    assert tree.parents == [[-1, -1, 0]] * 3
    chain = make(heads_dir, verifies_trees=False)
    assert chain.tree is None and chain.num_speculative_tokens == 2
    proposal = chain.propose(inputs)
    assert not any(proposal.parents)
    assert [drafts[0] for drafts in proposal.token_ids] == [drafts[0] for drafts in tree.token_ids]  # top-1s
    assert make(heads_dir, k=2).propose(inputs).parents == [[-1, -1]] * 3  # k counts the tree's nodes


def test_trees_the_heads_cannot_draft_are_errors(make: Factory, tmp_path: Path) -> None:
    heads_dir = _write(tmp_path / "two", _reference_heads(2, 1).state_dict())
    with pytest.raises(ConfigError, match="3 levels deep, but .* holds 2 Medusa heads"):
        make(heads_dir, tree="[(0,), (0, 0), (0, 0, 0)]")
    bad = _write(tmp_path / "bad", _reference_heads(2, 1).state_dict(), medusa_choices=[[0, 0]])
    with pytest.raises(WeightsError, match="medusa_choices: .*before its parent"):
        make(bad)


def test_a_draft_vocabulary_limits_drafts_to_its_tokens(make: Factory, target: LoadedModel, tmp_path: Path) -> None:
    """Heads on the lm_head with ``draft_vocab``: each draft is the best-scoring token of the vocabulary (the
    argmax of the full logits restricted to it), for own-projection heads too; a bad list is one line."""
    tensors = _heads_on_embedding(target, num_heads=2)
    vocab = list(range(0, VOCAB, 3))  # every third token
    shared = make(_write(tmp_path / "shared", {k: v for k, v in tensors.items() if not k.endswith(".1.weight")},
                         draft_vocab=vocab))  # fmt: skip
    own = make(_write(tmp_path / "own", tensors, draft_vocab=vocab), cls=_OwnWeights)
    full = make(_write(tmp_path / "full", tensors), cls=_OwnWeights)
    hidden = _hidden(6)
    allowed = torch.tensor(vocab)
    with torch.no_grad():
        logits = full._logits(hidden, 2)  # [2] x [6, VOCAB]
    expected = [[vocab[int(head[row, allowed].argmax())] for head in logits] for row in range(6)]
    assert own.propose(_inputs(hidden)).token_ids == expected
    assert shared.propose(_inputs(hidden)).token_ids == expected
    tree = make(tmp_path / "shared", tree="[(0,), (1,), (0, 0)]").propose(_inputs(hidden)).token_ids
    assert all(token in vocab for drafts in tree for token in drafts)
    for bad in ([VOCAB], [1, 1], "all"):
        with pytest.raises(WeightsError, match="draft_vocab must list distinct token ids"):
            make(_write(tmp_path / f"bad{bad}", tensors, draft_vocab=bad))


def test_an_attention_backend_without_trees_refuses_a_configured_tree(
    tied_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenmill_plugins.attention.cpu_backend import CpuAttentionBackend

    monkeypatch.setattr(CpuAttentionBackend, "supports_draft_trees", False)
    heads_dir = _write(tmp_path, _reference_heads(2, 1).state_dict(), medusa_choices=[[0], [1]])
    spec = {"method": "medusa", "model": str(heads_dir)}
    with pytest.raises(ConfigError, match="attention backend 'cpu' cannot verify them"):
        make_engine(
            tied_dir, attention={"backend": "cpu"}, speculative_config={**spec, "speculative_token_tree": "[(0,)]"}
        )
    engine = make_engine(tied_dir, attention={"backend": "cpu"}, speculative_config=spec)  # the stored tree: chains
    proposer = engine.executor.proposer
    assert proposer is not None and proposer.speculator.tree is None  # type: ignore[attr-defined]


def test_legacy_pt_file_loads_like_safetensors(make: Factory, tmp_path: Path) -> None:
    reference = _reference_heads(2, 1)
    _write(tmp_path / "st", reference.state_dict())
    (tmp_path / "pt").mkdir()
    torch.save(reference.state_dict(), tmp_path / "pt" / "medusa_lm_head.pt")
    (tmp_path / "pt" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    inputs = _inputs(_hidden(8))
    assert make(tmp_path / "pt").propose(inputs).token_ids == make(tmp_path / "st").propose(inputs).token_ids


def _heads_on_embedding(target: LoadedModel, num_heads: int = 3, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Random ResBlocks with every projection a copy of the target's embedding (its lm_head), in ``dtype``."""
    tensors: dict[str, torch.Tensor] = {}
    for key, value in _reference_heads(num_heads, 1).state_dict().items():
        tensors[key] = _embedding(target).to(dtype) if key.endswith(".1.weight") else value
    return tensors


class _OwnWeights(MedusaSpeculator):
    share_output_projection = False


def test_shared_lm_head_drafts_what_the_explicit_projection_drafts(
    make: Factory, target: LoadedModel, tmp_path: Path
) -> None:
    heads_dir = _write(tmp_path, _heads_on_embedding(target))
    shared, explicit = make(heads_dir), make(heads_dir, cls=_OwnWeights)
    assert shared.shared_heads == [0, 1, 2]
    assert explicit.shared_heads == []
    inputs = _inputs(_hidden(32), max_num_tokens=[3, 2, 1, 3] * 8)
    assert shared.propose(inputs).token_ids == explicit.propose(inputs).token_ids


def test_heads_without_a_projection_use_the_lm_head(make: Factory, target: LoadedModel, tmp_path: Path) -> None:
    """FasterDecoding's train_legacy.py layout ("version": "2"): ResBlocks only."""
    tensors = _heads_on_embedding(target)
    with_projection = make(_write(tmp_path / "v1", tensors), cls=_OwnWeights)
    resblocks_only = {key: value for key, value in tensors.items() if not key.endswith(".1.weight")}
    without = make(_write(tmp_path / "v2", resblocks_only, version="2"))
    assert without.shared_heads == [0, 1, 2]
    inputs = _inputs(_hidden(16))
    assert without.propose(inputs).token_ids == with_projection.propose(inputs).token_ids


def test_a_bfloat16_copy_is_shared_a_changed_one_is_not(make: Factory, target: LoadedModel, tmp_path: Path) -> None:
    tensors = _heads_on_embedding(target, num_heads=2, dtype=torch.bfloat16)
    tensors["1.1.weight"] = tensors["1.1.weight"].clone()
    tensors["1.1.weight"][5, 3] += 0.25
    speculator = make(_write(tmp_path, tensors))
    assert speculator.shared_heads == [0]
    inputs = _inputs(_hidden(8))
    assert speculator.propose(inputs).token_ids == make(tmp_path, cls=_OwnWeights).propose(inputs).token_ids


def test_quantized_untied_lm_head_is_compared_with_the_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With an int8 lm_head the float weights are not in memory: they are read from the target's file."""
    lm_head = load_file(str(tiny_model_dir / "model.safetensors"))["lm_head.weight"]  # [vocab, hidden]
    tensors = {key: value for key, value in _reference_heads(2, 1).state_dict().items()}
    tensors["0.1.weight"] = lm_head
    config = _config(tiny_model_dir, _write(tmp_path, tensors), heads_quantization="none", quantization="int8")
    plugins = resolve_plugins(config)
    quantized = load_model(config, plugins)
    assert quantized.model.lm_head is not None and not hasattr(quantized.model.lm_head, "weight")
    speculator = MedusaSpeculator(3, SpeculatorContext(config, quantized, plugins, BLOCK_SIZE, 64))
    assert speculator.shared_heads == [0]  # head 1's projection is random
    assert len(speculator.propose(_inputs(_hidden(4))).token_ids[0]) == 2


def _one_line_error(error: type[Exception], match: str, build: Callable[[], object]) -> None:
    with pytest.raises(error, match=match) as caught:
        build()
    assert "\n" not in str(caught.value)


def test_missing_files_are_one_line_errors(make: Factory, tmp_path: Path) -> None:
    _one_line_error(ConfigError, "does not exist", lambda: make(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    _one_line_error(WeightsError, "no config.json", lambda: make(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    _one_line_error(WeightsError, "no medusa_lm_head.safetensors", lambda: make(tmp_path / "empty"))


def test_heads_for_another_model_are_one_line_errors(make: Factory, tmp_path: Path) -> None:
    narrow = {"0.0.linear.weight": torch.zeros(32, 32), "0.0.linear.bias": torch.zeros(32)}
    _one_line_error(WeightsError, "32 wide, the target model's hidden size is 64",
                    lambda: make(_write(tmp_path / "narrow", narrow)))  # fmt: skip
    other_vocab = _reference_heads(2, 1, vocab=500).state_dict()
    _one_line_error(WeightsError, "vocabulary of 500 tokens, the target model's has 512",
                    lambda: make(_write(tmp_path / "vocab", other_vocab)))  # fmt: skip
    resblocks = {"0.0.linear.weight": torch.zeros(HIDDEN, HIDDEN), "0.0.linear.bias": torch.zeros(HIDDEN)}
    _one_line_error(WeightsError, "vocabulary of 49152 tokens",
                    lambda: make(_write(tmp_path / "config-vocab", resblocks, vocab_size=49152)))  # fmt: skip


def test_malformed_checkpoints_are_one_line_errors(make: Factory, tmp_path: Path) -> None:
    good = _reference_heads(2, 1).state_dict()
    cases = {
        "stray": ({**good, "medusa_head.0.0.linear.weight": torch.zeros(1)}, "not part of a Medusa head"),
        "no-bias": ({k: v for k, v in good.items() if k != "1.0.linear.bias"}, "'1.0.linear.bias' is missing"),
        "gap": ({k: v for k, v in good.items() if not k.startswith("0.")}, "head 0 is missing"),
        "square": ({**good, "1.0.linear.weight": torch.zeros(HIDDEN, 8)}, r"shape \[64, 8\], expected \[64, 64\]"),
    }
    for name, (tensors, match) in cases.items():
        _one_line_error(WeightsError, match, lambda t=tensors, n=name: make(_write(tmp_path / n, t)))


def test_more_drafts_than_heads_is_a_config_error(make: Factory, tmp_path: Path) -> None:
    heads_dir = _write(tmp_path, _reference_heads(2, 1).state_dict())
    _one_line_error(ConfigError, "num_speculative_tokens=3, but .* holds 2 Medusa heads", lambda: make(heads_dir, k=3))
    assert make(heads_dir, k=1).num_speculative_tokens == 1
    assert make(heads_dir).num_speculative_tokens == 2


def test_needs_an_engine() -> None:
    _one_line_error(ConfigError, "runs inside an engine only", lambda: MedusaSpeculator(3))


class _HiddenFromTokens(MedusaSpeculator):
    """Fills in the hidden state the engine would give: here the embedding of the last token, so that the
    conformance check (which passes none) sees drafts that depend on the tokens."""

    def propose(self, requests: list[SpeculationInput]) -> Proposal:
        embedding = _embedding(self._target)
        filled = [
            SpeculationInput(r.request_id, r.token_ids, r.num_prompt_tokens, r.max_num_tokens,
                             embedding[r.token_ids[-1]])
            for r in requests
        ]  # fmt: skip
        return super().propose(filled)


def test_passes_check_speculator(make: Factory, tmp_path: Path) -> None:
    heads_dir = _write(tmp_path, _reference_heads(3, 1).state_dict())
    check_speculator(lambda num_speculative_tokens: make(heads_dir, num_speculative_tokens, _HiddenFromTokens),
                     num_speculative_tokens=3, vocab_size=VOCAB)  # fmt: skip
    check_speculator(lambda num_speculative_tokens: make(heads_dir, None, _HiddenFromTokens, tree=TREE),
                     num_speculative_tokens=7, vocab_size=VOCAB)  # fmt: skip


def test_greedy_output_is_unchanged_through_the_engine(tied_dir: Path, target: LoadedModel, tmp_path: Path) -> None:
    """Heads with the lm_head's own prediction plus noise: some drafts are right, some wrong; greedy output must
    be exactly the output without speculation."""
    from tokenmill.messages import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    heads_dir = _write(tmp_path, _heads_on_embedding(target, num_heads=2))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 9, 200, 31], [100, 101, 102], [7] * 9]

    def run(**sections: dict[str, Any]) -> tuple[dict[str, list[int]], Any]:
        engine = make_engine(tied_dir, **sections)
        requests = [EngineCoreRequest(f"r{i}", p, params, [], 0.0) for i, p in enumerate(prompts)]
        return run_to_completion(engine, requests), engine.stats()

    plain, _ = run()
    spec = {"method": "medusa", "model": str(heads_dir), "draft_policy": "constant"}
    speculative, stats = run(speculative_config=spec)
    assert speculative == plain
    assert stats.spec_decode_num_draft_tokens > 0
    # And with a tree, on both backends that verify trees.
    for backend in ("cpu", "torch"):
        speculative, stats = run(speculative_config={**spec, "speculative_token_tree": "[(0,), (1,), (0, 0), (1, 0)]"},
                                 attention={"backend": backend})  # fmt: skip
        assert speculative == plain, backend
        assert stats.spec_decode_num_accepted_tokens > 0, backend


@pytest.mark.parametrize("num_layers", [1, 3])
def test_int8_heads_compute_the_float_heads_on_their_int8_weights(
    make: Factory, target: LoadedModel, tmp_path: Path, num_layers: int
) -> None:
    """The default on a CPU with a float32 target: the heads' own weights (ResBlocks, the draft vocabulary's
    rows) in int8. Their logits are the float heads' on the int8-rounded weights, and their drafts those of the
    float heads on nearly every row (the heads only propose: a flipped candidate is a missed guess)."""
    from tokenmill_plugins.quant.weight_only import Int8Quantizer

    tensors = {key: value for key, value in _reference_heads(3, num_layers).state_dict().items()
               if not key.endswith(f".{num_layers}.weight")}  # fmt: skip  # the shared lm_head
    heads_dir = _write(tmp_path / "heads", tensors, medusa_num_layers=num_layers, draft_vocab=list(range(0, VOCAB, 2)))
    quantized, dense = make(heads_dir, quantization=None), make(heads_dir)
    assert isinstance(quantized._resblocks, _QuantizedResBlocks) and isinstance(dense._resblocks, _FloatResBlocks)
    rounded = {  # the same heads with every ResBlock weight rounded through int8
        key: Int8Quantizer().dequantize(*Int8Quantizer().quantize(value)) if key.endswith("linear.weight") else value
        for key, value in tensors.items()
    }
    rounded_dense = make(_write(tmp_path / "rounded", rounded, medusa_num_layers=num_layers,
                                draft_vocab=list(range(0, VOCAB, 2))))  # fmt: skip
    hidden = _hidden(32)
    x = quantized._resblocks(hidden, 3)
    torch.testing.assert_close(quantized._resblocks(hidden, 2), x[:2])  # a step running fewer heads
    float_blocks = rounded_dense._resblocks
    assert isinstance(float_blocks, _FloatResBlocks)
    torch.testing.assert_close(x, apply_resblocks(hidden, float_blocks.weights, float_blocks.biases),
                               rtol=1e-3, atol=1e-3)  # fmt: skip
    same = sum(a == b for a, b in zip(quantized._draft(hidden, 3).tolist(), dense._draft(hidden, 3).tolist(),
                                      strict=True))  # fmt: skip
    assert same >= 28, same


def test_heads_quantization_names_a_quantizer_or_is_a_one_line_error(make: Factory, tmp_path: Path) -> None:
    heads_dir = _write(tmp_path, {"0.0.linear.weight": torch.zeros(HIDDEN, HIDDEN), "0.0.linear.bias":
                                  torch.zeros(HIDDEN)})  # fmt: skip
    assert isinstance(make(heads_dir, quantization="int4")._resblocks, _QuantizedResBlocks)
    _one_line_error(ConfigError, "speculative_config.quantization", lambda: make(heads_dir, quantization="int3"))
    _one_line_error(ConfigError, "speculative_config.quantization", lambda: make(heads_dir, quantization="gptq"))
    # Heads without ResBlocks (projections only) pass the hidden state through, quantized or not.
    no_resblocks = _write(tmp_path / "projections", {"0.0.weight": torch.zeros(VOCAB, HIDDEN)}, medusa_num_layers=0)
    hidden = _hidden(2)
    quantized = make(no_resblocks, quantization="int8")
    assert isinstance(quantized._resblocks, _QuantizedResBlocks)
    torch.testing.assert_close(quantized._resblocks(hidden, 1), hidden.unsqueeze(0))
