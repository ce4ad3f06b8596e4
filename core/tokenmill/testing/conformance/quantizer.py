"""``check_quantizer``: a quantizer's matmul against float math on the weights it dequantizes to."""

from __future__ import annotations

import torch

from tokenmill.layers.linear import Linear
from tokenmill.layers.quantizer import Quantizer
from tokenmill.testing.conformance._util import conformance_check, fail, instantiate


@conformance_check
def check_quantizer(
    quantizer: type[Quantizer] | Quantizer,
    *,
    in_features: int = 128,
    out_features: int = 48,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_rows: tuple[int, ...] = (1, 3, 40),
    weight_tolerance: float = 0.1,
    activation_tolerance: float = 1 / 127,
    seed: int = 0,
) -> None:
    """Check a quantizer through a ``tokenmill.layers.Linear`` it owns, as a model uses it.

    The weights it holds are read back by multiplying the identity (``apply(I) - bias``), which any
    correct quantizer computes exactly: a one-hot row survives activation rounding. Then:

    - those dequantized weights are the loaded ones up to quantization error (each within
      ``weight_tolerance`` of the row's largest weight);
    - ``apply(x)`` equals ``x @ W_dq.T + bias`` in float64 for ``num_rows`` rows, up to rounding of the
      activations: per output, ``activation_tolerance * max|x_row| * sum|W_dq row|`` plus float32 noise;
    - a row's result does not depend on the other rows in the batch; the result has shape
      ``[rows, out_features]`` and ``dtype``; ``apply`` leaves ``x`` unchanged and gives the same result
      twice; ``output_quantizer()`` returns a ``Quantizer``; a dense quantizer keeps ``layer.weight``.

    :param quantizer: the class (built with no arguments, as the engine builds it) or an instance.
    :raises AssertionError: naming the case and what differs.
    """
    candidate = instantiate(quantizer)
    name = type(candidate).__name__
    if not isinstance(candidate.output_quantizer(), Quantizer):
        fail(f"{name}.output_quantizer() returned {candidate.output_quantizer()!r}, not a Quantizer")
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1  # [out, in]
    weight[0] *= 40  # rows of very different magnitudes
    bias = torch.randn(out_features, generator=generator)  # [out]
    with torch.device(device):
        layer = Linear(in_features, out_features, bias=True, quantizer=candidate, dtype=dtype)
    layer.load_weight("weight", weight.to(dtype))
    layer.load_weight("bias", bias.to(dtype))
    layer_bias = bias.to(dtype).double()
    dense_weight = getattr(layer, "weight", None)
    if candidate.is_dense and not (
        isinstance(dense_weight, torch.Tensor) and torch.equal(dense_weight, weight.to(dtype).to(device))
    ):
        fail(f"{name} sets is_dense = True but layer.weight is not the loaded weight in {dtype}")

    identity = torch.eye(in_features, dtype=dtype, device=device)  # [in, in]
    dequantized = (candidate.apply(layer, identity).double().cpu() - layer_bias).T  # [out, in]
    if tuple(dequantized.shape) != (out_features, in_features):
        fail(f"{name}.apply on {in_features} rows returned shape {tuple(dequantized.T.shape)}, "
             f"expected ({in_features}, {out_features})")  # fmt: skip
    row_scale = weight.double().abs().amax(dim=1, keepdim=True)  # [out, 1]
    weight_error = ((dequantized - weight.double()).abs() / row_scale).max().item()
    if not weight_error <= weight_tolerance:
        fail(f"{name}: the weights it multiplies by differ from the loaded ones by up to {weight_error:.3g} of "
             f"each row's largest weight (allowed: {weight_tolerance}); is load_weight storing [out, in] "
             "and apply computing x @ W.T + bias?")  # fmt: skip

    x_all = torch.randn(max(num_rows), in_features, generator=generator)  # [rows, in]
    x_all[1::2] *= 10  # rows of different magnitudes, so per-row rounding matters
    for rows in num_rows:
        x = x_all[:rows].to(dtype).to(device)
        original = x.clone()
        got = candidate.apply(layer, x)
        where = f"{name}.apply on {rows} row(s) of {in_features}"
        if tuple(got.shape) != (rows, out_features) or got.dtype != dtype:
            fail(f"{where} returned {tuple(got.shape)} {got.dtype}, expected ({rows}, {out_features}) {dtype}")
        if not torch.equal(x, original):
            fail(f"{where} changed its input")
        if not torch.equal(candidate.apply(layer, x), got):
            fail(f"{where} is not deterministic: a second call gave another result")
        x64 = x.double().cpu()
        expected = x64 @ dequantized.T + layer_bias  # [rows, out]
        noise = torch.finfo(dtype).eps * 8 * (x64.abs() @ dequantized.abs().T + layer_bias.abs())
        allowed = activation_tolerance * x64.abs().amax(dim=1, keepdim=True) * dequantized.abs().sum(dim=1) + noise
        excess = (got.double().cpu() - expected).abs() - allowed
        if excess.max().item() > 0:
            row, col = divmod(int(excess.argmax()), out_features)
            fail(f"{where}: output [{row}, {col}] is {got[row, col].item():.6g}, but x @ W_dq.T + bias is "
                 f"{expected[row, col].item():.6g} (allowed error {allowed[row, col].item():.3g})")  # fmt: skip
        alone = candidate.apply(layer, x[-1:].clone())
        if not torch.allclose(alone.double().cpu(), got[-1:].double().cpu(), rtol=1e-5, atol=1e-5):
            fail(f"{where}: the last row's result changes when it is computed alone")
