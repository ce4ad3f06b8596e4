"""``check_layer_kernels``: layer kernels against the torch reference (``TorchLayerKernels``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.kernels import LayerKernels, TorchLayerKernels
from tokenmill.testing.conformance._util import conformance_check, fail, instantiate

#: Per dtype: (atol, rtol). Beyond one rounding of the result to the dtype, only the order of float32 sums
#: differs from the reference.
LAYER_KERNEL_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@conformance_check
def check_layer_kernels(
    kernels: type[LayerKernels] | LayerKernels,
    *,
    device: str = "cpu",
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    num_tokens: tuple[int, ...] = (1, 5, 0),
    seed: int = 0,
) -> None:
    """Check every method against ``TorchLayerKernels`` on random inputs, as a Llama layer calls them.

    For each dtype and number of tokens:

    - ``rms_norm`` of rows [tokens, 576] and of a strided [tokens, heads, 32] slice of a projection (the q/k
      norms);
    - ``add_rms_norm``: the norm and the sum of ``x`` and ``residual``;
    - ``silu_and_mul`` over [tokens, 2 * 1100];
    - ``rotary`` over the queries and keys of a merged q/k/v projection (a strided view, head sizes 64 and 96),
      leaving the values' columns as they were;
    - where ``pack_dense_weight`` packs a weight of the dtype: ``dense_linear`` against ``F.linear`` for weights
      of 45 x 96 (a partial block of outputs) and 80 x 1536, with a bias and without (float32 sums in another
      order: the tolerance is applied to the sum of the terms' magnitudes);

    each within ``LAYER_KERNEL_TOLERANCES``, with the reference's shape and dtype, and with its inputs
    unchanged (except ``rotary``'s, which it may rotate in place).

    :param kernels: the class (built with no arguments, as the engine builds it) or an instance.
    :raises AssertionError: naming the case and what differs.
    """
    candidate = instantiate(kernels)
    reference = TorchLayerKernels()
    name = type(candidate).__name__
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    def compare(case: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
            got = (actual.shape, actual.dtype) if isinstance(actual, torch.Tensor) else type(actual).__name__
            fail(f"{name}.{case}: returned {got}, expected {(expected.shape, expected.dtype)}")
        atol, rtol = LAYER_KERNEL_TOLERANCES[expected.dtype]
        if not torch.allclose(actual.float(), expected.float(), atol=atol, rtol=rtol):
            worst = (actual.float() - expected.float()).abs().max().item()
            fail(f"{name}.{case}: differs from the torch reference by up to {worst:.3g} (atol {atol}, rtol {rtol})")

    def unchanged(case: str, before: torch.Tensor, after: torch.Tensor) -> None:
        if not torch.equal(before, after):
            fail(f"{name}.{case}: modified its input")

    for dtype in dtypes:
        for tokens in num_tokens:
            where = f"(dtype={dtype}, tokens={tokens})"
            x, residual = randn(tokens, 576, dtype=dtype, scale=3.0), randn(tokens, 576, dtype=dtype)
            weight = randn(576, dtype=dtype)
            x_before, residual_before = x.clone(), residual.clone()
            compare(f"rms_norm{where}", candidate.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
            normed, total = candidate.add_rms_norm(x, residual, weight, 1e-6)
            expected_normed, expected_total = reference.add_rms_norm(x, residual, weight, 1e-6)
            compare(f"add_rms_norm{where} (the sum)", total, expected_total)
            compare(f"add_rms_norm{where} (the norm)", normed, expected_normed)
            unchanged(f"add_rms_norm{where}", x_before, x)
            unchanged(f"add_rms_norm{where}", residual_before, residual)

            projection = randn(tokens, 6, 32, dtype=dtype)
            heads, head_weight = projection[:, :4], randn(32, dtype=dtype)  # a strided slice of the heads
            expected = reference.rms_norm(heads, head_weight, 1e-6)
            compare(f"rms_norm{where} of strided heads", candidate.rms_norm(heads, head_weight, 1e-6), expected)

            gate_up = randn(tokens, 2 * 1100, dtype=dtype, scale=3.0)
            gate_up_before = gate_up.clone()
            compare(f"silu_and_mul{where}", candidate.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
            unchanged(f"silu_and_mul{where}", gate_up_before, gate_up)

            for head_dim in (64, 96):
                num_heads, num_kv_heads = 4, 2
                query_and_key_width = (num_heads + num_kv_heads) * head_dim
                qkv = randn(tokens, query_and_key_width + num_kv_heads * head_dim, dtype=dtype)
                values_before = qkv[:, query_and_key_width:].clone()
                angles = torch.rand(tokens, 1, head_dim // 2, generator=generator) * 1000
                cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)  # as RotaryEmbedding keeps it
                cos, sin = cos_sin.chunk(2, dim=-1)
                query_and_key = qkv[:, :query_and_key_width].unflatten(-1, (num_heads + num_kv_heads, head_dim))
                expected = reference.rotary(query_and_key, cos, sin)
                compare(f"rotary{where} (head_dim={head_dim})", candidate.rotary(query_and_key, cos, sin), expected)
                unchanged(f"rotary{where} (the values' columns)", values_before, qkv[:, query_and_key_width:])

            for out_features, in_features in ((45, 96), (80, 1536)):
                dense = randn(out_features, in_features, dtype=dtype)
                packed = candidate.pack_dense_weight(dense)
                if packed is None:
                    continue
                rows = randn(tokens, in_features, dtype=dtype)
                for bias in (None, randn(out_features, dtype=dtype)):
                    case = f"dense_linear{where} ({out_features} x {in_features}, bias={bias is not None})"
                    actual = candidate.dense_linear(rows, packed, out_features, bias)
                    expected = F.linear(rows.float(), dense.float(), None if bias is None else bias.float())
                    magnitude = F.linear(
                        rows.float().abs(), dense.float().abs(), None if bias is None else bias.float().abs()
                    )
                    atol, rtol = LAYER_KERNEL_TOLERANCES[dtype]
                    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
                        got = getattr(actual, "shape", type(actual).__name__)
                        fail(f"{name}.{case}: returned {got}, expected {expected.shape}")
                    if not bool(((actual.float() - expected).abs() <= rtol * magnitude + atol).all()):
                        worst = (actual.float() - expected).abs().max().item()
                        fail(f"{name}.{case}: differs from F.linear by up to {worst:.3g}")
