"""``LoRAManager``: the engine's adapters, in memory and in the model's slots.

Built once per engine process when ``lora.enable_lora`` is set; the executor owns it. It installs a
``LinearLoRA`` on each adaptable linear of the model (q/k/v/o and gate/up/down, merged or not) and keeps two
least-recently-used caches, as vLLM's worker LoRA manager does:

- up to ``max_cpu_loras`` adapters read from disk and checked, in host memory. When a request naming an adapter
  arrives, the engine checks its config and tensor header at once (``check_adapter``: a few KB, so a wrong base
  is the request's error), and ``load_adapter`` starts reading its weights, a slice of about two milliseconds each
  step: the request waits in the scheduler until its ``AdapterLoad`` is ready, and the others keep stepping.
  A request holds its adapter's weights until it ends, so one whose adapter left host memory meanwhile never
  waits for the disk again;
- up to ``max_loras`` of them in the model's slots, on the device. Each step, ``set_step`` puts the step's
  adapters in slots (a slot whose adapter the step does not use is reused, the least recently used first) and
  lays the step's tokens out by slot for the kernels, unless the step is laid out as the last one (decode steps
  whose requests did not change). The scheduler admits no more distinct adapters than there are slots, so a
  step's adapters always fit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import msgspec
import numpy
import torch
from torch import nn

from tokenmill.config import ConfigError
from tokenmill.host_memory import anonymous_bytes
from tokenmill.layers.dense import DenseQuantizer
from tokenmill.layers.fused_experts import UsesFusedExperts
from tokenmill.layers.linear import Linear
from tokenmill.layers.moe import Experts
from tokenmill.lora.adapter import SUPPORTED_TARGET_MODULES, LoRAAdapter, LoRAAdapterError, TensorSpec, read_adapter
from tokenmill.lora.kernels import LoRAKernels
from tokenmill.lora.layers import LinearLoRA, LoRAContext, RoutedLoRA
from tokenmill.lora.request import LoRARequest, lora_cache_salt
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import select_lora_kernels
from tokenmill.plugin_manager import Slot
from tokenmill.sampling_params import InvalidRequestError
from tokenmill.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.model_loader import LoadedModel
    from tokenmill.plugin_manager import PluginSystem

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
#: How long one poll of an adapter's read may take on the engine loop, and the most one call to read asks for.
_READ_SLICE_S = 0.002
_READ_CHUNK_BYTES = 1 << 20


#: One adapter's staged parts per adapted linear: ``LinearLoRA.stage``'s ``(lora_a, lora_b)`` by part.
_Staged: TypeAlias = dict[LinearLoRA, dict[int, tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class _AdapterWeights:
    """One adapter in host memory, in its slots' layout (``LinearLoRA.stage``): putting it in a slot is a plain
    copy per part, however many steps later and however often."""

    request: LoRARequest
    adapter: LoRAAdapter
    layers: _Staged


def _file_tensors(adapter: LoRAAdapter, data: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Per module of ``adapter``: ``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]`` (views, in the file's dtype, of
    ``data``, the bytes of its ``adapter_model.safetensors``) and the scaling."""
    typed: dict[str, torch.Tensor] = {}  # the whole buffer as each dtype, where the sizes allow

    def tensor(spec: TensorSpec, view: tuple[tuple[int, int], tuple[int, int], int]) -> torch.Tensor:
        dtype = _TORCH_DTYPES[spec.dtype]
        shape, strides, offset = view
        if spec.start % dtype.itemsize:  # a view needs aligned elements
            whole = data[spec.start : spec.end].clone().view(dtype)
            return whole.as_strided(shape, strides, offset)
        if spec.dtype not in typed:
            typed[spec.dtype] = data[: data.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        return typed[spec.dtype].as_strided(shape, strides, spec.start // dtype.itemsize + offset)

    return {
        name: (tensor(m.lora_a, m.a_view()), tensor(m.lora_b, m.b_view()), m.scaling)
        for name, m in adapter.modules.items()
    }


class _Read:
    """An adapter coming into host memory on the engine loop, about two milliseconds of work each time
    ``advance`` is called: its weights file, then each module staged in its slots' layout (converted, scaled and
    transposed), so that the step where a request first uses it only copies. The scheduler polls every waiting
    request's adapter once a step, so no step waits for a whole file or conversion. Not in a thread: one beside
    the step takes time slices from the step's threads, and the others wait for it at their next barrier. The
    kernel is told to read the file ahead from the disk at the start."""

    def __init__(
        self, request: LoRARequest, adapter: LoRAAdapter, targets: Mapping[str, tuple[LinearLoRA, int]]
    ) -> None:
        self.request = request
        self.adapter = adapter
        self.weights: _AdapterWeights | None = None
        self.error: str | None = None
        self._targets = targets
        # torch's allocator, not numpy's: numpy asks for huge pages for large arrays, and in an engine process the
        # kernel may then compact memory at each fault (milliseconds per MiB read).
        self._data = torch.empty(adapter.weights_size, dtype=torch.uint8).numpy()
        self._done = 0
        self._unstaged: list[tuple[str, tuple[torch.Tensor, torch.Tensor, float]]] | None = None
        self._staged: _Staged = {}
        with contextlib.suppress(OSError, AttributeError), adapter.weights_path.open("rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)

    def advance(self) -> bool:
        """Read and stage on for about ``_READ_SLICE_S``; whether the read has ended (``weights`` or ``error``
        set)."""
        if self.weights is not None or self.error is not None:
            return True
        deadline = time.perf_counter() + _READ_SLICE_S
        try:
            if not self._read_file(deadline) or not self._stage(deadline):
                return False
        except Exception as exc:  # a read that fails fails its requests, not the engine
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        else:
            self.weights = _AdapterWeights(self.request, self.adapter, self._staged)
        self._data = numpy.empty(0, dtype=numpy.uint8)  # the file's bytes, staged or not, are not needed again
        self._unstaged = None
        return True

    def _read_file(self, deadline: float) -> bool:
        """Read the file on until ``deadline``; whether all of it is in ``_data``."""
        if self._unstaged is not None:
            return True
        size, view = self._data.size, self._data.data
        with self.adapter.weights_path.open("rb", buffering=0) as f:
            f.seek(self._done)
            while self._done < size:
                n = f.readinto(view[self._done : self._done + _READ_CHUNK_BYTES])
                if not n:
                    break
                self._done += n
                if self._done < size and time.perf_counter() >= deadline:
                    return False
            if self._done < size or f.read(1):
                where = f"LoRA adapter {str(self.adapter.path)!r}"
                raise LoRAAdapterError(f"{where}: {self.adapter.weights_path.name} changed while it was read")
        self._unstaged = list(_file_tensors(self.adapter, torch.from_numpy(self._data)).items())
        self._unstaged.reverse()  # staged from the end of the list: the file's order
        return time.perf_counter() < deadline

    def _stage(self, deadline: float) -> bool:
        """Stage modules until ``deadline`` (at least one); whether all are staged."""
        assert self._unstaged is not None
        while self._unstaged:
            name, (lora_a, lora_b, scaling) = self._unstaged.pop()
            layer, part = self._targets[name]
            self._staged.setdefault(layer, {})[part] = layer.stage(lora_a, lora_b, scaling)
            if self._unstaged and time.perf_counter() >= deadline:
                return False
        return True


class AdapterLoad:
    """A request's adapter on its way into host memory; the scheduler passes the request over until
    ``is_ready`` (then ``weights`` is set, or ``error`` says why the adapter cannot be used). Read on the engine
    loop only."""

    def __init__(self, manager: LoRAManager, read: _Read | None, weights: _AdapterWeights | None = None) -> None:
        self._manager = manager
        self._read = read
        self.weights = weights
        self.error: str | None = None

    def is_ready(self) -> bool:
        """Whether the adapter is in host memory (or cannot be); each call until then reads a slice of it, and the
        call that ends the read puts it in host memory."""
        if self.weights is not None or self.error is not None:
            return True
        assert self._read is not None
        if not self._read.advance():
            return False
        self.error = self._read.error
        if self.error is not None:
            self._manager._end_load(self._read)  # the next request naming it tries again
        else:
            self.weights = self._read.weights
            assert self.weights is not None
            self._manager._install(self.weights)
        return True


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
        # A MoE layer's routed experts each run on the tokens routed to them, not the step's: their linears read
        # the layout of those tokens, which fused experts kernels that support adapters set per expert. Under
        # kernels that do not, the experts take no adapters.
        self.routed = RoutedLoRA(kernels, device)
        adapted_experts, bare_experts = [], []
        for name, module in model.named_modules():
            experts = getattr(module, "experts", None)
            if isinstance(module, UsesFusedExperts) and isinstance(experts, Experts):
                if module.fused_experts.supports_lora:
                    experts.lora = self.routed
                    adapted_experts.append(f"{name}.experts.")
                else:
                    bare_experts.append(f"{name}.experts.")
        routed, bare = tuple(adapted_experts), tuple(bare_experts)
        adapted: list[tuple[str, Linear, tuple[str, ...], int]] = []  # name, linear, parts, its slots' bytes
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or "." not in name or name.startswith(bare):
                continue
            leaf = name.rsplit(".", 1)[1]
            parts = packed.get(leaf, (leaf,))
            if len(parts) == len(module.part_sizes) and set(parts) <= set(SUPPORTED_TARGET_MODULES):
                size = LinearLoRA.slot_bytes(module.in_features, module.part_sizes, max_loras, max_lora_rank, dtype)
                adapted.append((name, module, parts, -(-size // 64) * 64))
        # On the host, all slots in one mapping of huge pages, in the order the layers read them, faulted in now:
        # slot 0 of every linear spans nearly every page, so the first adapter's copy would otherwise pay each
        # page's first fault (and its compaction) on the engine loop, holding every stream up.
        memory = anonymous_bytes(sum(a[3] for a in adapted), huge_pages=True) if device.type == "cpu" else None
        if memory is not None:
            memory.zero_()
        start = 0
        for name, module, parts, size in adapted:
            parent = name.rsplit(".", 1)[0]
            context = self.routed.context if name.startswith(routed) else self.context
            layer = LinearLoRA(context, module.in_features, module.part_sizes, max_loras, max_lora_rank, dtype,
                               device, None if memory is None else memory[start : start + size])  # fmt: skip
            start += size
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
        #: The layout the last step was given (``_layout``), None when a slot changed since.
        self._layout: _Layout | None = None
        #: Adapters read into host memory since start (for metrics and tests).
        self.num_loads = 0
        self._loading: dict[int, _Read] = {}  # by lora_int_id
        #: Adapters whose header ``check_adapter`` read, until their weights are read (by lora_int_id).
        self._checked: dict[int, LoRAAdapter] = {}

    # ------------------------------------------------------------ adapters

    def check_adapter(self, request: LoRARequest) -> None:
        """Check ``request``'s adapter before its request is queued: its id names no other adapter, and unless it
        is in host memory or on its way there, its config and tensor header (a few KB) fit the base. Called on
        the engine loop when a request naming it arrives. Raises ``LoRAAdapterError`` with one line (a wrong base,
        a rank above ``max_lora_rank``, an id that already names another adapter)."""
        lora_id = request.lora_int_id
        loading = self._loading.get(lora_id)
        known = self._cpu[lora_id].request if lora_id in self._cpu else loading.request if loading else None
        if known is None:
            self._checked[lora_id] = read_adapter(request.lora_path, self.linear_shapes, self.max_lora_rank)
        elif known.lora_path != request.lora_path:
            raise LoRAAdapterError(
                f"lora_int_id {lora_id} already names adapter {known.lora_name!r} at {known.lora_path!r}, not "
                f"{request.lora_path!r}; give each adapter its own id"
            )

    def load_adapter(self, request: LoRARequest) -> AdapterLoad:
        """``request``'s adapter for one request: ready at once when it is in host memory, else read on the engine
        loop a slice at a time (one read per adapter however many requests wait for it). Called on the engine loop
        for each request queued with an adapter; reads its first slice."""
        lora_id = request.lora_int_id
        known = self._cpu.get(lora_id)
        if known is not None and known.request.lora_path == request.lora_path:
            self._cpu.move_to_end(lora_id)
            return AdapterLoad(self, None, known)
        read = self._loading.get(lora_id)
        if read is None or read.request.lora_path != request.lora_path:
            checked = self._checked.pop(lora_id, None)
            if checked is None or checked.path != Path(request.lora_path):
                checked = read_adapter(request.lora_path, self.linear_shapes, self.max_lora_rank)
            read = self._loading[lora_id] = _Read(request, checked, self.targets)
        load = AdapterLoad(self, read)
        load.is_ready()
        return load

    def add_adapter(self, request: LoRARequest) -> None:
        """Check and read ``request``'s adapter into host memory now unless it is there (tests and tools that
        drive the model runner themselves; the engine uses ``check_adapter`` and ``load_adapter``). Raises
        ``LoRAAdapterError``."""
        self.check_adapter(request)
        if request.lora_int_id in self._cpu:
            self._cpu.move_to_end(request.lora_int_id)
            return
        checked = self._checked.pop(request.lora_int_id, None)  # None: its read was under way
        checked = checked or read_adapter(request.lora_path, self.linear_shapes, self.max_lora_rank)
        read = _Read(request, checked, self.targets)
        while not read.advance():
            pass
        if read.error is not None:
            raise LoRAAdapterError(read.error)
        assert read.weights is not None
        self._install(read.weights)

    def _install(self, weights: _AdapterWeights) -> None:
        """Put an adapter read from disk in host memory (the least recently used ones leave beyond
        ``max_cpu_loras``); on the engine loop."""
        request, lora_id = weights.request, weights.request.lora_int_id
        loading = self._loading.get(lora_id)
        if loading is not None:
            self._end_load(loading)
        if self._cpu.get(lora_id) is weights:
            return
        self.num_loads += 1
        logger.info(
            "LoRA adapter %r (id %d) read from %s: %d modules, rank <= %d",
            request.lora_name, lora_id, request.lora_path, len(weights.adapter.modules), weights.adapter.max_rank,
        )  # fmt: skip
        self._cpu[lora_id] = weights
        self._cpu.move_to_end(lora_id)
        while len(self._cpu) > self.max_cpu_loras:
            evicted, _ = self._cpu.popitem(last=False)
            logger.debug("LoRA adapter %d left host memory", evicted)

    def _end_load(self, read: _Read) -> None:
        """Forget ``read`` once it has ended."""
        lora_id = read.request.lora_int_id
        if self._loading.get(lora_id) is read:
            del self._loading[lora_id]

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter: its host copy and its slot (``/v1/unload_lora_adapter``)."""
        self._cpu.pop(lora_int_id, None)
        self._loading.pop(lora_int_id, None)
        self._checked.pop(lora_int_id, None)
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free_slots.append(slot)
            self._layout = None

    @property
    def num_cpu_adapters(self) -> int:
        return len(self._cpu)

    @property
    def slot_adapters(self) -> dict[int, int]:
        """``lora_int_id -> slot`` of the adapters in slots."""
        return dict(self._slot_of)

    # ------------------------------------------------------------ the step

    def set_step(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Put the adapters of the step's requests in slots and lay its tokens out by slot (each request's
        ``num_new_tokens`` in order, as the model runner flattens them). Called once per step, before the
        forward."""
        lora_requests = [s.request.lora_request for s in scheduled]
        num_tokens = [s.num_new_tokens for s in scheduled]
        layout = _layout(lora_requests, num_tokens)
        if layout == self._layout:  # decode steps repeat their layout until a request joins or ends
            return
        held = {
            s.request.lora_request.lora_int_id: s.request.lora_load.weights
            for s in scheduled
            if s.request.lora_request is not None and s.request.lora_load is not None and s.request.lora_load.weights
        }
        self._lay_out(lora_requests, num_tokens, held, layout)

    def set_batch(
        self,
        lora_requests: Sequence[LoRARequest | None],
        num_tokens: Sequence[int],
        held: Mapping[int, _AdapterWeights] | None = None,
    ) -> None:
        """``set_step`` for a batch given as each sequence's adapter (None: none) and number of tokens, in the
        order the forward's input is laid out (tests and tools that run the model runner themselves); ``held``:
        weights the requests hold, by ``lora_int_id`` (an adapter in neither ``held`` nor host memory is read
        from disk now)."""
        layout = _layout(lora_requests, num_tokens)
        if layout != self._layout:
            self._lay_out(lora_requests, num_tokens, held or {}, layout)

    def _lay_out(
        self,
        lora_requests: Sequence[LoRARequest | None],
        num_tokens: Sequence[int],
        held: Mapping[int, _AdapterWeights],
        layout: _Layout,
    ) -> None:
        """Put the batch's adapters in slots and give the kernels its tokens by slot; remember ``layout``, so that
        a step laid out the same way (with no slot changed since) reuses it: laying a step out again is most of
        the host work an adapter adds to a decode step."""
        self._layout = None
        if not any(lora_requests):
            self.context.batch = None
            self.routed.step_slots = None
            self._layout = layout
            return
        in_step = {r.lora_int_id for r in lora_requests if r is not None}
        assert len(in_step) <= self.max_loras, f"{len(in_step)} adapters in one step, {self.max_loras} slots"
        slots = [-1 if r is None else self._activate(r, in_step, held) for r in lora_requests]
        counts = numpy.asarray(num_tokens, dtype=numpy.int64)
        token_slots = numpy.repeat(numpy.asarray(slots, dtype=numpy.int64), counts)  # [num_tokens]
        self.context.batch = self.context.kernels.prepare(token_slots, self.device)
        self.routed.step_slots = token_slots
        self._layout = layout

    def _activate(self, request: LoRARequest, in_step: set[int], held: Mapping[int, _AdapterWeights]) -> int:
        """The slot of ``request``'s adapter, loading it there (from host memory, the request's own copy, or
        disk) if it is not in one."""
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
        weights = self._cpu.get(lora_id) or held.get(lora_id)
        if weights is None:
            self.add_adapter(request)  # back from disk (only callers of set_batch that hold nothing)
            weights = self._cpu[lora_id]
        for layer in self.layers:
            layer.load_slot(slot, weights.layers.get(layer, {}))
        self._slot_of[lora_id] = slot
        return slot


#: A step's layout by adapter: each sequence's adapter id (None: none), then each one's number of tokens.
_Layout: TypeAlias = tuple[tuple[int | None, ...], tuple[int, ...]]


def _layout(lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> _Layout:
    return tuple(None if r is None else r.lora_int_id for r in lora_requests), tuple(num_tokens)


def build_lora_manager(config: EngineConfig, plugins: PluginSystem, loaded: LoadedModel) -> LoRAManager | None:
    """The engine's ``LoRAManager`` over its model when ``lora.enable_lora`` is set, with the selected kernels;
    else None. Called once per engine process, after the model has loaded."""
    lora = config.lora
    if not lora.enable_lora:
        return None
    if not plugins.load(Slot.SCHEDULER, config.scheduler.policy).supports_lora:
        raise ConfigError(f"scheduler.policy={config.scheduler.policy!r} does not run LoRA adapters; "
                          "choose 'fcfs' or 'priority', or turn lora.enable_lora off")  # fmt: skip
    kernels = select_lora_kernels(lora.lora_kernels, loaded.device, plugins)
    dtype = auto_lora_dtype(loaded) if lora.lora_dtype == "auto" else getattr(torch, lora.lora_dtype)
    return LoRAManager(loaded.model, kernels, lora.max_loras, lora.max_lora_rank,
                       lora.max_cpu_loras or lora.max_loras, loaded.device, dtype)  # fmt: skip


def auto_lora_dtype(loaded: LoadedModel) -> torch.dtype:
    """``--lora-dtype auto``: on a GPU the model's dtype. On a CPU the adapters add in float32 whatever they are
    stored in: float16 over quantized linears, whose weights a decode step streams at 4-8 bits, where float32
    adapters would make it read about a fifth more (docs/lora.md) for digits the base does not keep; float32 over
    float linears."""
    if loaded.device.type != "cpu":
        return loaded.dtype
    quantized = any(  # the layers' linears ("." in the name: not the output projection)
        isinstance(module, Linear) and "." in name and not isinstance(module.quantizer, DenseQuantizer)
        for name, module in loaded.model.named_modules()
    )
    return torch.float16 if quantized else torch.float32


def with_adapter(lora: LoRAManager | None, message: EngineCoreRequest) -> EngineCoreRequest:
    """``message`` with its prefix cache salted by its adapter, once the adapter's config and tensor header check
    out (its weights are read off the loop when it is queued); ``InvalidRequestError`` when LoRA is off or the
    adapter cannot be used."""
    lora_request = message.lora_request
    if lora_request is None:
        return message
    if lora is None:
        raise InvalidRequestError(
            f"the request names LoRA adapter {lora_request.lora_name!r}, but LoRA is not enabled; "
            "start the engine with --enable-lora"
        )
    try:
        lora.check_adapter(lora_request)
    except LoRAAdapterError as exc:
        raise InvalidRequestError(str(exc)) from None
    return msgspec.structs.replace(message, cache_salt=lora_cache_salt(lora_request, message.cache_salt))
