"""``LoRARegistry``: the API front end's adapters by name (vLLM's ``--lora-modules`` and runtime loading).

The front end gives each adapter an id (``lora_int_id``, from 1, never reused) when it is added: from
``lora.lora_modules`` at start-up, or ``POST /v1/load_lora_adapter`` at run time. A request whose ``model`` names
an adapter carries its ``LoRARequest`` to the engine, which reads the adapter on first use. Adapters are checked
here first, against the shapes the base model's ``config.json`` gives (when it has one: a GGUF base is checked by
the engine alone), so a wrong base is refused when the adapter is added. Imports no torch.
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import msgspec

from tokenmill.lora.adapter import LoRAAdapterError, linear_shapes, read_adapter
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class _LoRAModule(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's JSON form of a ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """``(name, path, base_model_name)`` of a ``--lora-modules`` entry: ``name=path`` or vLLM's JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}``. Raises ``LoRAAdapterError``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            module = msgspec.json.decode(text, type=_LoRAModule)
        except msgspec.DecodeError as exc:
            raise LoRAAdapterError(f"lora.lora_modules entry {text!r}: {exc}") from None
        return module.name, module.path, module.base_model_name
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise LoRAAdapterError(f"lora.lora_modules entry {text!r}: expected 'name=path' or a JSON object")
    return name, path, None


def base_linear_shapes(model_dir: str | Path | None) -> dict[str, tuple[int, int]] | None:
    """The adaptable linears' shapes from a Hugging Face model directory's ``config.json``; None for a model
    without one (a GGUF file) or one this cannot read (the engine then checks adapters alone)."""
    from tokenmill.models.architecture import ArchitectureConfig, ArchitectureError

    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    try:
        hf = json.loads((Path(model_dir) / "config.json").read_text())
        arch = ArchitectureConfig.from_hf_config(hf)
    except (ArchitectureError, ValueError, KeyError, TypeError):
        return None
    if any(hf.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None  # a mixture of experts: its MLPs are not the dense ones listed below
    return linear_shapes(arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads,
                         arch.head_dim, arch.intermediate_size)  # fmt: skip


class LoRARegistry:
    """Adapters the front end serves, by name."""

    def __init__(
        self, base_model_name: str, max_lora_rank: int, shapes: dict[str, tuple[int, int]] | None = None
    ) -> None:
        self.base_model_name = base_model_name
        self.max_lora_rank = max_lora_rank
        self.shapes = shapes
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter at ``path`` and serve it as ``name``. Raises ``LoRAAdapterError`` for a name taken
        (by an adapter or the base model) or an adapter that does not fit the base."""
        if name in self._adapters:
            raise LoRAAdapterError(f"The lora adapter '{name}' has already been loaded.")
        if name == self.base_model_name:
            raise LoRAAdapterError(f"'{name}' is the base model's name; give the adapter another one")
        read_adapter(path, self.shapes, self.max_lora_rank)
        request = LoRARequest(name, next(self._ids), str(Path(path).resolve()), base_model_name)
        self._adapters[name] = request
        logger.info("serving LoRA adapter %r from %s", name, path)
        return request

    def unload(self, name: str) -> LoRARequest:
        """Stop serving ``name``; raises ``KeyError`` when it is not served."""
        request = self._adapters.pop(name)
        logger.info("stopped serving LoRA adapter %r", name)
        return request

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    @property
    def adapters(self) -> list[LoRARequest]:
        """Every adapter served, in the order they were added."""
        return list(self._adapters.values())
