"""``check_fused_experts``: fused-experts kernels against the torch reference (``TorchFusedExperts``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.layers.fused_experts import FusedExperts, TorchFusedExperts
from tokenmill.testing.conformance._util import conformance_check, fail, instantiate

if TYPE_CHECKING:
    from tokenmill.layers.moe import Experts
    from tokenmill.layers.quantizer import Quantizer


@conformance_check
def check_fused_experts(
    kernels: type[FusedExperts] | FusedExperts,
    *,
    device: str = "cpu",
    num_tokens: tuple[int, ...] = (1, 7, 33, 0),
    seed: int = 0,
    atol: float = 1e-4,
    quantizer: Quantizer | None = None,
) -> None:
    """Check ``apply`` against ``TorchFusedExperts`` on a random MoE layer (8 experts of hidden 64, inner 48, top
    2, float32 dense weights): tokens routed so that some experts get none, one or all of them, then again with the
    odd experts' pairs marked -1 (held by another shard: expert parallelism); the result's shape and dtype, its
    values within ``atol``, and its inputs unchanged. Kernels that route as well (``apply_routed`` not None) are
    checked against ``select_experts`` and the reference, renormalised and not.

    :param kernels: the class (built with no arguments, as the engine builds it) or an instance.
    :param quantizer: the experts' quantizer (dense float32 by default), for kernels that run quantized experts
        themselves; the layer's inner width is then 64, a multiple of the 32 that grouped quantizers need.
    :raises AssertionError: naming the case and what differs.
    """
    from tokenmill.layers.dense import DenseQuantizer
    from tokenmill.layers.moe import ExpertMLP, Experts
    from tokenmill.parallel.group import single_process_group

    candidate = instantiate(kernels)
    name = type(candidate).__name__
    generator = torch.Generator().manual_seed(seed)
    num_experts, top_k, hidden, inner = 8, 2, 64, 48 if quantizer is None else 64
    experts = Experts(
        ExpertMLP(hidden, inner, "silu", quantizer or DenseQuantizer(), torch.float32, single_process_group())
        for _ in range(num_experts)
    )
    with torch.no_grad():
        for expert in experts:
            assert isinstance(expert, ExpertMLP)
            for linear in (expert.gate_up_proj, expert.down_proj):
                weight = torch.randn(linear.out_features, linear.in_features, generator=generator) * 0.1
                linear.load_weight("weight", weight)
    experts.to(device)
    for tokens in num_tokens:
        x = torch.randn(tokens, hidden, generator=generator).to(device)
        # Experts 6 and 7 never chosen; expert 0 chosen by every token.
        others = torch.randint(1, num_experts - 2, (tokens, 1), generator=generator)
        topk_ids = torch.cat([torch.zeros(tokens, 1, dtype=torch.long), others], dim=1).to(device)
        topk_weights = torch.rand(tokens, top_k, generator=generator).to(device)
        for case, ids in (
            (f"{name}.apply(tokens={tokens})", topk_ids),
            (f"{name}.apply(tokens={tokens}, odd experts -1)", topk_ids.masked_fill(topk_ids % 2 == 1, -1)),
        ):
            _check_case(candidate, case, experts, x, topk_weights, ids, atol)
        router_weight = torch.randn(num_experts, hidden, generator=generator).to(device)
        for renormalize in (True, False):
            _check_routed(candidate, f"{name}.apply_routed(tokens={tokens}, renormalize={renormalize})", experts, x,
                          router_weight, top_k, renormalize, atol)  # fmt: skip


def _check_case(
    candidate: FusedExperts,
    case: str,
    experts: Experts,
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    atol: float,
) -> None:
    before = (x.clone(), topk_ids.clone(), topk_weights.clone())
    expected = TorchFusedExperts().apply(experts, x, topk_weights, topk_ids)
    actual = candidate.apply(experts, x, topk_weights, topk_ids)
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        got = (actual.shape, actual.dtype) if isinstance(actual, torch.Tensor) else type(actual).__name__
        fail(f"{case}: returned {got}, expected {(expected.shape, expected.dtype)}")
    if not torch.allclose(actual, expected, atol=atol, rtol=0):
        fail(f"{case}: differs from the torch reference by up to {(actual - expected).abs().max().item():.3g}")
    if not all(torch.equal(a, b) for a, b in zip(before, (x, topk_ids, topk_weights), strict=True)):
        fail(f"{case}: modified its inputs")


def _check_routed(
    candidate: FusedExperts,
    case: str,
    experts: Experts,
    x: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    atol: float,
) -> None:
    from tokenmill.layers.moe import select_experts

    actual = candidate.apply_routed(experts, x, router_weight, top_k, renormalize)
    if actual is None:  # the block routes and calls apply, checked above
        return
    topk_weights, topk_ids = select_experts(x @ router_weight.T, top_k, renormalize)
    expected = TorchFusedExperts().apply(experts, x, topk_weights.to(x.dtype), topk_ids)
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        got = (actual.shape, actual.dtype) if isinstance(actual, torch.Tensor) else type(actual).__name__
        fail(f"{case}: returned {got}, expected {(expected.shape, expected.dtype)}")
    if not torch.allclose(actual, expected, atol=atol, rtol=0):
        fail(f"{case}: differs from select_experts and the torch reference by up to "
             f"{(actual - expected).abs().max().item():.3g}")  # fmt: skip
