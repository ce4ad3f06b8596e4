"""``CausalLM``: what every architecture plugin provides, and weight loading shared by all."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from tokenmill.attention.backend import AttentionLayerSpec, AttentionMetadata
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.fast_module import FastModule
from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.parallel.sharding import SplitInput
from tokenmill.weights.format import LoadedTensor, WeightsError

if TYPE_CHECKING:
    from tokenmill.layers.kernels import FusedDecoder
    from tokenmill.models.architecture import ArchitectureConfig

logger = logging.getLogger(__name__)

#: Checkpoint tensors that carry no weights we use (buffers older exporters saved).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CausalLM(FastModule):
    """A decoder-only language model over a paged KV cache.

    Built by the model loader as ``cls(arch_config, attention_backend,
    quantizer, dtype)`` on the meta device, then materialised and filled by
    ``load_weights``. ``forward`` runs once per step in the engine process.

    An architecture that can be split over tensor-parallel shards sets ``supports_tensor_parallel`` and takes
    a ``tp`` keyword (a ``tokenmill.parallel.TensorParallelGroup``): each shard builds only its part, and
    ``compute_logits`` returns the whole vocabulary's logits on rank 0.
    """

    #: Whether the constructor takes ``tp=`` and builds one shard of the model (the loader refuses
    #: ``parallel.tensor_parallel_size`` > 1 for architectures without it).
    supports_tensor_parallel: ClassVar[bool] = False
    #: Whether its linears run over the selected ``Quantizer`` (the loader's quantizer other than ``none``).
    supports_quantization: ClassVar[bool] = True
    #: The layer kernels' runner of the whole decoder stack in one call (``LayerKernels.fused_decoder``), set
    #: by the loader; an architecture whose ``forward`` does not call it leaves it unused.
    fused_decoder: FusedDecoder | None = None

    @classmethod
    def tensor_parallel_inputs(cls, config: ArchitectureConfig, expert_parallel: bool) -> list[SplitInput]:
        """The feed-forward blocks' row-parallel inputs that tensor parallelism splits (the dense MLP's down_proj;
        a mixture of experts lists its experts'): ``check_shardable`` refuses a shard count that does not divide
        each into whole quantizer blocks. Called once by the loader, before anything loads, with
        ``parallel.enable_expert_parallel``."""
        return [SplitInput("intermediate size", "down_proj", config.intermediate_size)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # one per layer
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states of every token, [num_tokens, hidden_size]."""
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Float32 logits [num_selected, vocab_size] for the selected hidden states."""
        raise NotImplementedError

    def attention_specs(self) -> list[AttentionLayerSpec]:
        """Each attention layer's spec, in layer order (the order of the runner's ``kv_caches``).

        Called by tools that drive the attention backend without the model (``bench step``),
        not per step. The default collects every submodule's ``spec`` attribute; an
        architecture whose layers keep their spec elsewhere overrides it.
        """
        specs = (getattr(module, "spec", None) for module in self.modules())
        return [spec for spec in specs if isinstance(spec, AttentionLayerSpec)]

    def load_weights(self, tensors: Iterable[LoadedTensor]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, one at a time.

        Raises ``WeightsError`` naming the file and tensor for a shape or type
        mismatch, and naming the missing tensors if any parameter was never loaded.
        """
        params = dict(self.named_parameters())
        # Checkpoint module name -> the linear holding it and which of its parts it is.
        linears: dict[str, tuple[Linear, int]] = {
            name: (module, 0)
            for name, module in self.named_modules()
            if isinstance(module, Linear) and not isinstance(module, MergedLinear)
        }
        linears.update(self._checkpoint_shards())
        for module_name, (holder, _) in linears.items():
            if holder.quantizer.leaves_unquantized(module_name):
                raise WeightsError(
                    f"the checkpoint leaves {module_name} unquantized ({holder.quantizer.name} ignore list); "
                    "supported: one scheme for every linear but lm_head (MoE routers may be left out)"
                )
        # Parameters of which this tensor-parallel shard holds some rows only.
        embeddings = {
            f"{name}.weight": module
            for name, module in self.named_modules()
            if isinstance(module, VocabParallelEmbedding)
        }
        loaded: set[str] = set()
        files: set[Path] = set()
        for item in tensors:
            files.add(item.file)
            name = item.name
            if name.endswith(_IGNORED_SUFFIXES) or self.skip_checkpoint_tensor(name):
                continue
            for target in (name, *self.checkpoint_aliases(name)):
                module_name, _, param_name = target.rpartition(".")
                linear, part = linears.get(module_name, (None, 0))
                if linear is not None and linear.accepts(param_name):
                    try:
                        linear.load_checkpoint_tensor(param_name, item.tensor, part)
                    except ValueError as exc:
                        raise WeightsError(f"{item.file}: tensor {name!r} {exc}") from exc
                elif target in embeddings:
                    try:
                        params[target].data.copy_(embeddings[target].take(item.tensor))
                    except ValueError as exc:
                        raise WeightsError(f"{item.file}: tensor {name!r} {exc}") from exc
                elif target in params:
                    _check_shape(item, tuple(params[target].shape))
                    params[target].data.copy_(item.tensor)
                else:
                    raise WeightsError(f"{item.file}: tensor {name!r} does not belong to {type(self).__name__}")
                loaded.add(target)
        # A quantizer stores a linear's weight under names of its own; expect the checkpoint's names.
        holders = {name for name, module in self.named_modules() if isinstance(module, Linear)}
        expected = {n for n in params if n.rpartition(".")[0] not in holders}
        for module_name, (linear, _) in linears.items():
            expected.update(f"{module_name}.{tensor}" for tensor in linear.quantizer.checkpoint_tensor_names)
            if linear.has_bias:
                expected.add(f"{module_name}.bias")
        missing = sorted(expected - loaded)
        if missing:
            source = ", ".join(str(f) for f in sorted(files)) or "the checkpoint"
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise WeightsError(f"{source}: missing tensors {shown}")

    #: Merged linears and the checkpoint modules they hold, in order: ``{"qkv_proj": ("q_proj", ...)}``.
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {}

    def _checkpoint_shards(self) -> dict[str, tuple[Linear, int]]:
        """Checkpoint module name -> (the merged linear holding it, its part index)."""
        shards: dict[str, tuple[Linear, int]] = {}
        for name, module in self.named_modules():
            if isinstance(module, MergedLinear):
                parent, _, attribute = name.rpartition(".")
                for index, part in enumerate(self.packed_modules[attribute]):
                    shards[f"{parent}.{part}" if parent else part] = (module, index)
        return shards

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor is deliberately unused (e.g. ``lm_head`` when tied)."""
        return False

    def checkpoint_aliases(self, name: str) -> tuple[str, ...]:
        """Other parameters a checkpoint tensor also fills (a tied embedding that a quantized
        ``lm_head`` keeps its own copy of). Called once per checkpoint tensor at load."""
        return ()


def _check_shape(item: LoadedTensor, expected: tuple[int, ...]) -> None:
    if tuple(item.tensor.shape) != expected:
        raise WeightsError(
            f"{item.file}: tensor {item.name!r} has shape {list(item.tensor.shape)}, expected {list(expected)}"
        )
