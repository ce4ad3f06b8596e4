"""``LoRAManager``: the engine's adapters, in memory and in the model's slots.

Built once per engine process when ``lora.enable_lora`` is set; the executor owns it. It installs a
``LinearLoRA`` on each adaptable linear of the model (q/k/v/o and gate/up/down, merged or not) and keeps two
least-recently-used caches, as vLLM's worker LoRA manager does:

- up to ``max_cpu_loras`` adapters read from disk and checked (``add_adapter``, when a request naming one
  arrives), in host memory;
- up to ``max_loras`` of them in the model's slots, on the device. Each step, ``set_step`` puts the step's
  adapters in slots (a slot whose adapter the step does not use is reused, the least recently used first) and
  lays the step's tokens out by slot for the kernels. The scheduler admits no more distinct adapters than there
  are slots, so a step's adapters always fit.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy
import torch
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.lora.adapter import SUPPORTED_TARGET_MODULES, LoRAAdapterError, read_adapter
from tokenmill.lora.kernels import LoRAKernels
from tokenmill.lora.layers import LinearLoRA, LoRAContext
from tokenmill.lora.request import LoRARequest
from tokenmill.plugin_manager import Slot
from tokenmill.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.model_loader import LoadedModel
    from tokenmill.plugin_manager import PluginSystem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _AdapterWeights:
    """One adapter in host memory: per module, ``lora_a`` ``[r, in]`` and ``lora_b`` ``[out, r]`` scaled."""

    request: LoRARequest
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    """Adapters by ``lora_int_id``: read, checked, cached on the host and placed in the model's slots."""

    def __init__(
        self,
        model: nn.Module,
        kernels: LoRAKernels,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.device = device
        self.dtype = dtype
        self.context = LoRAContext(kernels)
        #: Checkpoint module name (``model.layers.0.self_attn.q_proj``) -> its layer's slots and its part there.
        self.targets: dict[str, tuple[LinearLoRA, int]] = {}
        #: The same names -> (in_features, out_features): what an adapter is checked against.
        self.linear_shapes: dict[str, tuple[int, int]] = {}
        self.layers: list[LinearLoRA] = []
        packed: dict[str, tuple[str, ...]] = getattr(model, "packed_modules", {})
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or "." not in name:
                continue
            parent, leaf = name.rsplit(".", 1)
            parts = packed.get(leaf, (leaf,))
            if len(parts) != len(module.part_sizes) or not set(parts) <= set(SUPPORTED_TARGET_MODULES):
                continue
            layer = LinearLoRA(self.context, module.in_features, module.part_sizes, max_loras, max_lora_rank,
                               dtype, device)  # fmt: skip
            module.lora = layer
            self.layers.append(layer)
            for index, part in enumerate(parts):
                self.targets[f"{parent}.{part}"] = (layer, index)
                self.linear_shapes[f"{parent}.{part}"] = (module.in_features, module.part_sizes[index])
        if not self.layers:
            raise LoRAAdapterError(
                f"{type(model).__name__} has no linears LoRA applies to ({', '.join(SUPPORTED_TARGET_MODULES)})"
            )
        self._cpu: OrderedDict[int, _AdapterWeights] = OrderedDict()  # least recently used first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self._free_slots = list(range(max_loras))
        #: Adapters loaded since start (for metrics and tests).
        self.num_loads = 0

    # ------------------------------------------------------------ adapters

    def add_adapter(self, request: LoRARequest) -> None:
        """Read and check ``request``'s adapter into host memory unless it is there. Called when a request naming
        it arrives, in the engine loop. Raises ``LoRAAdapterError`` with one line (a wrong base, a rank above
        ``max_lora_rank``, an id that already names another adapter)."""
        known = self._cpu.get(request.lora_int_id)
        if known is not None:
            if known.request.lora_path != request.lora_path:
                raise LoRAAdapterError(
                    f"lora_int_id {request.lora_int_id} already names adapter {known.request.lora_name!r} at "
                    f"{known.request.lora_path!r}, not {request.lora_path!r}; give each adapter its own id"
                )
            self._cpu.move_to_end(request.lora_int_id)
            return
        self._cpu[request.lora_int_id] = self._read(request)
        while len(self._cpu) > self.max_cpu_loras:
            evicted, _ = self._cpu.popitem(last=False)
            logger.debug("LoRA adapter %d left host memory", evicted)

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter: its host copy and its slot (``/v1/unload_lora_adapter``)."""
        self._cpu.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    @property
    def num_cpu_adapters(self) -> int:
        return len(self._cpu)

    @property
    def slot_adapters(self) -> dict[int, int]:
        """``lora_int_id -> slot`` of the adapters in slots."""
        return dict(self._slot_of)

    def _read(self, request: LoRARequest) -> _AdapterWeights:
        from safetensors.torch import load_file

        adapter = read_adapter(request.lora_path, self.linear_shapes, self.max_lora_rank)
        tensors = load_file(str(adapter.weights_path), device="cpu")
        modules = {}
        for name, spec in adapter.modules.items():
            lora_a = tensors[spec.lora_a].float()
            lora_b = tensors[spec.lora_b].float() * spec.scaling
            modules[name] = (lora_a.to(self.dtype), lora_b.to(self.dtype))
        self.num_loads += 1
        logger.info(
            "LoRA adapter %r (id %d) read from %s: %d modules, rank <= %d",
            request.lora_name, request.lora_int_id, request.lora_path, len(modules), adapter.max_rank,
        )  # fmt: skip
        return _AdapterWeights(request, modules)

    # ------------------------------------------------------------ the step

    def set_step(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Put the adapters of the step's requests in slots and lay its tokens out by slot (each request's
        ``num_new_tokens`` in order, as the model runner flattens them). Called once per step, before the
        forward."""
        self.set_batch([s.request.lora_request for s in scheduled], [s.num_new_tokens for s in scheduled])

    def set_batch(self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> None:
        """``set_step`` for a batch given as each sequence's adapter (None: none) and number of tokens, in the
        order the forward's input is laid out (tests and tools that run the model runner themselves)."""
        if not any(lora_requests):
            self.context.batch = None
            return
        in_step = {r.lora_int_id for r in lora_requests if r is not None}
        assert len(in_step) <= self.max_loras, f"{len(in_step)} adapters in one step, {self.max_loras} slots"
        slots = [-1 if r is None else self._activate(r, in_step) for r in lora_requests]
        counts = numpy.asarray(num_tokens, dtype=numpy.int64)
        token_slots = numpy.repeat(numpy.asarray(slots, dtype=numpy.int64), counts)  # [num_tokens]
        self.context.batch = self.context.kernels.prepare(token_slots, self.device)

    def _activate(self, request: LoRARequest, in_step: set[int]) -> int:
        """The slot of ``request``'s adapter, loading it there (from host memory, or disk) if it is not in one."""
        lora_id = request.lora_int_id
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next(i for i in self._slot_of if i not in in_step)
            slot = self._slot_of.pop(victim)
        self.add_adapter(request)  # back from disk if it left host memory
        weights = self._cpu[lora_id]
        for layer in self.layers:
            layer.clear_slot(slot)
        for module, (lora_a, lora_b) in weights.modules.items():
            layer, part = self.targets[module]
            layer.set_slot(slot, part, lora_a.to(self.device), lora_b.to(self.device))
        self._slot_of[lora_id] = slot
        return slot


def build_lora_manager(config: EngineConfig, plugins: PluginSystem, loaded: LoadedModel) -> LoRAManager | None:
    """The engine's ``LoRAManager`` over its model when ``lora.enable_lora`` is set, with the selected kernels;
    else None. Called once per engine process, after the model has loaded."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    kernels: LoRAKernels = plugins.create(Slot.LORA_KERNEL, lora.lora_kernels)
    if loaded.device.type not in kernels.supported_devices:
        raise LoRAAdapterError(
            f"lora.lora_kernels={lora.lora_kernels!r} does not run on {loaded.device.type}; "
            f"it runs on {', '.join(kernels.supported_devices)}"
        )
    # On the CPU the adapters add in float32, whatever the model's dtype; on a GPU in the model's dtype.
    dtype = torch.float32 if loaded.device.type == "cpu" else loaded.dtype
    return LoRAManager(loaded.model, kernels, lora.max_loras, lora.max_lora_rank,
                       lora.max_cpu_loras or lora.max_loras, loaded.device, dtype)  # fmt: skip
