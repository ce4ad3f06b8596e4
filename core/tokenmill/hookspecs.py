"""Every hook tokenmill calls, in one place.

Plugins implement these with ``@tokenmill.hookimpl``. The hooks are grouped by
the phase in which they are called. All of them run at start-up, once per
process that loads plugins (front end, engine, workers), so implementations
must be idempotent. Nothing calls a hook per step or per token. The one
exception to "every process" is ``tokenmill_register_commands``, which only the
``tokenmill`` command's own process calls.

Each registration hook fills one *slot* and receives a ``register(name,
import_path)`` callable. The import path (``"package.module:Attribute"``) is
imported only when a config selects that name, so a plugin whose kernels need
CUDA costs nothing to list on a CPU machine. The interface each slot's classes
implement is exported from ``tokenmill.interfaces``. Every hook states the
version it appeared in (``Since``) and its ``Stability``: *stable* hooks change
only after a deprecation that warns for one minor release; *provisional* ones
may still change in a minor release, noted in the changelog.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import pluggy

if TYPE_CHECKING:
    import click

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

    Called once per process, before any registration hook.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_plugin_options() -> type[msgspec.Struct] | None:
    """Declare the options this plugin reads from its ``[plugins.NAME]`` table.

    :return: a ``msgspec.Struct`` subclass whose fields (with defaults) are the
        options, or None. ``NAME`` is the plugin's name as ``tokenmill plugins``
        lists it (its entry point name). The table is validated against the
        struct when the config is loaded (an unknown key is an error naming the
        allowed ones), and every class the plugin registers that is built receives the
        validated struct as the keyword argument ``options``.

    Called once per process at start-up, after ``tokenmill_add_hookspecs``; each
    plugin's implementation is called on its own.
    Since: 0.1. Stability: provisional.
    """


# ---------------------------------------------------------------- registration: the model


@hookspec
def tokenmill_register_architectures(register: Register) -> None:
    """Register model architectures (slot ``architecture``).

    :param register: ``register(name, import_path)``. ``name`` is the
        Hugging Face architecture string found in ``config.json``
        (``"LlamaForCausalLM"``); the import path names a
        ``tokenmill.interfaces.CausalLM`` subclass, built on the meta device as
        ``cls(arch_config, attention_backend, quantizer, dtype, max_position)``
        and then filled by its ``load_weights``.
    :return: nothing; every implementation is called.

    Called once per process at start-up (front end, engine). Chosen by the
    checkpoint's ``architectures[0]``.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_weight_formats(register: Register) -> None:
    """Register readers of weight files (slot ``weight_format``: safetensors directories, GGUF, ...).

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.WeightFormat`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up. The first format whose
    ``can_load(path)`` is true reads a model, unless ``model.weight_format``
    names one.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_quantizers(register: Register) -> None:
    """Register quantizers (slot ``quantizer``): how a linear layer's weights are stored and multiplied.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.Quantizer`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up. Selected by ``model.quantization``
    (``--quantization``); ``auto`` picks by the checkpoint's stored weight type, or, for a
    checkpoint quantized by another tool, by its ``quantization_config.quant_method`` among the
    quantizers whose ``quant_methods`` name it, then given that config through its ``configure``.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_attention_backends(register: Register) -> None:
    """Register attention backends (slot ``attention_backend``).

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.AttentionBackend`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up. Selected by ``attention.backend``
    (``--attention-backend``); ``auto`` picks, among those whose ``auto_selectable(device, head_dim)`` holds,
    the one with the highest ``auto_priority``.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_fused_experts(register: Register) -> None:
    """Register fused-experts kernels (slot ``fused_expert``): a mixture-of-experts layer's expert matmuls over
    the tokens routed to each expert, each active expert's weights read once per step.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.FusedExperts`` subclass, built with no arguments (plus ``options=`` when its plugin
        declares options).
    :return: nothing; every implementation is called.

    Called once per process at start-up. Selected by ``model.fused_experts`` (``--fused-experts``; built in:
    ``torch``); ``auto`` picks, among those whose ``auto_selectable(device)`` holds, the one with the highest
    ``auto_priority``. Models without experts never call it.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_layer_kernels(register: Register) -> None:
    """Register layer kernels (slot ``layer_kernel``): RMSNorm with the residual add, rope, SiLU times up, and
    optionally a dense matmul for the ``none`` quantizer's weights (``pack_dense_weight``, ``dense_linear``) and a
    runner of a model's whole decoder stack in one call (``fused_decoder``).

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.LayerKernels`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up. Selected by ``model.layer_kernels``
    (``--layer-kernels``); ``auto`` picks, among those whose ``auto_selectable(device)`` holds,
    the one with the highest ``auto_priority``.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_lora_kernels(register: Register) -> None:
    """Register LoRA kernels (slot ``lora_kernel``): each adapted linear's shrink and expand over a batch whose
    tokens use different adapters (Punica's SGMV/BGMV).

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.LoRAKernels`` subclass, built with no arguments (plus ``options=`` when its plugin
        declares options).
    :return: nothing; every implementation is called.

    Called once per process at start-up; only an engine with ``lora.enable_lora`` builds one. Selected by
    ``lora.lora_kernels`` (``--lora-kernels``; built in: ``torch``; ``auto`` picks the highest ``auto_priority``
    that runs on the device).
    Since: 0.1. Stability: provisional.
    """


# ---------------------------------------------------------------- registration: the engine step


@hookspec
def tokenmill_register_schedulers(register: Register) -> None:
    """Register schedulers (slot ``scheduler``): which requests run each step, and their state between steps.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.Scheduler`` subclass, built as
        ``cls(kv_cache, max_num_batched_tokens=..., max_num_seqs=...)``.
    :return: nothing; every implementation is called.

    Called once per engine process at start-up. Selected by ``scheduler.policy``
    (``--scheduling-policy``; built in: ``fcfs``, ``priority``).
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_kv_cache_managers(register: Register) -> None:
    """Register KV cache managers (slot ``kv_cache_manager``): blocks, block tables and the prefix cache.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.KVCacheManager`` subclass, built as
        ``cls(num_blocks, block_size, enable_prefix_caching=..., hash_salt=...)``, plus
        ``tiers=`` (a ``KVTierStack``, the configured KV tiers nearest first) only when
        there are KV tiers, and ``options=`` when its plugin declares options.
    :return: nothing; every implementation is called.

    Called once per engine process at start-up. Selected by
    ``cache.kv_cache_manager`` (built in: ``paged``).
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_samplers(register: Register) -> None:
    """Register samplers (slot ``sampler``): one token per request from the step's logits.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.Sampler`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per engine process at start-up. Selected by ``sampler.sampler``
    (built in: ``torch``).
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_logits_processors(register: Register) -> None:
    """Register logits processors (slot ``logits_processor``): per-request changes to logits before sampling.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.LogitsProcessor`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per engine process at start-up. The engine builds the built-in
    ``logit_bias`` and ``min_tokens`` (they implement those sampling parameters)
    and the ones ``sampler.logits_processors`` (``--logits-processors``) names;
    each then applies to the requests whose sampling parameters ask for it.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_speculators(register: Register) -> None:
    """Register speculators (slot ``speculator``): draft tokens that the core verifies in one target pass.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.Speculator`` subclass, built as
        ``cls(num_speculative_tokens=k, context=SpeculatorContext)``.
    :return: nothing; every implementation is called.

    Called once per engine process at start-up. ``speculative_config.method``
    (vLLM's ``--speculative-config``) selects one by name; built in: ``ngram``,
    ``draft_model``, ``medusa``.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_kv_tiers(register: Register) -> None:
    """Register KV tiers (slot ``kv_tier``): KV blocks kept outside device memory, by block hash.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.KVTier`` subclass, built as ``cls(capacity_bytes=..., fingerprint=...)``
        (plus ``path=`` when configured).
    :return: nothing; every implementation is called.

    Called once per engine process at start-up. Selected by ``kv_tiers``
    (``[[kv_tiers]]`` tables, or ``--kv-tier NAME:CAPACITY[:PATH]``, repeatable,
    nearest first); built in: ``cpu``, ``disk``. The KV cache manager writes
    blocks to each tier by its write policy (on eviction from the level above,
    or on a request's completion) and looks a prefix up in the tiers when the
    device cache misses.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_structured_outputs_backends(register: Register) -> None:
    """Register structured-output backends (slot ``structured_outputs_backend``): grammar engines that constrain
    a request's tokens to a JSON schema, a regex, a choice or a grammar.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.StructuredOutputBackend`` subclass, built as ``cls(tokenizer, vocab_size)``
        (plus ``options=`` when its plugin declares options) on the first request that needs it.
    :return: nothing; every implementation is called.

    Called once per process at start-up. The API front end builds the selected backend to validate
    constraints before it accepts a request; the engine builds it to compile and match them. Selected by
    ``structured_outputs_config.backend`` (``--structured-outputs-config``); first party: ``guidance``
    (llguidance, also ``llguidance``; the default) and ``xgrammar`` (plugins ``structured_outputs`` and
    ``xgrammar``).
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (slot ``tool_parser``): a model family's tool-call format read into OpenAI
    ``tool_calls``, whole and streamed, for requests whose ``tool_choice`` is ``auto``.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.ToolParser`` subclass, built as ``cls(tokenizer)`` (plus ``options=`` when its
        plugin declares options) once, when the API front end starts.
    :return: nothing; every implementation is called.

    Called once per process at start-up; only the API front end builds one. Selected by
    ``parsers.tool_call_parser`` (``--tool-call-parser``, with ``--enable-auto-tool-choice``); first party:
    ``hermes``, ``llama3_json``, ``mistral`` (plugin ``parsers``).
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers (slot ``reasoning_parser``): a reasoning model's thinking split from its
    answer into ``reasoning_content``, and where the thinking ends in its tokens.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.ReasoningParser`` subclass, built as ``cls(tokenizer)`` (plus ``options=`` when
        its plugin declares options).
    :return: nothing; every implementation is called.

    Called once per process at start-up. The API front end builds the selected parser when it starts; the
    engine builds it on its first structured-output request, to start the constraint after the reasoning.
    Selected by ``parsers.reasoning_parser`` (``--reasoning-parser``); first party: ``deepseek_r1``, ``qwen3``
    (plugin ``parsers``).
    Since: 0.1. Stability: provisional.
    """


# ---------------------------------------------------------------- registration: serving


@hookspec
def tokenmill_register_routers(register: Register) -> None:
    """Register routers (slot ``router``): which engine replica serves a request.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.Router`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once at start-up in the API front end (which never imports torch, so
    keep the router's module free of it). Selected by ``server.router``
    (``--router``; built in: ``round_robin``, alias ``round-robin``; the
    first-party plugin ``routers`` adds ``least_loaded``, ``kv_aware``,
    ``prefix_aware`` and ``lora_aware``). A router that raises at run time
    fails no request: the front end routes it with ``least_loaded`` and
    counts the fallback.
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_transports(register: Register) -> None:
    """Register transports (slot ``transport``): the sockets between the front end and engines.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.Transport`` subclass, built with no arguments.
    :return: nothing; every implementation is called.

    Called once per process at start-up (front end and engine; both must pick
    the same one). Selected by ``transport.backend`` (built in: ``zmq``).
    Since: 0.1. Stability: provisional.
    """


@hookspec
def tokenmill_register_engine_backends(register: Register) -> None:
    """Register engine backends (slot ``engine_backend``): where a server's engine replicas run.

    :param register: ``register(name, import_path)``; the import path names a
        ``tokenmill.interfaces.EngineBackend`` subclass, built as ``cls(config)`` (the
        resolved ``EngineConfig``), plus ``options=`` when its plugin declares options.
    :return: nothing; every implementation is called.

    Called once per process at start-up; only the API front end (``tokenmill serve``)
    builds a backend, once, so engine and worker processes need not have its plugin
    installed (and its module must not import torch). Selected by ``server.backend``
    (``--backend``): ``local``, the default, is the core's own engine processes on
    this host and selects no plugin; the first-party plugin ``ray_backend`` adds
    ``ray`` (replicas as Ray actors). The front end calls the backend's ``connect``
    before it installs its signal handlers, then ``start_engines`` and, on its way
    out, ``close``.
    Since: 0.1. Stability: provisional.
    """


# ---------------------------------------------------------------- registration: the command line


@hookspec
def tokenmill_register_commands(cli: click.Group) -> None:
    """Add subcommands to the ``tokenmill`` command (simonw/llm's ``register_commands``).

    :param cli: the ``tokenmill`` click group; add commands with ``@cli.command()``,
        ``@cli.group()`` or ``cli.add_command(command)``. A name the core CLI or another
        plugin already has is refused. Import what a command needs to run inside its
        function, so that ``tokenmill --help`` stays quick (and free of torch).
    :return: nothing; every implementation is called, each plugin's on its own. A plugin
        whose implementation raises, or adds a name that is taken, adds none of its
        commands and is listed by ``tokenmill plugins`` with its error, like a plugin that
        fails to import; the rest of the CLI works.

    Called once, in the ``tokenmill`` command's process only (never in a front end,
    engine or worker), when it first needs a command the core does not have: to list
    them (``tokenmill --help``) or to run one. ``tokenmill plugins`` calls it too, on a
    scratch group, to list the commands each plugin adds. First party: ``bench``,
    ``eval``, ``quantize`` and ``train`` (plugin ``commands``).
    Since: 0.1. Stability: provisional.
    """
