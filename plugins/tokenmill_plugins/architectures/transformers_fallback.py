"""``TransformersForCausalLM``: any decoder transformers implements, on tokenmill's paged KV cache.

For a checkpoint whose architecture no plugin implements natively, the model loader picks this one
(``model.model_impl = "auto"``, logged) or it is asked for by name (``"transformers"``). transformers' own model
class runs the layers; its attention goes through transformers' attention interface
(``AttentionInterface.register("tokenmill", ...)`` and ``attn_implementation="tokenmill"``, as vLLM's Transformers
backend does) to tokenmill's attention backend, which writes and reads the paged KV cache. The step's tokens, from
all requests, enter as one sequence of batch 1 with their own positions; transformers builds no mask for a custom
attention function, and the backend masks each request's tokens by its block table, so continuous batching, chunked
prefill, prefix caching and preemption work as for a native model.

What it lacks (docs/models.md): tokenmill's quantizers (weights stay dense), its layer kernels, tensor parallelism;
the model is built at load, on the device, with transformers' weights left uninitialised until the checkpoint's are
copied in by name. Logits get what the model's ``forward`` applies after the output projection where the config
says so (Granite's ``logits_scaling``, Cohere's ``logit_scale``, ``final_logit_softcapping``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from tokenmill.layers.quantizer import Quantizer
from tokenmill.models.architecture import ArchitectureConfig, ArchitectureError
from tokenmill.models.base import CausalLM
from tokenmill.weights.format import LoadedTensor, WeightsError

logger = logging.getLogger(__name__)

#: The ``attn_implementation`` name tokenmill's attention is registered under in transformers.
ATTENTION_NAME = "tokenmill"


def _paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, over the step's paged KV cache; returns [1, num_tokens, heads,
    head_dim] as transformers' own functions do."""
    model: TransformersForCausalLM = module.__dict__["_tokenmill_model"]
    layer_index = int(module.layer_idx)  # type: ignore[arg-type]
    spec = model.layer_spec(module, query.shape[1], key.shape[1], query.shape[-1], scaling)
    kv_caches, metadata = model.step
    out = model.backend.forward(
        spec,
        query[0].transpose(0, 1).contiguous(),  # [num_tokens, heads, head_dim]
        key[0].transpose(0, 1).contiguous(),
        value[0].transpose(0, 1).contiguous(),
        kv_caches[layer_index],
        metadata,
    )
    return out.unsqueeze(0), None


def _no_init_weights() -> contextlib.AbstractContextManager[Any]:
    """transformers' context that skips random initialisation (its module moved in version 5)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef,attr-defined]
    return no_init_weights()


class TransformersForCausalLM(CausalLM):
    """A transformers ``AutoModelForCausalLM`` behind tokenmill's ``CausalLM`` interface."""

    supports_quantization: ClassVar[bool] = False

    def __init__(
        self,
        config: ArchitectureConfig,
        backend: AttentionBackend,
        quantizer: Quantizer,
        dtype: torch.dtype,
        max_position: int | None = None,
    ) -> None:
        super().__init__()
        if not quantizer.is_dense:
            raise ArchitectureError(
                f"the transformers fallback runs {config.architecture} with dense weights only; "
                f"model.quantization={quantizer.name!r} needs a native architecture plugin (use 'none' or 'auto')"
            )
        self.config = config
        self.backend = backend
        self.dtype = dtype
        # Materialised on the model's device by the loader: where load_weights builds the transformers model.
        self.register_buffer("device_anchor", torch.empty(0), persistent=False)
        self.hf_model: Any = None
        self.step: tuple[list[torch.Tensor], AttentionMetadata] = ([], None)  # type: ignore[assignment]
        self._specs: dict[int, AttentionLayerSpec] = {}

    def _build(self) -> Any:
        import transformers
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _paged_attention)  # idempotent: the same function each time
        hf = dict(self.config.hf_config)
        hf_config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        anchor = self.device_anchor
        assert isinstance(anchor, torch.Tensor)
        device = anchor.device
        with torch.device(device), _no_init_weights():
            model = transformers.AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=ATTENTION_NAME, dtype=self.dtype
            )
        model.tie_weights()  # from_config under no_init_weights leaves a tied lm_head its own tensor
        for module in model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "scaling"):  # an attention module
                module.__dict__["_tokenmill_model"] = self  # not a submodule: no cycle in modules()
        return model.eval()

    def layer_spec(
        self, module: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None
    ) -> AttentionLayerSpec:
        """The attention spec of ``module`` (an attention layer), made on its first call."""
        layer_index = int(module.layer_idx)  # type: ignore[arg-type]
        spec = self._specs.get(layer_index)
        if spec is None:
            window = getattr(module, "sliding_window", None)
            soft_cap = getattr(module.config, "attn_logit_softcapping", None)
            spec = AttentionLayerSpec(
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                scale=float(scaling if scaling is not None else head_dim**-0.5),
                sliding_window=int(window) if window else None,
                logits_soft_cap=float(soft_cap) if soft_cap else None,
            )
            self._specs[layer_index] = spec
        return spec

    def load_weights(self, tensors: Iterable[LoadedTensor]) -> None:
        """Build the transformers model on the device, then copy the checkpoint's tensors in by name."""
        self.hf_model = model = self._build()
        params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        loaded: set[str] = set()
        for item in tensors:
            target = params.get(item.name)
            if target is None:
                if item.name.endswith("rotary_emb.inv_freq") or (tied and item.name == "lm_head.weight"):
                    continue
                raise WeightsError(f"{item.file}: tensor {item.name!r} does not belong to {type(model).__name__}")
            if tuple(target.shape) != tuple(item.tensor.shape):
                raise WeightsError(
                    f"{item.file}: tensor {item.name!r} has shape {list(item.tensor.shape)}, "
                    f"expected {list(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(item.tensor)
            loaded.add(item.name)
        missing = sorted(set(dict(model.named_parameters())) - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise WeightsError(f"the checkpoint lacks tensors of {type(model).__name__}: {shown}")
        logger.info(
            "%s runs through the transformers fallback: %s with tokenmill's attention", self.config.architecture,
            type(model).__name__,
        )  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self.step = (kv_caches, metadata)
        try:
            out = self.hf_model.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            self.step = ([], None)  # type: ignore[assignment]
        return out[0][0]  # [num_tokens, hidden]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        config = self.hf_model.config
        logits = self.hf_model.get_output_embeddings()(hidden_states)
        if getattr(config, "logits_scaling", None):  # Granite
            logits = logits / config.logits_scaling
        if getattr(config, "logit_scale", None):  # Cohere
            logits = logits * config.logit_scale
        cap = getattr(config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def attention_specs(self) -> list[AttentionLayerSpec]:
        return [self._specs[index] for index in sorted(self._specs)]
