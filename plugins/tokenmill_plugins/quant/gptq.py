"""GPTQ checkpoints as AutoGPTQ and GPTQModel write them (``quant_method: gptq``).

Per linear: ``qweight`` int32 ``[in * bits / 32, out]`` (codes packed along the input, lowest bits first),
``qzeros`` int32 ``[groups, out * bits / 32]`` (zero points packed along the output), ``scales`` float16
``[groups, out]`` and ``g_idx`` int32 ``[in]`` (each input's group; a permutation of ``i // group_size`` under
``desc_act``). ``w = (q - zero) * scale``. The original ("v1", ``checkpoint_format: gptq``) format stores
``zero - 1``; ``gptq_v2`` stores the zero point itself. 4 and 8 bits, group sizes that are multiples of 32 or -1
(one group per output channel), symmetric or not, ``desc_act`` true or false.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from tokenmill_plugins.quant.checkpoint_quantizer import CheckpointQuantizer, integer_input_group
from tokenmill_plugins.quant.checkpoint_weights import IntWeight, unpack_int32
from tokenmill_plugins.quant.config_checks import check_choice, check_group_size, expect_shape, num_groups

_FORMATS = ("gptq", "gptq_v2")


class GPTQQuantizer(CheckpointQuantizer):
    name: ClassVar[str] = "gptq"
    quant_methods: ClassVar[tuple[str, ...]] = ("gptq",)

    bits: int = 4
    group_size: int = -1
    zero_offset: int = 1

    def configure(self, quantization_config: Mapping[str, Any]) -> None:
        config = quantization_config
        self.bits = check_choice("gptq", "bits", config.get("bits"), (4, 8))
        self.group_size = check_group_size("gptq", config.get("group_size", -1))
        self.input_group_size = integer_input_group(self.group_size)
        checkpoint_format = config.get("checkpoint_format") or config.get("format") or "gptq"
        check_choice("gptq", "checkpoint_format", checkpoint_format, _FORMATS)
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        if config.get("lm_head"):
            raise ValueError("gptq: a quantized lm_head (lm_head: true) is not supported; supported: lm_head in float")
        if config.get("dynamic"):
            raise ValueError("gptq: per-module overrides (dynamic) are not supported; supported: one setting for all")
        self.weight_kind = f"int{self.bits}"
        self.checkpoint_tensor_names = ("g_idx", "qweight", "qzeros", "scales")

    def read_checkpoint(self, tensors: Mapping[str, Tensor], out_features: int, in_features: int) -> Any:
        group_size, groups = num_groups(in_features, self.group_size)
        per_word = 32 // self.bits
        qweight = expect_shape(tensors, "qweight", (in_features // per_word, out_features), torch.int32)
        qzeros = expect_shape(tensors, "qzeros", (groups, -(-out_features // per_word)), torch.int32)
        scales = expect_shape(tensors, "scales", (groups, out_features), None)
        g_idx = expect_shape(tensors, "g_idx", (in_features,), None).long()
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ValueError(f"belongs to a module whose g_idx names groups outside 0..{groups - 1}")
        zeros = unpack_int32(qzeros, self.bits, dim=1, count=out_features).float() + self.zero_offset
        return IntWeight(
            bits=self.bits,
            codes=unpack_int32(qweight, self.bits, dim=0, count=in_features).T.contiguous(),  # [out, in]
            scales=scales.float().T.contiguous(),  # [out, groups]
            zeros=zeros.T.contiguous(),
            group_size=group_size,
            g_idx=g_idx,
        )
