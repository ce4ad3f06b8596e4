"""AWQ (Lin et al., 2023, arXiv:2306.00978): scale the input channels that see large activations up
before rounding, and fold the inverse scale into the operation that produces those inputs, so that
the channels that matter most lose least to rounding; then round to nearest, asymmetric with zero points.

As llm-compressor's ``AWQModifier`` (and AutoAWQ) search it, per mapping "smooth op -> balance linears":
``scales = mean|x|^r / (mean normalised |w| ^ (1 - r) + 1e-4)`` clamped at 1e-4 and normalised by
``sqrt(max * min)``, for ``r`` on a grid of ``n_grid - 1`` ratios in [0, 1] plus the identity
(``r = 0`` without the weight term); each candidate's balance weights are ``Q(W * s) / s`` and the scale
whose parent module output (attention, MLP, or the linear itself) is closest to the float one in mean
squared error on the calibration inputs wins. The smooth op's output (a norm's weight, or the rows of
the linear before) is divided by the scales and the balance weights multiplied by them: the float model
computes exactly what it did before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from tokenmill_plugins.commands.quantize.schemes import QuantScheme, fake_quantize, weight_qparams

logger = logging.getLogger(__name__)


def awq_grid(n_grid: int = 20) -> list[tuple[float, bool]]:
    """``(ratio, duo_scaling)`` candidates: the identity, then ``n_grid - 1`` ratios from 0 to 1."""
    return [(0.0, False)] + [(i / (n_grid - 2), True) for i in range(n_grid - 1)]


def weight_means(weights: Sequence[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """Mean over output rows of ``|w| / max |w|`` within each quantization group, per input channel [in]."""
    total = None
    rows = 0
    for weight in weights:
        out_features, in_features = weight.shape
        chunk = scheme.group_size or in_features
        normalised = weight.float().abs().reshape(-1, chunk)
        normalised = normalised / (normalised.amax(dim=1, keepdim=True) + 1e-6)
        column_sums = normalised.reshape(out_features, in_features).sum(dim=0, dtype=torch.float64)
        total = column_sums if total is None else total + column_sums
        rows += out_features
    assert total is not None
    return (total / rows).float()


def search_scales(
    activation_mean: torch.Tensor,
    balance_weights: Sequence[torch.nn.Parameter],
    scheme: QuantScheme,
    loss: Callable[[], float],
    n_grid: int = 20,
) -> torch.Tensor:
    """The input-channel scales [in] that minimise ``loss()`` (the parent module's error on the calibration
    inputs, computed with the balance weights as they are set during the call). The weights are left as found."""
    originals = [w.detach().clone() for w in balance_weights]
    weight_mean = weight_means(originals, scheme)
    best_scales, best_loss, initial_loss = None, float("inf"), None
    try:
        for ratio, duo in awq_grid(n_grid):
            if duo:
                scales = (activation_mean.pow(ratio) / (weight_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
            else:
                scales = activation_mean.pow(ratio).clamp(min=1e-4)
            scales = scales / (scales.max() * scales.min()).sqrt()
            scales[~torch.isfinite(scales)] = 1.0
            for parameter, original in zip(balance_weights, originals, strict=True):
                scaled = original * scales[None, :]
                qparams = weight_qparams(scaled, scheme)
                parameter.data.copy_(fake_quantize(scaled, *qparams, scheme) / scales[None, :])
            error = loss()
            initial_loss = error if initial_loss is None else initial_loss
            if error < best_loss:
                best_loss, best_scales = error, scales.clone()
    finally:
        for parameter, original in zip(balance_weights, originals, strict=True):
            parameter.data.copy_(original)
    if best_scales is None:
        raise ValueError("AWQ: no finite loss on the grid; the float model produces NaN on the calibration text")
    logger.debug("AWQ: loss %.3e -> %.3e", initial_loss, best_loss)
    return best_scales
