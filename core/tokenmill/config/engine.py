"""``EngineConfig``: every section together, and how it is read from TOML and flags."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any

import msgspec
import msgspec.inspect

from tokenmill.config.attention import AttentionConfig
from tokenmill.config.base import ConfigSection, describe
from tokenmill.config.cache import CacheConfig, KVTierConfig, kv_tier_entry
from tokenmill.config.device import DeviceConfig
from tokenmill.config.lora import LoRAConfig
from tokenmill.config.model import ModelConfig
from tokenmill.config.parallel import ParallelConfig
from tokenmill.config.parsers import ParsersConfig
from tokenmill.config.sampler import SamplerConfig
from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.config.server import ServerConfig
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.config.structured_outputs import StructuredOutputsConfig
from tokenmill.config.transport import TransportConfig
from tokenmill.errors import TokenmillError


class ConfigError(TokenmillError, ValueError):
    """The config file or a flag is wrong; the message names the setting and the fix."""


class EngineConfig(ConfigSection, frozen=True):
    """A whole runtime: one table per subsystem, plus per-plugin options."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    device: DeviceConfig = msgspec.field(default_factory=DeviceConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    attention: AttentionConfig = msgspec.field(default_factory=AttentionConfig)
    sampler: SamplerConfig = msgspec.field(default_factory=SamplerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    lora: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    kv_tiers: Annotated[
        list[KVTierConfig],
        describe(
            "KV tiers below the device cache, nearest first, as `[[kv_tiers]]` tables (name, capacity, path, "
            "write) or flags 'NAME:CAPACITY[:PATH]' (e.g. 'cpu:4GiB', 'disk:20GiB:/var/cache/tokenmill/kv'): "
            "a prefix that misses on the device is loaded from them instead of recomputed "
            "(docs/kv_cache.md#kv-tiers).",
            flag="--kv-tier",
        ),
    ] = msgspec.field(default_factory=list)
    speculative_config: Annotated[
        SpeculativeConfig,
        describe("Speculative decoding, as vLLM's JSON (`tokenmill.config.speculative`).", flag="--speculative-config"),
    ] = msgspec.field(default_factory=SpeculativeConfig)
    structured_outputs_config: Annotated[
        StructuredOutputsConfig,
        describe(
            "Structured outputs, as vLLM's JSON (`tokenmill.config.structured_outputs`).",
            flag="--structured-outputs-config",
        ),
    ] = msgspec.field(default_factory=StructuredOutputsConfig)
    parsers: ParsersConfig = msgspec.field(default_factory=ParsersConfig)
    disable_plugins: Annotated[
        list[str],
        describe("Plugins (entry point names) not to load.", flag="--disable-plugin"),
    ] = msgspec.field(default_factory=list)
    plugins: Annotated[
        dict[str, dict[str, Any]],
        describe(
            "Options for each plugin, as `[plugins.NAME]` tables, checked against the options the plugin "
            "declares and handed to the classes it registers; `tokenmill plugins` lists them."
        ),
    ] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        tp = self.parallel.tensor_parallel_size
        if tp > 1:
            # What a sharded model cannot do yet: refused here, before anything loads.
            unsupported = [
                (self.speculative_config.method is not None, "speculative decoding (speculative_config.method)"),
                (bool(self.kv_tiers), "KV tiers (kv_tiers)"),
                (self.lora.enable_lora, "LoRA adapters (lora.enable_lora)"),
            ]
            for is_set, what in unsupported:
                if is_set:
                    raise ValueError(
                        f"parallel.tensor_parallel_size={tp} does not support {what} yet; "
                        "turn it off or set tensor_parallel_size = 1"
                    )

    def to_dict(self) -> dict[str, Any]:
        """Every setting, defaults included: what `tokenmill config show` prints."""
        return msgspec.to_builtins(self)

    def to_toml(self) -> str:
        return _to_toml(self.to_dict())


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _lookup(data: Any, path: list[str]) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _describe_error(exc: msgspec.ValidationError, data: dict[str, Any], source: str) -> str:
    # msgspec says "Expected `int` >= 1 - at `$.cache.block_size`"; name the setting as TOML
    # would and show the value that was given.
    text, _, where = str(exc).partition(" - at `$.")
    path = where.rstrip("`").split(".") if where else []
    unknown = text.startswith("Object contains unknown field ")
    if unknown:
        key = text.removeprefix("Object contains unknown field ").strip("`")
        setting = ".".join([*path, key])
        valid = _valid_keys(path)
        return f"{source}: unknown setting {setting!r}; valid settings here: {', '.join(valid)}"
    if not path:  # a check across sections (EngineConfig.__post_init__): its message names the settings
        return f"{source}: {text}"
    setting = ".".join(path)
    value = _lookup(data, path)
    given = f" (got {value!r})" if value is not None and not isinstance(value, dict) else ""
    return f"{source}: invalid setting {setting}: {text}{given}"


def _valid_keys(path: list[str]) -> list[str]:
    """Field names of the section at ``path`` ([] is the top level)."""
    struct_type: Any = EngineConfig
    for key in path:
        info = msgspec.inspect.type_info(struct_type)
        assert isinstance(info, msgspec.inspect.StructType)
        fields = {f.name: f.type for f in info.fields}
        field_type = fields.get(key)
        if isinstance(field_type, msgspec.inspect.Metadata):
            field_type = field_type.type
        if not isinstance(field_type, msgspec.inspect.StructType):
            return []
        struct_type = field_type.cls
    return sorted(struct_type.__struct_fields__)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> EngineConfig:
    """Read a TOML file (optional) and apply ``overrides`` on top (CLI flags win).

    ``overrides`` is nested like the file (``{"cache": {"block_size": 32}}``).
    Raises ``ConfigError`` with a one-line message naming the file or flag,
    the setting and what is wrong with it.
    """
    data: dict[str, Any] = {}
    source = "command line"
    if path is not None:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if overrides:
        data = _deep_merge(data, overrides)
        if path is not None:
            source = f"{path} (with command-line flags)"
    if isinstance(data.get("kv_tiers"), list):  # 'NAME:CAPACITY[:PATH]' strings, from flags or keywords
        try:
            data["kv_tiers"] = [kv_tier_entry(e) if isinstance(e, str) else e for e in data["kv_tiers"]]
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    try:
        return msgspec.convert(data, EngineConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe_error(exc, data, source)) from None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()  # JSON string escapes are valid TOML
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if v is not None]  # TOML has no null: unset keys are left out
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else msgspec.json.encode(key).decode()


def _scalar_lines(table: dict[str, Any]) -> list[str]:
    # TOML has no null: an unset value is written as a comment, so the output still parses.
    return [
        f"# {_toml_key(key)} = (unset)" if value is None else f"{_toml_key(key)} = {_toml_value(value)}"
        for key, value in table.items()
    ]


def _to_toml(data: dict[str, Any]) -> str:
    """Write a config dict as TOML: top-level settings, one table per section, one per plugin."""
    top = {k: v for k, v in data.items() if not isinstance(v, dict)}
    lines = _scalar_lines(top)
    for section, table in data.items():
        if isinstance(table, dict) and section != "plugins":
            lines += ["", f"[{section}]", *_scalar_lines(table)]
    for plugin, options in data.get("plugins", {}).items():
        lines += ["", f"[plugins.{_toml_key(plugin)}]", *_scalar_lines(options)]
    return "\n".join(lines) + "\n"
