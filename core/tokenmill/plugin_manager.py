"""Loading plugins and resolving the named implementations they register.

Built-in plugins (the modules in ``BUILTIN_PLUGINS``) and third-party ones
(entry point group ``tokenmill``) go through the same hooks. Each registration
hook fills one *slot* of the ``Registry``; the config then picks an
implementation per slot by name, and only then is its module imported.

A third-party plugin that cannot be used (its module fails to import, it
registers a name another plugin already has, it implements a hook this version
lacks, or one of its hooks raises) is recorded with its error and skipped: it
becomes fatal only when the config selects something it would have provided.

In the ``tokenmill`` command's process, ``load_plugins(cli=...)`` also lets each
plugin add subcommands (``tokenmill_register_commands``); a plugin whose command
hook raises, or adds a name that is taken, is skipped the same way.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import pluggy

from tokenmill import envs, hookspecs
from tokenmill.errors import TokenmillError

if TYPE_CHECKING:
    import click

    from tokenmill.config import EngineConfig

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tokenmill"
#: The key of ``PluginInfo.provides`` that lists the subcommands a plugin adds to ``tokenmill``.
COMMANDS = "command"
#: The distribution whose entry points are first-party: an allowlist never drops them.
FIRST_PARTY_DISTRIBUTION = "tokenmill"

#: Modules of tokenmill itself that implement hooks, loaded like any plugin.
#: Each is a registration-only module: it imports no torch, so any process can list plugins.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "tokenmill.models.plugin",
    "tokenmill.attention.plugin",
    "tokenmill.weights.plugin",
    "tokenmill.layers.plugin",
    "tokenmill.lora.plugin",
    "tokenmill.scheduler",
    "tokenmill.kv_cache.plugin",
    "tokenmill.sampling.plugin",
    "tokenmill.routing",
    "tokenmill.transport.plugin",
)
#: Built-in plugins that ``--disable-plugin`` refuses to disable: the reference implementations.
ESSENTIAL_PLUGINS: tuple[str, ...] = BUILTIN_PLUGINS[1:]


class Slot(enum.StrEnum):
    """A place in the runtime that a named implementation fills."""

    ARCHITECTURE = "architecture"
    WEIGHT_FORMAT = "weight_format"
    QUANTIZER = "quantizer"
    ATTENTION_BACKEND = "attention_backend"
    LAYER_KERNEL = "layer_kernel"
    FUSED_EXPERT = "fused_expert"
    SCHEDULER = "scheduler"
    KV_CACHE_MANAGER = "kv_cache_manager"
    SAMPLER = "sampler"
    LOGITS_PROCESSOR = "logits_processor"
    SPECULATOR = "speculator"
    KV_TIER = "kv_tier"
    ROUTER = "router"
    TRANSPORT = "transport"
    ENGINE_BACKEND = "engine_backend"
    STRUCTURED_OUTPUTS_BACKEND = "structured_outputs_backend"
    LORA_KERNEL = "lora_kernel"
    TOOL_PARSER = "tool_parser"
    REASONING_PARSER = "reasoning_parser"

    @property
    def hook_name(self) -> str:
        """The registration hook that fills this slot."""
        return f"tokenmill_register_{self.value}s"


class PluginError(TokenmillError):
    """A plugin or a plugin name in the config is wrong; the message says what to change."""


@dataclass(frozen=True)
class Registration:
    name: str
    import_path: str
    plugin: str


@dataclass
class PluginInfo:
    """What ``tokenmill plugins`` shows for one plugin."""

    name: str
    version: str
    source: str  # "builtin", "entry point" or "extra"
    package: str = FIRST_PARTY_DISTRIBUTION  # the distribution that ships it
    hooks: list[str] = field(default_factory=list)
    provides: dict[str, list[str]] = field(default_factory=dict)
    options_type: type[msgspec.Struct] | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        """How messages name it: the plugin and the package it comes from."""
        if self.package == "unknown":  # registered as an object (tests), not from a distribution
            return f"plugin {self.name!r}"
        return f"plugin {self.name!r} (package {self.package} {self.version})"


class Registry:
    """Named implementations per slot, imported lazily when selected."""

    def __init__(self) -> None:
        self._entries: dict[Slot, dict[str, Registration]] = {slot: {} for slot in Slot}
        self.plugins: dict[str, PluginInfo] = {}

    @property
    def failed_plugins(self) -> dict[str, str]:
        return {name: info.error for name, info in self.plugins.items() if info.error is not None}

    def conflict(self, slot: Slot, name: str, import_path: str) -> Registration | None:
        """The registration that ``name`` would clash with in ``slot`` (same name, another class)."""
        existing = self._entries[slot].get(name)
        return existing if existing is not None and existing.import_path != import_path else None

    def add(self, slot: Slot, registration: Registration) -> None:
        self._entries[slot][registration.name] = registration

    def names(self, slot: Slot) -> list[str]:
        return sorted(self._entries[slot])

    def registrations(self, slot: Slot) -> list[Registration]:
        """Registrations in the order they were made (built-ins first)."""
        return list(self._entries[slot].values())

    def get(self, slot: Slot, name: str) -> Registration:
        """The registration of ``name``; an unknown name is a ``PluginError`` listing the installed ones."""
        entry = self._entries[slot].get(name)
        if entry is None:
            installed = ", ".join(self.names(slot)) or "none"
            message = f"unknown {slot.value} {name!r}; installed: {installed}"
            if self.failed_plugins:
                failed = "; ".join(f"{self.plugins[p].label}: {err}" for p, err in self.failed_plugins.items())
                message += f"; plugins that failed to load: {failed}"
            raise PluginError(message)
        return entry

    def load(self, slot: Slot, name: str) -> Any:
        """Import and return the object registered as ``name`` in ``slot``."""
        entry = self.get(slot, name)
        module_name, _, attribute = entry.import_path.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                target = getattr(target, part)
        except Exception as exc:  # the selected plugin is broken: fatal, with its name
            info = self.plugins.get(entry.plugin)
            who = info.label if info is not None else f"plugin {entry.plugin!r}"
            raise PluginError(
                f"{slot.value} {name!r} from {who} failed to import {entry.import_path!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return target


class PluginSystem:
    """The plugin manager of one process, the registry it filled, and each plugin's validated options."""

    def __init__(self, pm: pluggy.PluginManager, registry: Registry, infos: list[PluginInfo]) -> None:
        self.pm = pm
        self.registry = registry
        self.infos = infos
        self._options: dict[str, msgspec.Struct] = {}

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def configure(self, tables: dict[str, dict[str, Any]]) -> None:
        """Validate the config's ``[plugins.NAME]`` tables against the options each plugin declared.

        A table for a plugin that is not installed, or that declares no options, is an error; so is an
        unknown key or a wrong type. A plugin that failed to load keeps its table unchecked.
        """
        infos = {info.name: info for info in self.infos}
        for plugin_name, table in tables.items():
            info = infos.get(plugin_name)
            if info is not None and info.error is not None:
                continue  # reported by `tokenmill plugins`; fatal only if the config selects what it provides
            if info is None or info.options_type is None:
                takes = ", ".join(sorted(i.name for i in self.infos if i.options_type is not None)) or "none"
                what = "is not installed" if info is None else "declares no options"
                raise PluginError(
                    f"[plugins.{plugin_name}]: plugin {plugin_name!r} {what}; plugins with options: {takes}"
                )
            self._options[plugin_name] = _convert_options(info, table)
        for info in self.infos:  # defaults for plugins without a table
            if info.options_type is not None and info.error is None and info.name not in self._options:
                self._options[info.name] = _convert_options(info, {})

    def options(self, plugin_name: str) -> msgspec.Struct | None:
        """The validated options of a plugin (defaults when the config has no table), or None."""
        info = next((i for i in self.infos if i.name == plugin_name), None)
        if info is None or info.options_type is None:
            return None
        if plugin_name not in self._options:
            self._options[plugin_name] = _convert_options(info, {})
        return self._options[plugin_name]

    def load(self, slot: Slot, name: str) -> Any:
        """The class registered as ``name`` in ``slot`` (imported now)."""
        return self.registry.load(slot, name)

    def create(self, slot: Slot, name: str, *args: Any, **kwargs: Any) -> Any:
        """Build the implementation ``name`` of ``slot`` with ``args``, adding ``options=`` when its plugin
        declared options."""
        return self.instantiate(slot, name, self.registry.load(slot, name), *args, **kwargs)

    def instantiate(self, slot: Slot, name: str, cls: Any, *args: Any, **kwargs: Any) -> Any:
        """Build an already loaded implementation class, delivering its plugin's options."""
        options = self.options(self.registry.get(slot, name).plugin)
        if options is not None:
            kwargs["options"] = options
        return cls(*args, **kwargs)

    def resolved_config(self, config: EngineConfig) -> EngineConfig:
        """``config`` with a ``[plugins.NAME]`` table, defaults filled in, for every plugin that declares
        options: what `tokenmill config show` prints, so a run can be reproduced."""
        import msgspec.structs

        tables = dict(config.plugins)
        for info in self.infos:
            options = self.options(info.name) if info.error is None else None
            if options is not None:
                tables[info.name] = msgspec.to_builtins(options)
        return msgspec.structs.replace(config, plugins=tables)

    def check_config(self, config: EngineConfig, skip: Iterable[Slot] = ()) -> None:
        """Fail fast, before any model loads: every name the config selects is installed (except in the
        slots ``skip`` names, which this process never builds), and every ``[plugins.NAME]`` table is valid.
        Raises ``PluginError`` with one line naming the setting."""
        self.configure(config.plugins)
        skipped = set(skip)
        for slot, name, setting in selected_names(config):
            if slot in skipped:
                continue
            try:
                self.registry.get(slot, name)
            except PluginError as exc:
                raise PluginError(f"{setting}: {exc}") from None
        if Slot.KV_TIER not in skipped:
            from tokenmill.kv_cache.tier import check_tier_path

            for tier in config.kv_tiers:  # imports the tier's module (torch, in a front end): only with tiers
                try:
                    check_tier_path(self.load(Slot.KV_TIER, tier.name), tier.name, tier.capacity, tier.path)
                except ValueError as exc:
                    raise PluginError(str(exc)) from None


