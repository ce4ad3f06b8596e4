"""LoRA adapters in the API, as vLLM serves them (docs/lora.md).

- a request's ``model`` names the base model or an adapter (``resolve``);
- ``GET /v1/models`` lists each adapter with its ``parent``, the base model (``model_cards``);
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter``
  ``{"lora_name"}`` add and remove adapters at run time, with ``lora.allow_runtime_lora_updating`` (vLLM's
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); their answers are vLLM's plain-text lines;
- with tenants (``server.api_keys``), a key sees, uses, loads and unloads only its adapters (``lora_adapters``),
  and a request naming the base model runs with its key's ``default_lora_adapter`` (docs/lora.md#tenants).

Imports no torch.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
from starlette.responses import PlainTextResponse, Response

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.lora.adapter import LoRAAdapterError
from tokenmill.lora.registry import LoRARegistry, base_linear_shapes, parse_lora_module
from tokenmill.lora.request import LoRARequest
from tokenmill.server import protocol
from tokenmill.server.protocol import ProtocolError
from tokenmill.server.tenants import KeyState, Tenants


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

    def __init__(self, registry: LoRARegistry, allow_runtime_updating: bool, tenants: Tenants | None = None) -> None:
        self.registry = registry
        self.allow_runtime_updating = allow_runtime_updating
        #: Which key may use which adapter; None: every key every adapter.
        self.tenants = tenants

    @classmethod
    def from_config(cls, config: EngineConfig, model_name: str, tenants: Tenants | None = None) -> LoRAEndpoints | None:
        """The adapters ``lora.lora_modules`` lists, checked against the base model; None without
        ``lora.enable_lora``. Raises ``LoRAAdapterError`` for an entry that cannot be served, and ``ConfigError``
        for a keys file that gives keys adapters while LoRA is off."""
        lora = config.lora
        if not lora.enable_lora:
            if tenants is not None and tenants.restricts_adapters:
                raise ConfigError(
                    f"server.api_keys ({config.server.api_keys}) gives keys lora_adapters or default_lora_adapter, "
                    "but lora.enable_lora is off; add --enable-lora"
                )
            return None
        registry = LoRARegistry(model_name, lora.max_lora_rank, base_linear_shapes(config.model.model))
        for entry in lora.lora_modules:
            registry.load(*parse_lora_module(entry))
        return cls(registry, lora.allow_runtime_lora_updating, tenants)

    def _may_use(self, key: KeyState | None, name: str) -> bool:
        return self.tenants is None or self.tenants.may_use_adapter(key, name)

    def resolve(self, model: str, key: KeyState | None = None) -> LoRARequest | None:
        """The adapter a request of ``key`` runs with when its ``model`` is ``model``: the adapter it names, or
        for the base model's name the key's default adapter (None: the base model). An adapter the key may not
        use, and any other name, is OpenAI's 404, which does not say whether the adapter exists."""
        base_model_name = self.registry.base_model_name
        if model == base_model_name:
            default = self.tenants.default_adapter(key) if self.tenants is not None else None
            if default is None:
                return None
            model = default
        lora = self.registry.get(model)
        if lora is None or not self._may_use(key, model):
            raise protocol.model_not_found(model)
        return lora

    def model_cards(self, created: int, base_model_name: str, key: KeyState | None = None) -> list[dict[str, object]]:
        """Each adapter ``key`` may use as ``/v1/models`` lists it (vLLM's ``ModelCard``: ``root`` its path,
        ``parent`` its base)."""
        return [
            {"id": lora.lora_name, "object": "model", "created": created, "owned_by": "tokenmill",
             "root": lora.lora_path, "parent": lora.base_model_name or base_model_name}
            for lora in self.registry.adapters if self._may_use(key, lora.lora_name)
        ]  # fmt: skip

    def _check_allowed(self) -> None:
        if not self.allow_runtime_updating:
            raise ProtocolError(
                404, "Loading and unloading LoRA adapters at run time is off; start the server with "
                "--allow-runtime-lora-updating", code="not_found",
            )  # fmt: skip

    def load(self, body: bytes, key: KeyState | None = None) -> Response:
        self._check_allowed()
        request = _decode(body, LoadLoRAAdapterRequest)
        if not self._may_use(key, request.lora_name):  # a name another tenant's keys list is theirs to load
            raise protocol.model_not_found(request.lora_name)
        try:
            self.registry.load(request.lora_name, request.lora_path)
        except LoRAAdapterError as exc:
            raise ProtocolError(400, str(exc), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    def unload(self, body: bytes, key: KeyState | None = None) -> Response:
        self._check_allowed()
        request = _decode(body, UnloadLoRAAdapterRequest)
        try:
            if not self._may_use(key, request.lora_name):
                raise KeyError(request.lora_name)
            self.registry.unload(request.lora_name)
        except KeyError:
            raise ProtocolError(
                404, f"The lora adapter '{request.lora_name}' cannot be found.", param="lora_name"
            ) from None
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
