"""The ``cpu`` fused experts (``tokenmill_plugins.fused_experts.cpu_experts``): int8 and int4 experts in one C++
call a layer, against the ``torch`` reference that runs each expert's own quantized linears."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenmill_kernels.quant_matmul import cpu as quant_matmul
from tokenmill_plugins.fused_experts.cpu_experts import CpuFusedExperts
from tokenmill_plugins.quant.weight_only import Int4Quantizer, Int8Quantizer

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill.engine import now
from tokenmill.layers.fused_experts import TorchFusedExperts
from tokenmill.layers.moe import ExpertMLP, Experts, SparseMoeBlock
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import select_fused_experts
from tokenmill.parallel.group import single_process_group
from tokenmill.plugin_manager import load_plugins
from tokenmill.sampling_params import SamplingParams
from tokenmill.testing import check_fused_experts

pytestmark = pytest.mark.skipif(not quant_matmul.is_available(), reason="the quantized matmul kernels cannot build")


@pytest.mark.parametrize("quantizer", [Int4Quantizer, Int8Quantizer], ids=["int4", "int8"])
def test_quantized_experts_pass_the_kit_check(quantizer: type) -> None:
    check_fused_experts(CpuFusedExperts, quantizer=quantizer())


class _SkipsTheSecondExpert(CpuFusedExperts):
    """A planted fault: every token's second choice dropped."""

    def apply(self, experts, x, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
        return super().apply(experts, x, topk_weights, topk_ids.clone().index_fill_(1, torch.tensor([1]), -1))


def test_the_kit_catches_a_kernel_that_drops_an_expert() -> None:
    with pytest.raises(AssertionError, match="differs from the torch reference"):
        check_fused_experts(_SkipsTheSecondExpert, quantizer=Int4Quantizer())


def _experts(quantizer: object, activation: str = "silu", bias: bool = False) -> Experts:
    generator = torch.Generator().manual_seed(0)
    experts = Experts(
        ExpertMLP(64, 96, activation, quantizer, torch.float32, single_process_group())  # type: ignore[arg-type]
        for _ in range(4)
    )
    for expert in experts:
        for linear in (expert.gate_up_proj, expert.down_proj):
            linear.load_weight("weight", torch.randn(linear.out_features, linear.in_features, generator=generator))
    return experts


@pytest.mark.parametrize("quantizer", [Int4Quantizer, Int8Quantizer], ids=["int4", "int8"])
def test_gelu_experts_match_the_reference(quantizer: type) -> None:
    experts = _experts(quantizer(), "gelu_tanh")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 3], [1, 0], [2, 3], [3, 1], [0, 2]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
    expected = TorchFusedExperts().apply(experts, x, weights, ids)
    torch.testing.assert_close(CpuFusedExperts().apply(experts, x, weights, ids), expected, atol=1e-4, rtol=1e-4)


def test_dense_experts_and_other_dtypes_go_to_the_reference() -> None:
    from tokenmill.layers.dense import DenseQuantizer

    kernels = CpuFusedExperts()
    x, ids, weights = torch.randn(2, 64), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    dense = _experts(DenseQuantizer())
    assert kernels._runs(dense, x) is None
    quantized = _experts(Int4Quantizer())
    assert kernels._runs(quantized, x) is not None
    assert kernels._runs(quantized, x.double()) is None
    torch.testing.assert_close(
        kernels.apply(dense, x, weights, ids), TorchFusedExperts().apply(dense, x, weights, ids), atol=0, rtol=0
    )
    # float64 activations: the C++ takes float32 only, the reference converts in each linear.
    expected = TorchFusedExperts().apply(quantized, x.double(), weights.double(), ids)
    torch.testing.assert_close(kernels.apply(quantized, x.double(), weights.double(), ids), expected)


def test_an_expert_id_out_of_range_is_a_clear_error() -> None:
    kernels = CpuFusedExperts()
    experts = _experts(Int8Quantizer())
    with pytest.raises(ValueError, match="token 1 chose expert 4 of 4"):
        kernels.apply(experts, torch.randn(2, 64), torch.rand(2, 2), torch.tensor([[0, 1], [4, 2]]))


def test_weights_loaded_again_are_read_again() -> None:
    kernels = CpuFusedExperts()
    experts = _experts(Int4Quantizer())
    x, ids, weights = torch.randn(1, 64), torch.tensor([[0, 1]]), torch.rand(1, 2)
    before = kernels.apply(experts, x, weights, ids)
    experts[0].gate_up_proj.load_weight("weight", torch.randn(192, 64))
    after = kernels.apply(experts, x, weights, ids)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, TorchFusedExperts().apply(experts, x, weights, ids), atol=1e-4, rtol=1e-4)


def test_auto_picks_them_on_the_cpu() -> None:
    plugins = load_plugins()
    assert select_fused_experts("auto", torch.device("cpu"), plugins).name == "cpu"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-moe-cpu")
    save_hf_model("qwen3-moe-tiny", directory, hidden_size=64, moe_intermediate_size=64, intermediate_size=64)
    return directory


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_an_engine_decodes_the_same_tokens_as_with_the_reference(moe_dir: Path, quantization: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41], [7] * 11]
    results = {}
    for kernels in ("torch", "cpu"):
        engine = make_engine(moe_dir, model={"quantization": quantization, "fused_experts": kernels})
        blocks = [m for m in engine.executor.runner.loaded.model.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks and all(block.fused_experts.name == kernels for block in blocks)
        requests = [EngineCoreRequest(str(i), p, params, [], now()) for i, p in enumerate(prompts)]
        results[kernels] = run_to_completion(engine, requests)
    assert results["cpu"] == results["torch"]


class _RoutesWithoutRenormalising(CpuFusedExperts):
    """A planted fault: the routing's weights never renormalised."""

    def apply_routed(self, experts, x, router_weight, top_k, renormalize):  # type: ignore[no-untyped-def]
        return super().apply_routed(experts, x, router_weight, top_k, False)


def test_the_kit_catches_routing_that_ignores_renormalize() -> None:
    with pytest.raises(AssertionError, match=r"apply_routed\(tokens=1, renormalize=True\): differs"):
        check_fused_experts(_RoutesWithoutRenormalising, quantizer=Int8Quantizer())


def test_routing_in_the_kernel_matches_the_block_routing_itself() -> None:
    from tokenmill.layers.moe import select_experts

    experts = _experts(Int4Quantizer())
    generator = torch.Generator().manual_seed(3)
    x, router = torch.randn(9, 64, generator=generator), torch.randn(4, 64, generator=generator)
    for renormalize in (True, False):
        weights, ids = select_experts(x @ router.T, 2, renormalize)
        expected = TorchFusedExperts().apply(experts, x, weights, ids)
        actual = CpuFusedExperts().apply_routed(experts, x, router, 2, renormalize)
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert CpuFusedExperts().apply_routed(experts, x.double(), router.double(), 2, True) is None
    with pytest.raises(ValueError, match="top_k must be in 1..4, got 5"):
        CpuFusedExperts().apply_routed(experts, x, router, 5, True)