def slot_selections(config: EngineConfig) -> dict[Slot, tuple[str, list[str]]]:
    """For every slot, the setting that selects it and the names the config selects there (``auto`` kept;
    the built-in logits processors, which always run, first). The one place that maps settings to slots."""
    from tokenmill.config.server import LOCAL_BACKEND
    from tokenmill.sampling.plugin import BUILTIN_LOGITS_PROCESSORS

    weight_format = config.model.weight_format
    backend = config.server.backend
    return {
        Slot.ARCHITECTURE: ("the checkpoint's architectures[0]", []),
        Slot.WEIGHT_FORMAT: ("model.weight_format", [weight_format] if weight_format is not None else []),
        Slot.QUANTIZER: ("model.quantization", [config.model.quantization]),
        Slot.ATTENTION_BACKEND: ("attention.backend", [config.attention.backend]),
        Slot.LAYER_KERNEL: ("model.layer_kernels", [config.model.layer_kernels]),
        Slot.FUSED_EXPERT: ("model.fused_experts", [config.model.fused_experts]),
        Slot.SCHEDULER: ("scheduler.policy", [config.scheduler.policy]),
        Slot.KV_CACHE_MANAGER: ("cache.kv_cache_manager", [config.cache.kv_cache_manager]),
        Slot.SAMPLER: ("sampler.sampler", [config.sampler.sampler]),
        Slot.LOGITS_PROCESSOR: ("sampler.logits_processors",
                                list(dict.fromkeys([*BUILTIN_LOGITS_PROCESSORS, *config.sampler.logits_processors]))),
        Slot.SPECULATOR: ("speculative_config.method",
                          [config.speculative_config.method] if config.speculative_config.method else []),
        Slot.KV_TIER: ("kv_tiers", [tier.name for tier in config.kv_tiers]),
        Slot.ROUTER: ("server.router", [config.server.router]),
        Slot.TRANSPORT: ("transport.backend", [config.transport.backend]),
        Slot.ENGINE_BACKEND: ("server.backend", [backend] if backend != LOCAL_BACKEND else []),
        Slot.STRUCTURED_OUTPUTS_BACKEND: ("structured_outputs_config.backend",
                                          [config.structured_outputs_config.backend]),
        Slot.LORA_KERNEL: ("lora.lora_kernels", [config.lora.lora_kernels] if config.lora.enable_lora else []),
        Slot.TOOL_PARSER: ("parsers.tool_call_parser", _named(config.parsers.tool_call_parser)),
        Slot.REASONING_PARSER: ("parsers.reasoning_parser", _named(config.parsers.reasoning_parser)),
    }  # fmt: skip


