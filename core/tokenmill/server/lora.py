"""LoRA adapters in the API, as vLLM serves them (docs/lora.md).

- a request's ``model`` names the base model or an adapter (``resolve``);
- ``GET /v1/models`` lists each adapter with its ``parent``, the base model (``model_cards``);
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
  ``{"lora_name"}`` add and remove adapters at run time, with ``lora.allow_runtime_lora_updating`` (vLLM's
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); their answers are vLLM's plain-text lines.

Imports no torch.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.responses import PlainTextResponse, Response

from tokenmill.config import EngineConfig
from tokenmill.lora.adapter import LoRAAdapterError
from tokenmill.lora.registry import LoRARegistry, base_linear_shapes, parse_lora_module
from tokenmill.lora.request import LoRARequest
from tokenmill.server.protocol import ProtocolError


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's body of ``POST /v1/load_lora_adapter``."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's body of ``POST /v1/unload_lora_adapter``."""

    lora_name: str
    lora_int_id: int | None = None


_Body = TypeVar("_Body")


def _decode(body: bytes, kind: type[_Body]) -> _Body:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise ProtocolError(400, f"invalid request body: {exc}") from None


class LoRAEndpoints:
    """The front end's adapters and the endpoints that change them."""

    def __init__(self, registry: LoRARegistry, allow_runtime_updating: bool) -> None:
        self.registry = registry
        self.allow_runtime_updating = allow_runtime_updating

    @classmethod
    def from_config(cls, config: EngineConfig, model_name: str) -> LoRAEndpoints | None:
        """The adapters ``lora.lora_modules`` lists, checked against the base model; None without
        ``lora.enable_lora``. Raises ``LoRAAdapterError`` for an entry that cannot be served."""
        lora = config.lora
        if not lora.enable_lora:
            return None
        registry = LoRARegistry(model_name, lora.max_lora_rank, base_linear_shapes(config.model.model))
        for entry in lora.lora_modules:
            registry.load(*parse_lora_module(entry))
        return cls(registry, lora.allow_runtime_lora_updating)

    def resolve(self, model: str) -> LoRARequest | None:
        """The adapter a request's ``model`` names, or None when it names none."""
        return self.registry.get(model)

    def model_cards(self, created: int, base_model_name: str) -> list[dict[str, object]]:
        """Each adapter as ``/v1/models`` lists it (vLLM's ``ModelCard``: ``root`` its path, ``parent`` its base)."""
        return [
            {"id": lora.lora_name, "object": "model", "created": created, "owned_by": "tokenmill",
             "root": lora.lora_path, "parent": lora.base_model_name or base_model_name}
            for lora in self.registry.adapters
        ]  # fmt: skip

    def _check_allowed(self) -> None:
        if not self.allow_runtime_updating:
            raise ProtocolError(
                404, "Loading and unloading LoRA adapters at run time is off; start the server with "
                "--allow-runtime-lora-updating", code="not_found",
            )  # fmt: skip

    def load(self, body: bytes) -> Response:
        self._check_allowed()
        request = _decode(body, LoadLoRAAdapterRequest)
        try:
            self.registry.load(request.lora_name, request.lora_path)
        except LoRAAdapterError as exc:
            raise ProtocolError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    def unload(self, body: bytes) -> Response:
        self._check_allowed()
        request = _decode(body, UnloadLoRAAdapterRequest)
        try:
            self.registry.unload(request.lora_name)
        except KeyError:
            raise ProtocolError(
                404, f"The lora adapter '{request.lora_name}' cannot be found.", param="lora_name"
            ) from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
