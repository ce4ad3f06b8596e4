"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): quantize a weight column by column and spread each
column's rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer's inputs, so that the layer's output on the calibration inputs changes as little as possible.

As llm-compressor's ``GPTQModifier`` does it (so that the two agree): the Hessian is ``2 X^T X`` summed
over the calibration inputs and divided by the number of samples; inputs that are always zero ("dead"
columns) get weight 0; ``dampening * mean(diag H)`` is added to the diagonal; the update factor is the
upper Cholesky factor of ``H^-1``; columns are processed in blocks of ``block_size`` with a lazy batch
update of the rest after each block; with ``act_order`` the columns go in decreasing order of the
Hessian's diagonal ("static" / "weight" activation ordering), and each keeps the scale of its own group.
Scales come from min-max over the original weight's groups before any update (static groups), so the
checkpoint needs no ``g_idx``.
"""

from __future__ import annotations

import logging

import torch

from tokenmill_plugins.commands.quantize.schemes import (
    QuantizedWeight,
    QuantScheme,
    dequantize,
    quantize,
    weight_qparams,
)

logger = logging.getLogger(__name__)


class HessianAccumulator:
    """``2 X^T X / num_samples`` of a linear's inputs, fed one batch of samples at a time."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32)  # [in, in]
        self.num_samples = 0

    def add(self, inputs: torch.Tensor, num_samples: int) -> None:
        """Add the rows of ``inputs`` [num_tokens, in_features], which come from ``num_samples`` samples."""
        x = inputs.reshape(-1, inputs.shape[-1]).float() * 2**0.5
        self.hessian += x.T @ x
        self.num_samples += num_samples

    def result(self) -> torch.Tensor:
        assert self.num_samples > 0, "no calibration input reached this layer"
        return self.hessian / self.num_samples


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: QuantScheme,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
) -> QuantizedWeight:
    """Quantize ``weight`` [out, in] with GPTQ given the Hessian [in, in] of its inputs."""
    W = weight.detach().float().clone()  # [out, in]
    H = hessian.detach().float().clone()  # [in, in]
    num_columns = W.shape[1]
    scale, zero_point = weight_qparams(W, scheme)  # [out, num_groups]: from the weight before any update
    group_size = scheme.group_size or num_columns
    group_index = torch.arange(num_columns) // group_size  # [in]

    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1.0
    W[:, dead] = 0.0
    perm = None
    if scheme.act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H, group_index = W[:, perm], H[perm][:, perm], group_index[perm]
    H.diagonal().add_(dampening * H.diagonal().mean())
    factor, info = torch.linalg.cholesky_ex(H)
    if int(info) == 0:
        # The upper Cholesky factor U of H^-1 (U^T U = H^-1): row i of U holds how the error of column i
        # moves the columns after it.
        U = torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)  # [in, in]
    else:
        logger.warning("Hessian not positive definite even after dampening; rounding this layer to nearest")
        U = torch.eye(num_columns)

    codes = torch.zeros(W.shape, dtype=torch.float8_e4m3fn if scheme.weight_type == "float" else torch.int8)
    for start in range(0, num_columns, block_size):
        end = min(start + block_size, num_columns)
        block = W[:, start:end].clone()  # [out, width]
        errors = torch.zeros_like(block)  # [out, width]
        U_block = U[start:end, start:end]
        for i in range(end - start):
            column = block[:, i]
            group = group_index[start + i]
            zero = None if zero_point is None else zero_point[:, group]
            column_codes = quantize(column, scale[:, group], zero, scheme)
            codes[:, start + i] = column_codes
            error = (column - dequantize(column_codes, scale[:, group], zero)) / U_block[i, i]  # [out]
            block[:, i:] -= error[:, None] * U_block[i, i:][None, :]
            errors[:, i] = error
        W[:, end:] -= errors @ U[start:end, end:]
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return QuantizedWeight(codes, scale, zero_point)