def _named(name: str | None) -> list[str]:
    return [name] if name is not None else []


def selected_names(config: EngineConfig) -> list[tuple[Slot, str, str]]:
    """``(slot, name, setting)`` for every implementation the config names (``auto`` excluded)."""
    return [
        (slot, name, setting)
        for slot, (setting, names) in slot_selections(config).items()
        for name in names
        if name != "auto"
    ]


def _convert_options(info: PluginInfo, table: dict[str, Any]) -> msgspec.Struct:
    assert info.options_type is not None
    try:
        return msgspec.convert(table, info.options_type)
    except msgspec.ValidationError as exc:
        allowed = ", ".join(info.options_type.__struct_fields__) or "none"
        text, _, where = str(exc).partition(" - at `$.")
        if text.startswith("Object contains unknown field "):
            key = text.removeprefix("Object contains unknown field ").strip("`")
            raise PluginError(f"[plugins.{info.name}]: unknown option {key!r}; allowed: {allowed}") from None
        setting = where.rstrip("`") or "?"
        raise PluginError(f"[plugins.{info.name}]: invalid option {setting}: {text}") from None


def _distribution(entry_point: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(entry_point, "dist", None)
    return (dist.name, dist.version) if dist is not None else ("unknown", "unknown")


def load_plugins(
    disabled: Iterable[str] = (),
    allowlist: Iterable[str] | None = None,
    autoload: bool | None = None,
    extra_plugins: Iterable[tuple[str, object]] = (),
    cli: click.Group | None = None,
) -> PluginSystem:
    """Load built-in and entry-point plugins and fill the registry.

    :param disabled: plugin names (entry point names or built-in module names) to skip.
    :param allowlist: when given, only these third-party entry-point plugins load
        (defaults to ``TOKENMILL_PLUGINS``); first-party plugins always load.
    :param autoload: load entry-point plugins at all (defaults to not
        ``TOKENMILL_DISABLE_PLUGIN_AUTOLOAD``).
    :param extra_plugins: ``(name, plugin_object)`` pairs registered as well (tests).
    :param cli: the ``tokenmill`` click group, in that command's process only: each plugin's
        ``tokenmill_register_commands`` adds its subcommands to it (listed under ``provides["command"]``).
    """
    disabled = set(disabled)
    essential = disabled.intersection(ESSENTIAL_PLUGINS)
    if essential:
        raise PluginError(f"plugin(s) {sorted(essential)} are essential and cannot be disabled")
    if allowlist is None:
        allowlist = envs.TOKENMILL_PLUGINS.get()
    if autoload is None:
        autoload = not envs.TOKENMILL_DISABLE_PLUGIN_AUTOLOAD.get()

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    infos: list[PluginInfo] = []
    from tokenmill import __version__

    for module_name in BUILTIN_PLUGINS:
        if module_name in disabled:
            continue
        pm.register(importlib.import_module(module_name), name=module_name)
        infos.append(PluginInfo(module_name, __version__, "builtin"))

    if autoload:
        allowed = set(allowlist) if allowlist is not None else None
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            package, version = _distribution(entry_point)
            third_party = package != FIRST_PARTY_DISTRIBUTION
            if entry_point.name in disabled or (
                third_party and allowed is not None and entry_point.name not in allowed
            ):
                continue
            if pm.has_plugin(entry_point.name) or any(i.name == entry_point.name for i in infos):
                continue  # the same distribution seen twice on sys.path
            info = PluginInfo(entry_point.name, version, "entry point", package)
            infos.append(info)
            try:
                pm.register(entry_point.load(), name=entry_point.name)
            except Exception as exc:  # a broken plugin is reported, not fatal
                _fail(pm, info, f"failed to import: {type(exc).__name__}: {exc}")

    for name, plugin in extra_plugins:
        pm.register(plugin, name=name)
        infos.append(PluginInfo(name, "unknown", "extra", "unknown"))

    pm.hook.tokenmill_add_hookspecs(pluginmanager=pm)
    _reject_unknown_hooks(pm, infos)
    registry = Registry()
    for info in infos:
        registry.plugins[info.name] = info
        if info.error is None:
            _register(pm, registry, info, cli)
    for info in infos:
        if info.error is None:
            info.hooks = sorted(caller.name for caller in pm.get_hookcallers(pm.get_plugin(info.name)) or [])
    return PluginSystem(pm, registry, infos)


def _fail(pm: pluggy.PluginManager, info: PluginInfo, error: str) -> None:
    """Record why a plugin is skipped and take it out of the plugin manager."""
    if info.source == "builtin":
        raise PluginError(f"built-in {info.label}: {error}")  # a bug in tokenmill itself
    info.error = error
    info.provides.clear()
    if pm.has_plugin(info.name):
        pm.unregister(name=info.name)
    logger.warning("%s is skipped: %s", info.label, error)


def _reject_unknown_hooks(pm: pluggy.PluginManager, infos: list[PluginInfo]) -> None:
    """Skip plugins implementing a ``tokenmill_*`` hook that no spec declares (a typo, or a newer hook)."""
    from tokenmill import __version__

    for info in infos:
        plugin = pm.get_plugin(info.name) if info.error is None else None
        if plugin is None:
            continue
        unknown = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [] if not caller.has_spec())
        if unknown:
            _fail(pm, info, f"implements hook(s) that tokenmill {__version__} does not have: {', '.join(unknown)}")


