"""Reading and checking a LoRA adapter in the PEFT format, without torch.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``,
``rank_pattern``, ``alpha_pattern``, ...) and ``adapter_model.safetensors``, whose tensors are named
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` for each adapted
linear ``<module>`` of the base model (``model.layers.0.self_attn.q_proj``). ``read_adapter`` reads the config and
the safetensors header (not the tensors) and checks them against the base model's linears: a wrong base (a shape,
a module it does not have, a target module it does not know) is a ``LoRAAdapterError`` with one line naming it.

The arithmetic is PEFT's ``LoraLayer``: ``y = W x + B A x * scaling`` with ``scaling = alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA; ``rank_pattern`` and ``alpha_pattern`` give some modules their own ``r`` and
``alpha``, matched as PEFT's ``get_pattern_key`` matches them.

Both the API front end (checking an adapter before it accepts it, against the shapes ``linear_shapes`` derives
from the base's config) and the engine (against its model's own linears) call ``read_adapter``.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import TokenmillError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's prefix of every tensor name in a saved adapter.
_PEFT_PREFIX = "base_model.model."
#: The linears of a decoder layer that adapters apply to, by their Hugging Face names.
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The safetensors dtypes an adapter's tensors may have, with their sizes in bytes.
TENSOR_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
#: PEFT's wrapper of a mixture of experts' fused parameters: ``<layer>.experts``, each further parameter of the same
#: module wrapping the last (``.base_layer``).
_FUSED_EXPERTS = re.compile(r"(.*\.experts)((?:\.base_layer)*)")
#: The fused experts' parameters an adapter may adapt.
_FUSED_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
#: Header larger than this is not a safetensors file we read.
_MAX_HEADER_BYTES = 100 * 2**20


class LoRAAdapterError(TokenmillError, ValueError):
    """An adapter cannot be used with this base model or these settings; the message says why, in one line."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor of ``adapter_model.safetensors`` lies: its name, safetensors dtype (``F32``, ``F16``,
    ``BF16``), shape and byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class LoRAModule:
    """One adapted linear: its tensors, rank and scaling.

    An expert of a mixture of experts whose adapter PEFT made over the experts' fused parameters (its
    ``target_parameters``: ``gate_up_proj`` ``[experts, 2 * inner, hidden]``, ``down_proj``) shares its tensors with
    the other experts: ``lora_a`` ``[experts * r, in]`` holds expert ``e``'s rows ``e * r`` onwards, and ``lora_b``
    ``[out, r * experts]`` its columns ``k * experts + e`` (PEFT's ``ParamWrapper``); a merged parameter's parts
    (gate and up of ``gate_up_proj``) take their own rows of the outputs (``out_rows``). ``a_view``/``b_view`` say
    where one module's matrices lie in its tensors."""

    module: str  # the base model's module name (``model.layers.0.self_attn.q_proj``)
    lora_a: TensorSpec  # [r, in]; a fused experts' [experts * r, in]
    lora_b: TensorSpec  # [out, r]; a fused experts' [out of every part, r * experts]
    rank: int
    scaling: float
    expert: int = 0
    num_experts: int = 1
    out_rows: tuple[int, int] | None = None  # the rows of lora_b's outputs this module takes (None: all)

    def a_view(self) -> tuple[tuple[int, int], tuple[int, int], int]:
        """``(shape, strides, offset)`` in elements of ``lora_a`` ``[r, in]`` within its tensor."""
        columns = self.lora_a.shape[1]
        return (self.rank, columns), (columns, 1), self.expert * self.rank * columns

    def b_view(self) -> tuple[tuple[int, int], tuple[int, int], int]:
        """``(shape, strides, offset)`` in elements of ``lora_b`` ``[out, r]`` within its tensor."""
        first, end = self.out_rows or (0, self.lora_b.shape[0])
        width = self.lora_b.shape[1]
        return (end - first, self.rank), (width, self.num_experts), first * width + self.expert


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: where its weights are and what each adapted module takes."""

    path: Path
    modules: dict[str, LoRAModule]  # by module name
    weights_size: int  # bytes of adapter_model.safetensors when it was checked

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def weights_path(self) -> Path:
        return self.path / ADAPTER_WEIGHTS


def linear_shapes(
    num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int
) -> dict[str, tuple[int, int]]:
    """``module name -> (in_features, out_features)`` of a Llama-family model's adaptable linears, from its
    config: what the front end checks an adapter against without building the model."""
    per_layer = {
        "self_attn.q_proj": (hidden_size, num_heads * head_dim),
        "self_attn.k_proj": (hidden_size, num_kv_heads * head_dim),
        "self_attn.v_proj": (hidden_size, num_kv_heads * head_dim),
        "self_attn.o_proj": (num_heads * head_dim, hidden_size),
        "mlp.gate_proj": (hidden_size, intermediate_size),
        "mlp.up_proj": (hidden_size, intermediate_size),
        "mlp.down_proj": (intermediate_size, hidden_size),
    }
    return {f"model.layers.{i}.{name}": shape for i in range(num_layers) for name, shape in per_layer.items()}


def read_adapter(
    path: str | Path, linear_shapes: Mapping[str, tuple[int, int]] | None, max_lora_rank: int
) -> LoRAAdapter:
    """Read ``path``'s config and tensor header and check them.

    :param linear_shapes: the base model's adaptable linears, ``module name -> (in_features, out_features)``;
        None checks the adapter on its own (no shapes, no module names).
    :param max_lora_rank: the largest rank an adapter may have (``lora.max_lora_rank``).
    Raises ``LoRAAdapterError`` naming the problem: a missing file, an option tokenmill does not implement
    (DoRA, biases, ``modules_to_save``), a target module the base does not have, a shape that does not fit.
    """
    directory = Path(path)
    where = f"LoRA adapter {str(directory)!r}"
    config = _read_config(directory, where)
    targets = config.get("target_modules")
    module_names = set(linear_shapes) if linear_shapes is not None else None
    if isinstance(targets, list) and module_names is not None:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in module_names})
        for target in targets:
            leaf = str(target).rsplit(".", 1)[-1]
            if leaf not in leaves:
                raise LoRAAdapterError(
                    f"{where}: target module {target!r} is not one tokenmill adapts in this base model "
                    f"({', '.join(leaves)})"
                )
    header, data_start = _read_header(directory / ADAPTER_WEIGHTS, where)
    pairs: dict[str, dict[str, str]] = {}
    for tensor_name in header:
        if tensor_name == "__metadata__":
            continue
        module, kind = _parse_tensor_name(tensor_name, where)
        pairs.setdefault(module, {})[kind] = tensor_name
    if not pairs:
        raise LoRAAdapterError(f"{where}: {ADAPTER_WEIGHTS} holds no lora_A/lora_B weights")
    modules: dict[str, LoRAModule] = {}
    for module, names in sorted(pairs.items()):
        missing = {"lora_A", "lora_B"} - set(names)
        if missing:
            raise LoRAAdapterError(f"{where}: {module} has no {missing.pop()}.weight")
        if _FUSED_EXPERTS.fullmatch(module):
            for expert in _fused_experts(where, config, module, names, header, data_start, linear_shapes,
                                         max_lora_rank):  # fmt: skip
                modules[expert.module] = expert
            continue
        modules[module] = _check_module(
            where, config, module, names, header, data_start, linear_shapes, module_names, max_lora_rank
        )
    return LoRAAdapter(directory, modules, (directory / ADAPTER_WEIGHTS).stat().st_size)


def _read_config(directory: Path, where: str) -> dict[str, Any]:
    if not directory.is_dir():
        raise LoRAAdapterError(f"{where}: no such directory")
    config_path = directory / ADAPTER_CONFIG
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"{where}: no {ADAPTER_CONFIG} (a PEFT adapter directory has one)") from None
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{where}: {ADAPTER_CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{where}: {ADAPTER_CONFIG} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {peft_type!r}; tokenmill serves LoRA adapters only")
    unsupported = [
        (bool(config.get("use_dora")), "use_dora (DoRA)"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r} (trained biases)"),
        (bool(config.get("lora_bias")), "lora_bias"),
        (bool(config.get("modules_to_save")), "modules_to_save (fully trained modules)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (GPT-2 style Conv1D weights)"),
    ]
    for is_set, what in unsupported:
        if is_set:
            raise LoRAAdapterError(f"{where}: {what} is not supported; only lora_A/lora_B on linears are")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise LoRAAdapterError(f"{where}: {ADAPTER_CONFIG} has {key}={value!r}; expected a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoRAAdapterError(f"{where}: {key} must be an object of module pattern -> number")
    return config


def _read_header(weights_path: Path, where: str) -> tuple[dict[str, Any], int]:
    """The safetensors header (tensor name -> {dtype, shape, data_offsets}) and where the tensors' data starts in
    the file (their offsets count from there)."""
    try:
        with weights_path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        other = [p.name for p in weights_path.parent.glob("adapter_model.*")]
        hint = f" (found {', '.join(other)}: save it with safe_serialization=True)" if other else ""
        raise LoRAAdapterError(f"{where}: no {ADAPTER_WEIGHTS}{hint}") from None
    except (OSError, ValueError, struct.error) as exc:
        raise LoRAAdapterError(f"{where}: {ADAPTER_WEIGHTS} is not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{where}: {ADAPTER_WEIGHTS} is not a safetensors file")
    return header, 8 + length


def _parse_tensor_name(tensor_name: str, where: str) -> tuple[str, str]:
    """``(module, "lora_A" | "lora_B")`` of a PEFT tensor name."""
    name = tensor_name.removeprefix(_PEFT_PREFIX)
    for kind in ("lora_A", "lora_B"):
        suffix = f".{kind}.weight"
        if name.endswith(suffix):
            return name.removesuffix(suffix), kind
    raise LoRAAdapterError(
        f"{where}: tensor {tensor_name!r} is not a lora_A/lora_B weight; tokenmill applies LoRA to linears only "
        "(no embeddings, DoRA magnitudes or biases)"
    )


def _pattern_value(patterns: Mapping[str, Any], module: str, default: float) -> float:
    """PEFT's ``get_pattern_key``: the first pattern that matches the end of the module name wins."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def _check_module(
    where: str,
    config: Mapping[str, Any],
    module: str,
    names: dict[str, str],
    header: Mapping[str, Any],
    data_start: int,
    linear_shapes: Mapping[str, tuple[int, int]] | None,
    module_names: set[str] | None,
    max_lora_rank: int,
) -> LoRAModule:
    a_shape = list(header[names["lora_A"]].get("shape", []))
    b_shape = list(header[names["lora_B"]].get("shape", []))
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        raise LoRAAdapterError(
            f"{where}: {module} has lora_A {a_shape} and lora_B {b_shape}; expected [r, in], [out, r]"
        )
    rank = int(a_shape[0])
    if module_names is not None and linear_shapes is not None:
        if module not in module_names:
            leaf = module.rsplit(".", 1)[-1]
            if ".experts." in module:
                raise LoRAAdapterError(
                    f"{where}: it adapts the routed experts of a mixture of experts ({module}), which this base "
                    "model does not have, or whose fused_experts kernels do not apply adapters (the torch "
                    "reference does)"
                )
            if leaf not in SUPPORTED_TARGET_MODULES and not any(n.endswith(f".{leaf}") for n in module_names):
                raise LoRAAdapterError(
                    f"{where}: it adapts {leaf!r}, which tokenmill does not apply adapters to "
                    f"(only {', '.join(SUPPORTED_TARGET_MODULES)})"
                )
            raise LoRAAdapterError(f"{where}: it has weights for {module}, which the base model does not have "
                                   "(an adapter for another model?)")  # fmt: skip
        in_features, out_features = linear_shapes[module]
        if (a_shape[1], b_shape[0]) != (in_features, out_features):
            raise LoRAAdapterError(
                f"{where}: {module} is {a_shape[1]} -> {b_shape[0]} in the adapter but {in_features} -> "
                f"{out_features} in the base model (an adapter for another model?)"
            )
    expected_rank = _pattern_value(config.get("rank_pattern") or {}, module, float(config["r"]))
    if rank != expected_rank:
        raise LoRAAdapterError(f"{where}: {module} has rank {rank} but its config says r={expected_rank:g}")
    scaling = _scaling(where, config, module, rank, max_lora_rank)
    return LoRAModule(module, _spec(where, names["lora_A"], header, data_start),
                      _spec(where, names["lora_B"], header, data_start), rank, scaling)  # fmt: skip


