"""The mixture-of-experts block (``tokenmill.layers.moe``) and its fused-experts slot, beyond the reference-match
tests: routing, the experts a step runs, stacked weights, quantized experts and the slot's selection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenmill_kernels.quant_matmul import cpu as quant_matmul

from tests.factories import make_engine, run_to_completion, save_hf_model
from tokenmill.engine import now
from tokenmill.hookspecs import Register, hookimpl
from tokenmill.layers.fused_experts import TorchFusedExperts
from tokenmill.layers.moe import Experts, SparseMoeBlock, select_experts
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import select_fused_experts
from tokenmill.plugin_manager import PluginError, load_plugins
from tokenmill.sampling_params import SamplingParams


def test_routing_softmax_then_top_k_renormalised_or_not() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum())


class _CountingExperts(TorchFusedExperts):
    """The reference, recording how many experts' weights each call ran."""

    def __init__(self) -> None:
        self.experts_run: list[int] = []

    def apply(self, experts, x, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
        self.experts_run.append(int(topk_ids.unique().numel()))
        return super().apply(experts, x, topk_weights, topk_ids)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3-moe")
    save_hf_model("qwen3-moe-tiny", directory)
    return directory


def _greedy(engine, prompts: list[list[int]], max_tokens: int = 6) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return run_to_completion(engine, [EngineCoreRequest(str(i), p, params, [], now()) for i, p in enumerate(prompts)])


def test_a_decode_step_runs_only_the_experts_its_tokens_chose(moe_dir: Path) -> None:
    engine = make_engine(moe_dir)
    counting = _CountingExperts()
    blocks = [m for m in engine.executor.runner.loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 1  # layer 1 is in mlp_only_layers
    blocks[0].fused_experts = counting
    _greedy(engine, [[5, 6, 7, 8]], max_tokens=4)
    # A one-token decode step reads top_k = 2 of the 8 experts.
    assert counting.experts_run[1:] == [2, 2, 2]


def test_stacked_weights_are_each_experts_in_order() -> None:
    from tokenmill.layers.dense import DenseQuantizer
    from tokenmill.layers.moe import ExpertMLP
    from tokenmill.parallel.group import single_process_group

    experts = Experts(
        ExpertMLP(8, 6, "silu", DenseQuantizer(), torch.float32, single_process_group()) for _ in range(3)
    )
    for expert in experts.parameters():
        torch.nn.init.normal_(expert)
    gate_up, down = experts.stacked_weights()
    assert (gate_up.shape, down.shape) == ((3, 12, 8), (3, 8, 6))
    torch.testing.assert_close(down[2], experts[2].down_proj.weight)


def test_experts_split_over_shards_sum_to_all_experts() -> None:
    """Expert parallelism's invariant at the kernel: each shard's experts (the others' pairs marked -1) add up to
    every expert's result; a shard with no pair of its own returns zeros."""
    from tokenmill.layers.dense import DenseQuantizer
    from tokenmill.layers.moe import ExpertMLP
    from tokenmill.parallel.group import TensorParallelGroup, single_process_group

    torch.manual_seed(0)
    experts = Experts(
        ExpertMLP(16, 8, "silu", DenseQuantizer(), torch.float32, single_process_group()) for _ in range(6)
    )
    for parameter in experts.parameters():
        torch.nn.init.normal_(parameter)
    x = torch.randn(5, 16)
    topk_weights, topk_ids = select_experts(torch.randn(5, 6), 2, renormalize=True)
    reference = TorchFusedExperts()
    total = torch.zeros(5, 16)
    for rank in range(3):
        shard = TensorParallelGroup(rank, 3, None, expert_parallel=True)
        mine = list(shard.local_experts(6))
        local_ids = torch.where(topk_ids % 3 == rank, topk_ids // 3, -1)
        total += reference.apply(Experts(experts[e] for e in mine), x, topk_weights, local_ids)
    torch.testing.assert_close(total, reference.apply(experts, x, topk_weights, topk_ids))
    nobody = torch.full_like(topk_ids, -1)
    assert torch.equal(reference.apply(experts, x, topk_weights, nobody), torch.zeros(5, 16))


@pytest.mark.parametrize("quantizer", ["none", "int4"])
def test_one_token_takes_its_own_path_to_the_grouped_paths_bits(quantizer: str) -> None:
    """A decode step of one stream runs its experts without grouping pairs: the same bits as the grouped path on the
    same token (made to take it by a second token whose pairs are all another shard's), another shard's pairs (-1)
    included, and within rounding of its row in a batch (the int4 kernel rounds a 1-row call apart)."""
    from tokenmill.layers.moe import ExpertMLP
    from tokenmill.parallel.group import single_process_group
    from tokenmill.plugin_manager import Slot

    torch.manual_seed(0)
    plugins = load_plugins()
    experts = Experts(
        ExpertMLP(64, 32, "silu", plugins.create(Slot.QUANTIZER, quantizer), torch.float32, single_process_group())
        for _ in range(6)
    )
    for expert in experts:
        for linear in (expert.gate_up_proj, expert.down_proj):
            linear.quantizer.load_weight(linear, "weight", torch.randn(linear.out_features, linear.in_features))
    x = torch.randn(7, 64)
    topk_weights, topk_ids = select_experts(torch.randn(7, 6), 3, renormalize=True)
    topk_ids[2, 1] = -1
    reference = TorchFusedExperts()
    batched = reference.apply(experts, x, topk_weights, topk_ids)
    nobody = torch.full((1, 3), -1)
    for t in range(7):
        alone = reference.apply(experts, x[t : t + 1], topk_weights[t : t + 1], topk_ids[t : t + 1])
        grouped = reference.apply(experts, x[[t, 0]], topk_weights[[t, 0]], torch.cat([topk_ids[t : t + 1], nobody]))[
            :1
        ]
        assert torch.equal(alone, grouped), t
        torch.testing.assert_close(alone, batched[t : t + 1], atol=1e-4, rtol=1e-4)


def test_int8_experts_run_through_the_quantizer(moe_dir: Path) -> None:
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    dense = _greedy(make_engine(moe_dir), prompts)
    quantized_engine = make_engine(moe_dir, model={"quantization": "int8"})
    expert = next(m for m in quantized_engine.executor.runner.loaded.model.modules() if isinstance(m, Experts))[0]
    assert expert.gate_up_proj.quantizer.name == "int8"
    quantized = _greedy(quantized_engine, prompts)
    # Per-channel int8 weights of a random tiny model: most tokens agree.
    agree = sum(a == b for key in dense for a, b in zip(dense[key], quantized[key], strict=True))
    assert agree >= 8


def test_the_slot_refuses_an_unknown_name() -> None:
    plugins = load_plugins(allowlist=[])
    assert select_fused_experts("auto", torch.device("cpu"), plugins).name == _CPU_DEFAULT
    with pytest.raises(PluginError, match="unknown fused_expert 'triton-moe'; installed: cpu, torch, triton"):
        select_fused_experts("triton-moe", torch.device("cpu"), plugins)


#: What ``auto`` picks on this CPU: the ``cpu`` kernels where they build, else the reference.
_CPU_DEFAULT = "cpu" if quant_matmul.is_available() else "torch"


class _FasterFusedExperts(TorchFusedExperts):
    """Fused experts that ``auto`` would prefer, and that do not run adapters on the experts."""

    name = "faster"
    auto_priority = 9
    supports_lora = False


class _FasterPlugin:
    @hookimpl
    def tokenmill_register_fused_experts(self, register: Register) -> None:
        register("faster", f"{__name__}:_FasterFusedExperts")


def test_auto_picks_fused_experts_that_run_adapters_when_lora_is_on() -> None:
    """With --enable-lora, ``auto`` passes over fused experts that do not run adapters on the experts (the
    ``triton`` ones, on a GPU), so an adapter on the routed experts is not refused by default."""
    plugins = load_plugins(allowlist=[], extra_plugins=[("faster", _FasterPlugin())])
    assert select_fused_experts("auto", torch.device("cpu"), plugins).name == "faster"
    assert select_fused_experts("auto", torch.device("cpu"), plugins, lora=True).name == _CPU_DEFAULT
    assert select_fused_experts("faster", torch.device("cpu"), plugins, lora=True).name == "faster"  # as named
