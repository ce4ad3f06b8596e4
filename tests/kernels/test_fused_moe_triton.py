"""The Triton fused experts against the torch reference: the alignment of pairs by expert (runs padded to whole
blocks, another shard's pairs left out), a layer's output, quantized experts left to the reference, and a MoE
model's greedy tokens. On CPU they run under the Triton interpreter (``conftest.py``): shapes are small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tokenmill_kernels.fused_moe import triton as kernels  # noqa: E402
from tokenmill_plugins.fused_experts.triton_experts import TritonFusedExperts  # noqa: E402

from tokenmill.engine import now  # noqa: E402
from tokenmill.layers.fused_experts import TorchFusedExperts, install_fused_experts  # noqa: E402
from tokenmill.messages import EngineCoreRequest  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402
from tokenmill.testing.factories import make_engine, run_to_completion, save_tiny_model  # noqa: E402

assert torch.cuda.is_available() or kernels.is_interpreted(), "imported before TRITON_INTERPRET=1 was set"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_places_each_pair_once_in_its_experts_blocks() -> None:
    topk_ids = torch.tensor([[0, 3], [3, -1], [0, 3], [5, 0], [-1, 3], [3, 0]], device=DEVICE)  # expert 3: 5 pairs
    sorted_pairs, block_experts = kernels.align(topk_ids, num_experts=6, block_m=4)
    blocks = sorted_pairs.view(-1, 4).tolist()
    experts = block_experts.tolist()
    assert len(experts) == (12 + 3) // 4 + 6  # the worst case for 12 pairs over 6 experts
    placed = {pair: experts[b] for b, row in enumerate(blocks) for pair in row if pair >= 0}
    flat = topk_ids.reshape(-1).tolist()
    assert placed == {pair: expert for pair, expert in enumerate(flat) if expert >= 0}  # once each, own expert
    used = [experts[b] for b, row in enumerate(blocks) if any(p >= 0 for p in row)]
    assert used == [0, 3, 3, 5]  # expert 3's five pairs in two blocks
    assert all(expert == 6 for b, expert in enumerate(experts) if all(p < 0 for p in blocks[b]))  # nothing left


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls into the Triton launcher (not the reference)."""
    calls: list[int] = []
    launch = kernels.fused_experts

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return launch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels, "fused_experts", counted)
    return calls


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fused_experts_match_the_reference(activation: str, launches: list[int]) -> None:
    from tokenmill.layers.dense import DenseQuantizer
    from tokenmill.layers.moe import ExpertMLP, Experts
    from tokenmill.parallel.group import single_process_group

    generator = torch.Generator().manual_seed(0)
    experts = Experts(ExpertMLP(40, 24, activation, DenseQuantizer(), torch.float32, single_process_group())
                      for _ in range(5))  # fmt: skip
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    experts.to(DEVICE)
    x = torch.randn(19, 40, generator=generator).to(DEVICE)
    topk_ids = torch.stack([torch.randperm(5, generator=generator)[:3] for _ in range(19)]).to(DEVICE)
    topk_weights = torch.rand(19, 3, generator=generator).to(DEVICE)
    expected = TorchFusedExperts().apply(experts, x, topk_weights, topk_ids)
    actual = TritonFusedExperts().apply(experts, x, topk_weights, topk_ids)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert launches == [1]


def test_quantized_experts_go_to_the_reference(tmp_path: Path, launches: list[int]) -> None:
    engine = make_engine(save_tiny_model(tmp_path, "qwen3-moe-tiny"), model={"quantization": "int8"})
    model = engine.executor.runner.loaded.model
    from tokenmill.layers.moe import Experts

    experts = next(m for m in model.modules() if isinstance(m, Experts))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    topk_ids, topk_weights = torch.tensor([[0, 1], [2, 7], [1, 0]]), torch.rand(3, 2)
    expected = TorchFusedExperts().apply(experts, x, topk_weights, topk_ids)
    assert torch.equal(TritonFusedExperts().apply(experts, x, topk_weights, topk_ids), expected)
    assert not launches


def test_a_moe_model_decodes_as_with_the_reference(tmp_path: Path, launches: list[int]) -> None:
    model_dir = save_tiny_model(tmp_path, "qwen3-moe-tiny")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = {"a": [5, 17, 300, 42, 9, 77, 123], "b": [400, 3, 3, 90]}
    results = []
    for kernels_ in (TorchFusedExperts(), TritonFusedExperts()):
        engine = make_engine(model_dir, model={"dtype": "float32"})
        install_fused_experts(engine.executor.runner.loaded.model, kernels_)
        requests = [EngineCoreRequest(r, p, params, [], now()) for r, p in prompts.items()]
        results.append(run_to_completion(engine, requests))
    assert results[0] == results[1] and launches
