"""Tenants and adapters without a server: which key may use, see, load and unload which adapter, and a key's
default adapter (docs/lora.md#tenants)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.config import ConfigError, load_config
from tokenmill.lora.registry import LoRARegistry
from tokenmill.server.lora import LoRAEndpoints
from tokenmill.server.protocol import ProtocolError
from tokenmill.server.tenants import ApiKeyEntry, KeyState, Tenants, load_api_keys

_KEYS = [
    ApiKeyEntry(key="sk-a", tenant="a", lora_adapters=["a-sql", "a-chat"]),
    ApiKeyEntry(key="sk-a-default", tenant="a", lora_adapters=["a-chat"], default_lora_adapter="a-sql"),
    ApiKeyEntry(key="sk-b", tenant="b", default_lora_adapter="b-sql"),
    ApiKeyEntry(key="sk-open", tenant="open"),
]


@pytest.fixture
def endpoints(adapters: list[Path]) -> LoRAEndpoints:
    registry = LoRARegistry("base", max_lora_rank=16)
    for name, path in [("a-sql", adapters[0]), ("a-chat", adapters[1]), ("b-sql", adapters[2]),
                       ("shared", adapters[3])]:  # fmt: skip
        registry.load(name, str(path))
    return LoRAEndpoints(registry, allow_runtime_updating=True, tenants=Tenants(_KEYS, api_key="sk-single"))


def _key(endpoints: LoRAEndpoints, key: str) -> KeyState:
    assert endpoints.tenants is not None
    return endpoints.tenants.authenticate(f"Bearer {key}")


def _resolve(endpoints: LoRAEndpoints, key: str, model: str) -> str | None:
    lora = endpoints.resolve(model, _key(endpoints, key))
    return None if lora is None else lora.lora_name


def test_a_key_uses_its_adapters_and_gets_404_for_another_tenants(endpoints: LoRAEndpoints) -> None:
    assert _resolve(endpoints, "sk-a", "a-sql") == "a-sql"
    assert _resolve(endpoints, "sk-a", "a-chat") == "a-chat"
    assert _resolve(endpoints, "sk-a", "base") is None
    for key, model in [("sk-a", "b-sql"), ("sk-a", "shared"), ("sk-b", "a-sql"), ("sk-open", "a-chat"),
                       ("sk-single", "b-sql"), ("sk-a-default", "b-sql"), ("sk-a", "no-such")]:  # fmt: skip
        with pytest.raises(ProtocolError) as raised:
            _resolve(endpoints, key, model)
        assert raised.value.status == 404 and raised.value.code == "model_not_found"
        # The same answer as for a name nobody serves: it does not tell whether the adapter exists.
        assert str(raised.value) == f"The model `{model}` does not exist or you do not have access to it."
    # Keys that list no adapters use the ones no key lists.
    assert _resolve(endpoints, "sk-open", "shared") == "shared"
    assert _resolve(endpoints, "sk-single", "shared") == "shared"


def test_a_default_adapter_serves_requests_that_name_the_base_model(endpoints: LoRAEndpoints) -> None:
    assert _resolve(endpoints, "sk-a-default", "base") == "a-sql"  # allowed though not in its list
    assert _resolve(endpoints, "sk-a-default", "a-sql") == "a-sql"
    assert _resolve(endpoints, "sk-a-default", "a-chat") == "a-chat"
    assert _resolve(endpoints, "sk-b", "base") == "b-sql"
    with pytest.raises(ProtocolError):  # sk-b lists nothing, and every other adapter but "shared" is claimed
        _resolve(endpoints, "sk-b", "a-chat")
    assert _resolve(endpoints, "sk-b", "shared") == "shared"
    # A default adapter that is not served (unloaded) is a 404, never the base model instead.
    endpoints.registry.unload("b-sql")
    with pytest.raises(ProtocolError) as raised:
        _resolve(endpoints, "sk-b", "base")
    assert raised.value.status == 404 and "b-sql" in str(raised.value)


def test_models_lists_only_a_keys_adapters(endpoints: LoRAEndpoints) -> None:
    def listed(key: str) -> list[object]:
        return [card["id"] for card in endpoints.model_cards(0, "base", _key(endpoints, key))]

    assert listed("sk-a") == ["a-sql", "a-chat"]
    assert listed("sk-a-default") == ["a-sql", "a-chat"]
    assert listed("sk-b") == ["b-sql", "shared"]
    assert listed("sk-open") == ["shared"]


def test_a_key_cannot_load_or_unload_another_tenants_adapter(endpoints: LoRAEndpoints, adapters: list[Path]) -> None:
    body = f'{{"lora_name": "a-new", "lora_path": "{adapters[4]}"}}'.encode()
    for key in ("sk-b", "sk-open"):
        with pytest.raises(ProtocolError) as raised:
            endpoints.unload(b'{"lora_name": "a-sql"}', _key(endpoints, key))
        assert raised.value.status == 404
    assert endpoints.registry.get("a-sql") is not None
    # "a-new" is nobody's: anyone may load it (and it is then everyone's but the listing keys').
    assert endpoints.load(body, _key(endpoints, "sk-open")).status_code == 200
    assert _resolve(endpoints, "sk-b", "a-new") == "a-new"
    assert endpoints.unload(b'{"lora_name": "a-sql"}', _key(endpoints, "sk-a")).status_code == 200
    with pytest.raises(ProtocolError) as raised:  # a name tenant a lists is a's to load
        endpoints.load(f'{{"lora_name": "a-sql", "lora_path": "{adapters[4]}"}}'.encode(), _key(endpoints, "sk-b"))
    assert raised.value.status == 404


def test_keys_file_fields_and_lora_off(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nkey = "sk-a"\ntenant = "a"\nlora_adapters = ["x", "y"]\ndefault_lora_adapter = "x"\n'
        '[[keys]]\nkey = "sk-b"\ntenant = "b"\n'
    )
    entries = load_api_keys(keys)
    assert entries[0].lora_adapters == ["x", "y"] and entries[0].default_lora_adapter == "x"
    assert entries[1].lora_adapters is None
    tenants = Tenants(entries)
    assert tenants.restricts_adapters and tenants.claimed_adapters == {"x", "y"}
    assert not Tenants(entries[1:]).restricts_adapters
    config = load_config(overrides={"model": {"model": str(tmp_path)}, "server": {"api_keys": str(keys)}})
    with pytest.raises(ConfigError, match="gives keys lora_adapters or default_lora_adapter, but lora.enable_lora"):
        LoRAEndpoints.from_config(config, "base", tenants)
