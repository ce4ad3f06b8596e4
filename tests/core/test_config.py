"""Config: TOML + flags (flags win), strict validation, round trip through `config show`."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from tokenmill.config import ConfigError, EngineConfig, load_config
from tokenmill.config.options import flag_specs
from tokenmill.model_files import DEFAULT_MODEL


def test_defaults_name_the_default_model() -> None:
    config = load_config()
    assert config.model.model == DEFAULT_MODEL.name
    assert (config.cache.block_size, config.attention.backend, config.model.dtype) == (16, "auto", "auto")
    assert config.model.quantization == "auto"


def test_flags_override_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cache]\nblock_size = 8\n[model]\ndtype = "float16"\n[plugins.my-plugin]\nwidth = 3\n')
    config = load_config(path, {"cache": {"block_size": 32}})
    assert config.cache.block_size == 32  # the flag
    assert config.model.dtype == "float16"  # the file, untouched by other flags
    assert config.plugins == {"my-plugin": {"width": 3}}


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "[cache]\nblock_size = 24\n",
            "invalid setting cache: block_size must be a power of two (8, 16, 32, ...), got 24",
        ),
        ("[cache]\nblock_size = 0\n", "invalid setting cache.block_size: Expected `int` >= 1 (got 0)"),
        ('[model]\ndtype = "int3"\n', "invalid setting model.dtype: Invalid enum value 'int3' (got 'int3')"),
        ('[model]\nmax_model_len = "long"\n', "invalid setting model.max_model_len: Expected `int | null`, got `str`"),
        ("[modle]\n", "unknown setting 'modle'; valid settings here: attention, cache, device, disable_plugins"),
        (
            "[model]\nbogus = 1\n",
            "unknown setting 'model.bogus'; valid settings here: dtype, fused_experts, layer_kernels, max_",
        ),
        ("[model\n", "not valid TOML"),
    ],
)
def test_bad_file_gives_one_line_naming_file_and_setting(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as excinfo:
        load_config(path)
    text = str(excinfo.value)
    assert text.startswith(str(path))
    assert message in text
    assert "\n" not in text


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file /nonexistent.toml does not exist"):
        load_config("/nonexistent.toml")


def test_config_is_frozen() -> None:
    config = load_config()
    with pytest.raises(AttributeError):
        config.cache.block_size = 4  # type: ignore[misc]


def test_toml_round_trip() -> None:
    config = load_config(overrides={"cache": {"block_size": 64}, "plugins": {"p": {"a": [1, 2], "s": 'q"x'}}})
    reread = msgspec.convert(tomllib.loads(config.to_toml()), EngineConfig)
    assert reread == config


def test_every_field_has_a_flag_and_documentation() -> None:
    specs = {spec.path: spec for spec in flag_specs()}
    assert specs[("cache", "block_size")].flag == "--block-size"
    assert specs[("attention", "backend")].flag == "--attention-backend"
    assert specs[("disable_plugins",)].flag == "--disable-plugin"
    assert all(spec.description for spec in specs.values())


def test_llm_keywords_select_every_slot_by_flag_name() -> None:
    from tokenmill.llm import config_from_kwargs
    from tokenmill.plugin_manager import PluginError, load_plugins

    config = config_from_kwargs(
        None, None, attention_backend="torch", scheduling_policy="priority", kv_cache_manager="paged",
        sampler="torch", logits_processors=["banned-words"], router="least-loaded", transport="zmq",
        quantization="none", block_size=32,
    )  # fmt: skip
    assert (config.attention.backend, config.scheduler.policy, config.cache.kv_cache_manager) == (
        "torch", "priority", "paged",
    )  # fmt: skip
    assert (config.sampler.logits_processors, config.server.router, config.transport.backend) == (
        ["banned-words"], "least-loaded", "zmq",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="unknown setting 'speed'; valid settings: .*attention_backend"):
        config_from_kwargs(None, None, speed="fast")
    # "backend" names three fields (attention, transport, server): as a keyword it is --backend, server.backend's
    # flag, never a guess between the fields; the engine backend it names is checked with the plugins.
    assert config_from_kwargs(None, None, backend="torch").server.backend == "torch"
    with pytest.raises(PluginError, match="^server.backend: unknown engine_backend 'torch'; installed: .*ray"):
        load_plugins().check_config(config_from_kwargs(None, None, backend="torch"))


def test_default_chat_template_kwargs_flag_takes_a_json_object(tmp_path: Path) -> None:
    import click
    from click.testing import CliRunner

    from tokenmill.config.options import config_options

    seen: list[EngineConfig] = []

    @click.command()
    @config_options
    def command(config: EngineConfig) -> None:
        seen.append(config)

    flag = "--default-chat-template-kwargs"
    result = CliRunner().invoke(command, [flag, '{"enable_thinking": false, "persona": {"name": "x"}}'])
    assert result.exit_code == 0, result.output
    kwargs = seen[0].server.default_chat_template_kwargs
    assert kwargs == {"enable_thinking": False, "persona": {"name": "x"}}
    assert msgspec.convert(tomllib.loads(seen[0].to_toml()), EngineConfig) == seen[0]
    result = CliRunner().invoke(command, [flag, "[1]"])
    assert result.exit_code != 0 and "must be a JSON object, got [1]" in result.output
    result = CliRunner().invoke(command, [flag, '{"add_generation_prompt": false}'])
    assert isinstance(result.exception, ConfigError)
    assert "server.default_chat_template_kwargs cannot set 'add_generation_prompt'" in str(result.exception)
    assert load_config().server.default_chat_template_kwargs == {}