def _register(pm: pluggy.PluginManager, registry: Registry, info: PluginInfo, cli: click.Group | None) -> None:
    """Run one plugin's registration hooks (its command hook too, given ``cli``); commit its names only if all
    of them are valid and new."""
    plugin = pm.get_plugin(info.name)
    collected: list[tuple[Slot, Registration]] = []
    try:
        for slot in Slot:
            for impl in getattr(pm.hook, slot.hook_name).get_hookimpls():
                if impl.plugin is not plugin:
                    continue

                def register(name: str, import_path: str, _slot: Slot = slot) -> None:
                    collected.append((_slot, Registration(name, import_path, info.name)))

                impl.function(register=register)
        options_impls = [i for i in pm.hook.tokenmill_plugin_options.get_hookimpls() if i.plugin is plugin]
        options_type = options_impls[0].function() if options_impls else None
    except Exception as exc:
        _fail(pm, info, f"a registration hook raised {type(exc).__name__}: {exc}")
        return
    if options_type is not None and not (isinstance(options_type, type) and issubclass(options_type, msgspec.Struct)):
        _fail(pm, info, f"tokenmill_plugin_options returned {options_type!r}, not a msgspec.Struct subclass")
        return
    for slot, registration in collected:
        if ":" not in registration.import_path:
            _fail(pm, info, f"registered {slot.value} {registration.name!r} with import path "
                            f"{registration.import_path!r}; expected 'package.module:Attribute'")  # fmt: skip
            return
        clash = registry.conflict(slot, registration.name, registration.import_path)
        if clash is not None:
            owner = registry.plugins[clash.plugin].label
            _fail(pm, info, f"registers {slot.value} {registration.name!r}, which {owner} already provides; "
                            "disable one of them with --disable-plugin")  # fmt: skip
            return
    commands: list[str] = []
    if cli is not None:
        commands, error = _add_commands(pm, registry, plugin, cli)
        if error is not None:
            _fail(pm, info, error)
            return
    for slot, registration in collected:
        registry.add(slot, registration)
        names = info.provides.setdefault(slot.value, [])
        if registration.name not in names:
            names.append(registration.name)
    if commands:
        info.provides[COMMANDS] = commands
    info.options_type = options_type


