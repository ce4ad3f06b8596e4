"""Click options derived from the config sections, so every field is also a flag.

A flag is named after its field (``block_size`` → ``--block-size``) unless the
field's metadata names one. A section whose field names a flag (``speculative_config``
→ ``--speculative-config``) is given whole, as JSON, the way vLLM takes it.
Only flags the user gave become overrides, so the TOML file's values survive
unless a flag replaces them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import click
import msgspec
import msgspec.inspect as mi

from tokenmill.config.engine import EngineConfig, load_config


@dataclass(frozen=True)
class FlagSpec:
    flag: str
    path: tuple[str, ...]  # where the value goes: ("cache", "block_size")
    type_info: mi.Type
    description: str
    default: Any
    #: Set for a field of a section given as one JSON flag: the key inside that JSON.
    json_key: str | None = None


def _unwrap(type_info: mi.Type) -> tuple[mi.Type, str, str | None]:
    description, flag = "", None
    if isinstance(type_info, mi.Metadata):
        description = (type_info.extra_json_schema or {}).get("description", "")
        flag = (type_info.extra or {}).get("flag")
        type_info = type_info.type
    if isinstance(type_info, mi.UnionType):
        non_null = [t for t in type_info.types if not isinstance(t, mi.NoneType)]
        if len(non_null) == 1:
            type_info = non_null[0]
    if isinstance(type_info, mi.Metadata):  # constraints on the inner type of an optional
        type_info = type_info.type
    return type_info, description, flag


def _collect(struct_type: type, prefix: tuple[str, ...]) -> list[FlagSpec]:
    specs: list[FlagSpec] = []
    for field in mi.type_info(struct_type).fields:  # type: ignore[attr-defined]
        if isinstance(field.type, mi.StructType):
            specs += _collect(field.type.cls, (*prefix, field.name))
            continue
        inner, _, json_flag = _unwrap(field.type)
        if isinstance(inner, mi.StructType) and json_flag:
            specs += [replace(spec, flag=json_flag, json_key=spec.path[-1])
                      for spec in _collect(inner.cls, (*prefix, field.name))]  # fmt: skip
            continue
        type_info, description, flag = _unwrap(field.type)
        if isinstance(type_info, mi.DictType) and flag is None:
            continue  # per-plugin tables: TOML only
        if field.default is not msgspec.NODEFAULT:
            default = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        else:
            default = None
        name = flag or "--" + field.name.replace("_", "-")
        specs.append(FlagSpec(name, (*prefix, field.name), type_info, description, default))
    return specs


def flag_specs() -> list[FlagSpec]:
    """One spec per config field that has a flag."""
    specs = _collect(EngineConfig, ())
    names = [spec.flag for spec in specs if spec.json_key is None]
    duplicated = {name for name in names if names.count(name) > 1}
    assert not duplicated, f"config fields share CLI flags {duplicated}; set describe(flag=...)"
    return specs


def _click_option(spec: FlagSpec) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    param_name = "cfg__" + "__".join(spec.path)
    help_text = spec.description + (f" [default: {spec.default}]" if spec.default not in (None, [], {}) else "")
    info = spec.type_info
    if isinstance(info, mi.DictType):  # a mapping field with a flag takes it whole, as JSON
        return _json_option(spec.flag, spec.path, help_text)
    if isinstance(info, (mi.ListType, mi.VarTupleType)):
        item = info.item_type.type if isinstance(info.item_type, mi.Metadata) else info.item_type
        item_type = {mi.IntType: int, mi.FloatType: float}.get(type(item), str)
        return click.option(spec.flag, param_name, multiple=True, type=item_type, help=help_text + " Repeatable.")
    if isinstance(info, mi.BoolType):
        return click.option(f"{spec.flag}/--no-{spec.flag[2:]}", param_name, default=None, help=help_text)
    if isinstance(info, mi.LiteralType):
        return click.option(spec.flag, param_name, type=click.Choice([str(v) for v in info.values]), help=help_text)
    click_type = {mi.IntType: int, mi.FloatType: float}.get(type(info), str)
    return click.option(spec.flag, param_name, type=click_type, help=help_text)


def _json_option(
    flag: str, path: tuple[str, ...], help_text: str
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One flag taking a JSON object (a whole section, or a mapping field); bad JSON is a one-line usage error."""

    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any] | None:
        if value is None:
            return None
        try:
            parsed = msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise click.BadParameter(f"not valid JSON ({exc}): {value}") from None
        if not isinstance(parsed, dict):
            raise click.BadParameter(f"must be a JSON object, got {value}")
        return parsed

    return click.option(flag, "cfg__" + "__".join(path), callback=parse, help=help_text)


def config_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a click command: adds ``--config FILE`` and one flag per config field,
    and passes the resolved ``EngineConfig`` as the ``config`` keyword argument."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        overrides: dict[str, Any] = {}
        for key in [k for k in kwargs if k.startswith("cfg__")]:
            value = kwargs.pop(key)
            if value is None or value == ():
                continue
            *sections, field = key.removeprefix("cfg__").split("__")
            target = overrides
            for section in sections:
                target = target.setdefault(section, {})
            if isinstance(value, dict):  # a section or a mapping given as JSON
                target.setdefault(field, {}).update(value)
            else:
                target[field] = list(value) if isinstance(value, tuple) else value
        config_file = kwargs.pop("config_file")
        model = kwargs.pop("model_argument", None)
        if model is not None:
            overrides.setdefault("model", {})["model"] = model
        kwargs["config"] = load_config(config_file, overrides)
        return command(*args, **kwargs)

    decorated: Callable[..., Any] = wrapper
    specs = flag_specs()
    json_sections = {spec.flag: spec.path[:-1] for spec in specs if spec.json_key is not None}
    for flag, path in json_sections.items():
        help_text = f"The [{'.'.join(path)}] table as a JSON object (keys in docs/configuration.md)."
        decorated = _json_option(flag, path, help_text)(decorated)
    for spec in reversed([spec for spec in specs if spec.json_key is None]):
        decorated = _click_option(spec)(decorated)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False),
        help="TOML config file; flags given on the command line override it.",
    )(decorated)
