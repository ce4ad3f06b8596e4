"""Every hook tokenmill calls, in one place.

Plugins implement these with ``@tokenmill.hookimpl``. The hooks are grouped by
the phase in which they are called. All of them run at start-up, once per
process that loads plugins (front end, engine, workers), so implementations
must be idempotent. Nothing calls a hook per step or per token.

Registration hooks receive a ``register(name, import_path)`` callable. The
import path (``"package.module:Attribute"``) is imported only when a config
selects that name, so a plugin whose kernels need CUDA costs nothing to list on
a CPU machine.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT_NAME = "tokenmill"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: ``register(name, import_path)``: adds one named implementation to a slot.
Register = Callable[[str, str], None]


# ---------------------------------------------------------------- startup / config


@hookspec
def tokenmill_add_hookspecs(pluginmanager: pluggy.PluginManager) -> None:
    """Let a plugin declare hooks of its own.

    :param pluginmanager: the process's plugin manager; call
        ``pluginmanager.add_hookspecs(module_or_class)``.
    :return: nothing; every implementation is called.

    Called once per process, before any registration hook. Stability: provisional.
    """


# ---------------------------------------------------------------- registration


@hookspec
def tokenmill_register_architectures(register: Register) -> None:
    """Register model architectures.

    :param register: ``register(name, import_path)``. ``name`` is the
        Hugging Face architecture string found in ``config.json``
        (``"LlamaForCausalLM"``); the import path names a
        ``tokenmill.CausalLM`` subclass, built on the meta device as
        ``cls(arch_config, attention_backend, quantizer, dtype, max_position)``
        and then filled by its ``load_weights``.
    :return: nothing; every implementation is called.

    Called once per process at start-up (front end, engine). Stability: provisional.
    """


@hookspec
def tokenmill_register_attention_backends(register: Register) -> None:
    """Register attention backends.

    :param register: ``register(name, import_path)``; the import path names a
        class implementing ``tokenmill.AttentionBackend``, built with no
        arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up. Selected by ``attention.backend`` in
    the config. Stability: provisional.
    """


@hookspec
def tokenmill_register_weight_formats(register: Register) -> None:
    """Register readers of weight files (safetensors directories, GGUF, ...).

    :param register: ``register(name, import_path)``; the import path names a
        class implementing ``tokenmill.WeightFormat``, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up. The first format whose
    ``can_load(path)`` is true reads a model, unless ``model.weight_format``
    names one. Stability: provisional.
    """


@hookspec
def tokenmill_register_routing_policies(register: Register) -> None:
    """Register routing policies: which engine replica serves a request.

    :param register: ``register(name, import_path)``; the import path names a
        class implementing ``tokenmill.RoutingPolicy``, built with no arguments.
    :return: nothing; every implementation is called.

    Called once at start-up in the API front end (which never imports torch, so
    keep the policy's module free of it). Selected by ``server.router``.
    Stability: provisional.
    """


@hookspec
def tokenmill_register_quantizers(register: Register) -> None:
    """Register quantizers: how a linear layer's weights are stored and multiplied.

    :param register: ``register(name, import_path)``; the import path names a
        class implementing ``tokenmill.Quantizer``, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up. Selected by ``model.quantization``.
    Stability: provisional.
    """