def _scaling(where: str, config: Mapping[str, Any], key: str, rank: int, max_lora_rank: int) -> float:
    """PEFT's scaling of the module (or fused parameter) ``key`` of rank ``rank``, which must fit the slots."""
    if rank > max_lora_rank:
        raise LoRAAdapterError(
            f"{where}: {key} has rank {rank}, above lora.max_lora_rank={max_lora_rank}; raise --max-lora-rank"
        )
    alpha = _pattern_value(config.get("alpha_pattern") or {}, key, float(config["lora_alpha"]))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _fused_experts(
    where: str,
    config: Mapping[str, Any],
    module: str,
    names: dict[str, str],
    header: Mapping[str, Any],
    data_start: int,
    linear_shapes: Mapping[str, tuple[int, int]] | None,
    max_lora_rank: int,
) -> list[LoRAModule]:
    """The per-expert modules of PEFT's adapter on a fused experts parameter (``module`` is ``<layer>.experts``,
    with a ``.base_layer`` per parameter wrapped inside another): ``<layer>.experts.{e}.gate_proj`` and ``up_proj``
    for ``gate_up_proj``, ``...down_proj`` for ``down_proj``. Which parameter the tensors adapt shows in their
    shapes against the base's (``gate_up_proj`` is hidden -> 2 * inner, ``down_proj`` inner -> hidden), not in the
    order of ``target_parameters``; without the base (the front end of a MoE model) only the tensors' own shapes
    are checked, and no module is returned."""
    match = _FUSED_EXPERTS.fullmatch(module)
    assert match is not None
    experts_module = match.group(1)
    a_shape = [int(n) for n in header[names["lora_A"]].get("shape", [])]
    b_shape = [int(n) for n in header[names["lora_B"]].get("shape", [])]
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
        raise LoRAAdapterError(f"{where}: {module} has lora_A {a_shape} and lora_B {b_shape}; expected "
                               "[experts * r, in], [out, r * experts]")  # fmt: skip
    listed = {str(p).rsplit(".", 1)[-1] for p in config.get("target_parameters") or []}
    if not listed & set(_FUSED_EXPERT_PARAMETERS):
        raise LoRAAdapterError(f"{where}: {module} adapts a fused experts parameter, but target_parameters names "
                               f"none of {', '.join(_FUSED_EXPERT_PARAMETERS)}")  # fmt: skip
    if linear_shapes is None:
        return []
    prefix = f"{experts_module}."
    if f"{prefix}0.gate_proj" not in linear_shapes:
        raise LoRAAdapterError(
            f"{where}: it adapts the routed experts of a mixture of experts ({experts_module}), which this base "
            "model does not have, or whose fused_experts kernels do not apply adapters (the torch reference does)"
        )
    num_experts = len({n[len(prefix) :].split(".", 1)[0] for n in linear_shapes if n.startswith(prefix)})
    hidden, inner = linear_shapes[f"{prefix}0.gate_proj"]
    fits = {"gate_up_proj": (hidden, 2 * inner), "down_proj": (inner, hidden)}
    param = next((p for p, shape in fits.items() if shape == (a_shape[1], b_shape[0])), None)
    if param is None:
        raise LoRAAdapterError(
            f"{where}: {module} is {a_shape[1]} -> {b_shape[0]} in the adapter, which is neither the experts' "
            f"gate_up_proj ({hidden} -> {2 * inner}) nor their down_proj ({inner} -> {hidden}) (an adapter for "
            "another model?)"
        )
    if param not in listed:
        raise LoRAAdapterError(f"{where}: {module} adapts the experts' {param}, which target_parameters does not list")
    key = f"{experts_module}.{param}"
    rank_f = _pattern_value(config.get("rank_pattern") or {}, key, float(config["r"]))
    rank = int(rank_f)
    if rank != rank_f or rank * num_experts != a_shape[0]:
        raise LoRAAdapterError(f"{where}: {key} has {a_shape[0]} rows of lora_A, not r={rank_f:g} for each of "
                               f"{num_experts} experts")  # fmt: skip
    scaling = _scaling(where, config, key, rank, max_lora_rank)
    lora_a = _spec(where, names["lora_A"], header, data_start)
    lora_b = _spec(where, names["lora_B"], header, data_start)
    parts: list[tuple[str, tuple[int, int] | None]] = [("down_proj", None)]
    if param == "gate_up_proj":
        parts = [("gate_proj", (0, inner)), ("up_proj", (inner, 2 * inner))]
    return [
        LoRAModule(f"{experts_module}.{e}.{leaf}", lora_a, lora_b, rank, scaling, e, num_experts, rows)
        for e in range(num_experts)
        for leaf, rows in parts
    ]


def _spec(where: str, name: str, header: Mapping[str, Any], data_start: int) -> TensorSpec:
    entry = header[name]
    dtype = entry.get("dtype")
    if dtype not in TENSOR_DTYPES:
        raise LoRAAdapterError(f"{where}: {name} is {dtype}; adapters are read in {', '.join(TENSOR_DTYPES)}")
    offsets = entry.get("data_offsets")
    shape = tuple(int(n) for n in entry["shape"])
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or offsets[1] - offsets[0] != math.prod(shape) * TENSOR_DTYPES[dtype]
    ):
        raise LoRAAdapterError(f"{where}: {name} has data_offsets {offsets!r}, which do not fit its shape {shape}")
    return TensorSpec(name, dtype, shape, data_start + int(offsets[0]), data_start + int(offsets[1]))
