"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

A msgspec struct, because it travels with the request to the engine process (``EngineCoreRequest.lora_request``).
Imports no torch, so the API front end builds them.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """An adapter in the PEFT format (a directory with ``adapter_config.json`` and ``adapter_model.safetensors``).

    ``lora_int_id`` identifies the adapter inside an engine: its slots and its copy in memory are keyed by it, so
    two requests with the same id must name the same adapter (the engine refuses one that names another path). It
    must be at least 1; ``lora_name`` is what the API calls it (the ``model`` field of a request).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    #: The model the adapter was trained on, as ``/v1/models`` lists it as its ``parent`` (informational).
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty; give the adapter's directory")

    # vLLM's short names.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def lora_cache_salt(lora_request: LoRARequest | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request with ``lora_request``: its adapter (name and path) and its own
    ``cache_salt``, so no K/V is shared across adapters, or between an adapter and the base model; without an
    adapter, ``cache_salt`` unchanged.

    The adapter's salt is a JSON array of four elements; a tenant's salt (``server.tenants``) is one of two, so
    the two never collide. Without tenants a client could give a ``cache_salt`` equal to an adapter's salt and
    read that adapter's K/V for its own prompt: there is no isolation between clients to lose then.
    """
    if lora_request is None:
        return cache_salt
    return msgspec.json.encode(["lora", lora_request.lora_name, lora_request.lora_path, cache_salt]).decode()