def _add_commands(
    pm: pluggy.PluginManager, registry: Registry, plugin: object, cli: click.Group
) -> tuple[list[str], str | None]:
    """Run one plugin's ``tokenmill_register_commands`` on ``cli``: the names it added, or the error that
    made it add none (``cli`` is then as it was)."""
    before = dict(cli.commands)
    error = None
    try:
        for impl in pm.hook.tokenmill_register_commands.get_hookimpls():
            if impl.plugin is plugin:
                impl.function(**dict.fromkeys(impl.argnames, cli))
    except Exception as exc:
        error = f"tokenmill_register_commands raised {type(exc).__name__}: {exc}"
    else:
        taken = sorted(name for name, command in before.items() if cli.commands.get(name) is not command)
        if taken:
            owners = [info.label for info in registry.plugins.values() if taken[0] in info.provides.get(COMMANDS, [])]
            owner = owners[0] if owners else "the tokenmill command"
            error = f"adds command {taken[0]!r}, which {owner} already has; disable one of them with --disable-plugin"
    if error is not None:
        cli.commands.clear()
        cli.commands.update(before)
        return [], error
    return sorted(set(cli.commands) - set(before)), None


#: Slots only the API front end builds: an engine process does not need their plugins installed.
FRONT_END_SLOTS: tuple[Slot, ...] = (Slot.ROUTER, Slot.ENGINE_BACKEND, Slot.TOOL_PARSER)


def resolve_plugins(config: EngineConfig, skip: Iterable[Slot] = ()) -> PluginSystem:
    """Load the plugins a config asks for and check its selections (but those in ``skip``) and options;
    the first thing every command does, so a misspelled name fails in well under a second, before any
    model loads."""
    system = load_plugins(disabled=config.disable_plugins)
    system.check_config(config, skip)
    return system
