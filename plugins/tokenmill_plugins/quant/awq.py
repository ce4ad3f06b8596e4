"""AWQ checkpoints in the GEMM layout that AutoAWQ and GPTQModel write (``quant_method: awq``, ``version: gemm``).

Per linear: ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` int32 ``[groups, out / 8]``, eight 4-bit codes per
int32 along the output, interleaved (the code in bits ``4i`` belongs to column ``8w + (0, 2, 4, 6, 1, 3, 5, 7)[i]``
of word ``w``), and ``scales`` float16 ``[groups, out]``. ``w = (q - zero) * scale``, zero points stored as they
are. 4 bits, group sizes that are multiples of 32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from tokenmill_plugins.quant.checkpoint_quantizer import CheckpointQuantizer, integer_input_group
from tokenmill_plugins.quant.checkpoint_weights import IntWeight, unpack_int32
from tokenmill_plugins.quant.config_checks import check_choice, check_group_size, expect_shape, num_groups

#: Column of each nibble within a word of eight.
_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _unpack_awq(packed: Tensor, count: int) -> Tensor:
    """uint8 ``[rows, count]`` codes in column order from AWQ's interleaved words."""
    nibbles = unpack_int32(packed, 4, dim=1, count=count)
    columns = torch.tensor(_ORDER).repeat(count // 8) + torch.arange(count) // 8 * 8  # nibble -> column
    codes = torch.empty_like(nibbles)
    codes[:, columns] = nibbles
    return codes


class AWQQuantizer(CheckpointQuantizer):
    name: ClassVar[str] = "awq"
    quant_methods: ClassVar[tuple[str, ...]] = ("awq",)

    group_size: int = 128

    def configure(self, quantization_config: Mapping[str, Any]) -> None:
        config = quantization_config
        check_choice("awq", "bits", config.get("bits", config.get("w_bit")), (4,))
        self.group_size = check_group_size("awq", config.get("group_size", config.get("q_group_size", 128)))
        self.input_group_size = integer_input_group(self.group_size)
        version = str(config.get("version") or config.get("format") or "gemm").lower()
        check_choice("awq", "version", version, ("gemm",))
        if config.get("zero_point") is False:
            raise ValueError("awq: zero_point false is not supported; supported: zero_point true (AutoAWQ's default)")
        if config.get("modules_to_not_convert"):
            raise ValueError("awq: modules_to_not_convert is not supported; supported: every linear but lm_head")
        self.weight_kind = "int4"
        self.checkpoint_tensor_names = ("qweight", "qzeros", "scales")

    def read_checkpoint(self, tensors: Mapping[str, Tensor], out_features: int, in_features: int) -> Any:
        group_size, groups = num_groups(in_features, self.group_size)
        if out_features % 8:
            raise ValueError(f"belongs to a module with {out_features} outputs; AWQ packs them in eights")
        qweight = expect_shape(tensors, "qweight", (in_features, out_features // 8), torch.int32)
        qzeros = expect_shape(tensors, "qzeros", (groups, out_features // 8), torch.int32)
        scales = expect_shape(tensors, "scales", (groups, out_features), None)
        return IntWeight(
            bits=4,
            codes=_unpack_awq(qweight, out_features).T.contiguous(),  # [out, in]
            scales=scales.float().T.contiguous(),  # [out, groups]
            zeros=_unpack_awq(qzeros, out_features).float().T.contiguous(),
            group_size=group_size,
        )
