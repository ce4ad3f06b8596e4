"""Registers the first-party routers and declares their options (registration only: no torch import here).

Each router is registered under its name with underscores (vLLM's and SGLang's spelling) and with hyphens
(``round-robin``'s); ``cache_aware`` is SGLang's name for ``prefix_aware``, and ``lora_affinity`` llm-d's
(its ``lora-affinity-scorer``) for ``lora_aware``.
"""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register
from tokenmill_plugins.routers.options import RoutersOptions

_ROUTERS = {
    "least_loaded": "LeastLoadedRouter",
    "kv_aware": "KVAwareRouter",
    "prefix_aware": "PrefixAwareRouter",
    "lora_aware": "LoRAAwareRouter",
}


@hookimpl
def tokenmill_plugin_options() -> type[RoutersOptions]:
    return RoutersOptions


@hookimpl
def tokenmill_register_routers(register: Register) -> None:
    for name, class_name in _ROUTERS.items():
        path = f"tokenmill_plugins.routers.policies:{class_name}"
        register(name, path)
        register(name.replace("_", "-"), path)
    register("cache_aware", "tokenmill_plugins.routers.policies:PrefixAwareRouter")
    register("lora_affinity", "tokenmill_plugins.routers.policies:LoRAAwareRouter")
