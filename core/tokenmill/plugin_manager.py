"""Loading plugins and resolving the named implementations they register.

Built-in plugins (the modules in ``BUILTIN_PLUGINS``) and third-party ones
(entry point group ``tokenmill``) go through the same hooks. Each registration
hook fills one *slot* of the ``Registry``; the config then picks an
implementation per slot by name, and only then is its module imported.
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from tokenmill import envs, hookspecs
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tokenmill"

#: Modules of tokenmill itself that implement hooks, loaded like any plugin.
#: Each is a registration-only module: it imports no torch, so any process can list plugins.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "tokenmill.models.plugin",
    "tokenmill.attention.plugin",
    "tokenmill.weights.plugin",
    "tokenmill.layers.plugin",
    "tokenmill.routing",
)
#: Built-in plugins that ``--disable-plugin`` refuses to disable.
ESSENTIAL_PLUGINS: tuple[str, ...] = (
    "tokenmill.attention.plugin",
    "tokenmill.layers.plugin",
    "tokenmill.routing",
)


class Slot(enum.StrEnum):
    """A place in the runtime that a named implementation fills."""

    ARCHITECTURE = "architecture"
    ATTENTION_BACKEND = "attention_backend"
    WEIGHT_FORMAT = "weight_format"
    QUANTIZER = "quantizer"
    ROUTER = "router"


#: Which registration hook fills which slot.
_SLOT_HOOKS: dict[Slot, str] = {
    Slot.ARCHITECTURE: "tokenmill_register_architectures",
    Slot.ATTENTION_BACKEND: "tokenmill_register_attention_backends",
    Slot.WEIGHT_FORMAT: "tokenmill_register_weight_formats",
    Slot.QUANTIZER: "tokenmill_register_quantizers",
    Slot.ROUTER: "tokenmill_register_routing_policies",
}


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
    source: str  # "builtin" or "entry point"
    hooks: list[str] = field(default_factory=list)
    provides: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None


class Registry:
    """Named implementations per slot, imported lazily when selected."""

    def __init__(self) -> None:
        self._entries: dict[Slot, dict[str, Registration]] = {slot: {} for slot in Slot}
        self.failed_plugins: dict[str, str] = {}

    def register(self, slot: Slot, name: str, import_path: str, plugin: str) -> None:
        if ":" not in import_path:
            raise PluginError(
                f"plugin {plugin!r} registered {slot.value} {name!r} with import path {import_path!r}; "
                "expected 'package.module:Attribute'"
            )
        existing = self._entries[slot].get(name)
        if existing is not None and existing.import_path != import_path:
            raise PluginError(
                f"{slot.value} {name!r} is registered by both {existing.plugin!r} and {plugin!r}; "
                "disable one of them with --disable-plugin"
            )
        self._entries[slot][name] = Registration(name, import_path, plugin)

    def names(self, slot: Slot) -> list[str]:
        return sorted(self._entries[slot])

    def registrations(self, slot: Slot) -> list[Registration]:
        """Registrations in the order they were made (built-ins first)."""
        return list(self._entries[slot].values())

    def load(self, slot: Slot, name: str) -> Any:
        """Import and return the object registered as ``name`` in ``slot``."""
        entry = self._entries[slot].get(name)
        if entry is None:
            installed = ", ".join(self.names(slot)) or "none"
            message = f"unknown {slot.value} {name!r}; installed: {installed}"
            if self.failed_plugins:
                failed = "; ".join(f"{p} ({err})" for p, err in self.failed_plugins.items())
                message += f"; plugins that failed to load: {failed}"
            raise PluginError(message)
        module_name, _, attribute = entry.import_path.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
            for part in attribute.split("."):
                target = getattr(target, part)
        except Exception as exc:  # the selected plugin is broken: fatal, with its name
            raise PluginError(
                f"{slot.value} {name!r} from plugin {entry.plugin!r} failed to import "
                f"{entry.import_path!r}: {type(exc).__name__}: {exc}"
            ) from exc
        return target


class PluginSystem:
    """The plugin manager of one process, with the registry it filled."""

    def __init__(self, pm: pluggy.PluginManager, registry: Registry, infos: list[PluginInfo]) -> None:
        self.pm = pm
        self.registry = registry
        self.infos = infos

    @property
    def hook(self) -> Any:
        return self.pm.hook


def _distribution_version(entry_point: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry_point, "dist", None)
    return dist.version if dist is not None else "unknown"


def load_plugins(
    disabled: Iterable[str] = (),
    allowlist: Iterable[str] | None = None,
    autoload: bool | None = None,
    extra_plugins: Iterable[tuple[str, object]] = (),
) -> PluginSystem:
    """Load built-in and entry-point plugins and fill the registry.

    :param disabled: plugin names (entry point names or built-in module names) to skip.
    :param allowlist: when given, only these entry-point plugins load
        (defaults to ``TOKENMILL_PLUGINS``).
    :param autoload: load entry-point plugins at all (defaults to not
        ``TOKENMILL_DISABLE_PLUGIN_AUTOLOAD``).
    :param extra_plugins: ``(name, plugin_object)`` pairs registered as well (tests).
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
        module = importlib.import_module(module_name)
        pm.register(module, name=module_name)
        infos.append(PluginInfo(module_name, __version__, "builtin"))

    if autoload:
        allowed = set(allowlist) if allowlist is not None else None
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.name in disabled or (allowed is not None and entry_point.name not in allowed):
                continue
            if pm.has_plugin(entry_point.name):
                continue  # the same distribution seen twice on sys.path
            info = PluginInfo(entry_point.name, _distribution_version(entry_point), "entry point")
            infos.append(info)
            try:
                pm.register(entry_point.load(), name=entry_point.name)
            except Exception as exc:  # a broken plugin is reported, not fatal
                info.error = f"{type(exc).__name__}: {exc}"
                logger.warning("plugin %r failed to load: %s", entry_point.name, info.error)

    for name, plugin in extra_plugins:
        pm.register(plugin, name=name)
        infos.append(PluginInfo(name, "unknown", "extra"))

    pm.hook.tokenmill_add_hookspecs(pluginmanager=pm)
    try:
        pm.check_pending()  # a misspelled hook name fails here, loudly
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {pm.get_name(exc.plugin)!r}: {exc}") from None

    registry = Registry()
    info_by_name = {info.name: info for info in infos}
    for info in infos:
        if info.error is not None:
            registry.failed_plugins[info.name] = info.error
    for slot, hook_name in _SLOT_HOOKS.items():
        # Call each implementation on its own so every name is attributed to its plugin.
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            info = info_by_name[impl.plugin_name]

            def register(name: str, import_path: str, _slot: Slot = slot, _info: PluginInfo = info) -> None:
                registry.register(_slot, name, import_path, _info.name)
                _info.provides.setdefault(_slot.value, []).append(name)

            try:
                impl.function(register=register)
            except PluginError:
                raise
            except Exception as exc:
                info.error = f"{hook_name} raised {type(exc).__name__}: {exc}"
                registry.failed_plugins[info.name] = info.error
                logger.warning("plugin %r failed in %s: %s", info.name, hook_name, exc)
    for info in infos:
        if info.error is None and pm.has_plugin(info.name):
            plugin = pm.get_plugin(info.name)
            info.hooks = sorted(caller.name for caller in pm.get_hookcallers(plugin) or [])
    return PluginSystem(pm, registry, infos)
