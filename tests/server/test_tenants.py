"""Tenants without a server: the keys file, the token buckets on a fake clock, admission, salts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.config import ConfigError, load_config
from tokenmill.server.protocol import ProtocolError
from tokenmill.server.tenants import DEFAULT_TENANT, ApiKeyEntry, RateLimited, Tenants, load_api_keys


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tenants(*entries: ApiKeyEntry, api_key: str | None = None) -> tuple[Tenants, _Clock]:
    clock = _Clock()
    return Tenants(list(entries), api_key, clock=clock), clock


def _bearer(key: str) -> str:
    return f"Bearer {key}"


def test_toml_and_json_lines_give_the_same_entries(tmp_path: Path) -> None:
    toml = tmp_path / "keys.toml"
    toml.write_text(
        '[[keys]]\nkey = "sk-a"\ntenant = "team-a"\nrequests_per_minute = 60\n\n'
        '[[keys]]\nkey = "sk-b"\ntenant = "team-b"\ntokens_per_minute = 1000\nmax_concurrent_requests = 2\n'
    )
    jsonl = tmp_path / "keys.jsonl"
    jsonl.write_text(
        '{"key": "sk-a", "tenant": "team-a", "requests_per_minute": 60}\n\n'
        '{"key": "sk-b", "tenant": "team-b", "tokens_per_minute": 1000, "max_concurrent_requests": 2}\n'
    )
    expected = [
        ApiKeyEntry(key="sk-a", tenant="team-a", requests_per_minute=60),
        ApiKeyEntry(key="sk-b", tenant="team-b", tokens_per_minute=1000, max_concurrent_requests=2),
    ]
    assert load_api_keys(toml) == expected
    assert load_api_keys(jsonl) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            '{"key": "sk-secret-1", "tenant": "a"}\n{"key": "sk-secret-1", "tenant": "b"}\n',
            "line 2 repeats the key of line 1",
        ),
        ('{"key": "sk-secret-1", "tenant": "a", "tokens_per_minute": 0}\n', r"line 1: Expected `int` >= 1"),
        ('{"key": "sk-secret-1", "tenant": "a", "rpm": 5}\n', "line 1: Object contains unknown field `rpm`"),
        ('{"key": "sk-secret-1", "tenant": "has space"}\n', "line 1: Expected `str` matching"),
        ('{"key": "sk-secret-1"}\n', "line 1: Object missing required field `tenant`"),
        ("sk-secret-1\n", "line 1 is not a JSON object"),
        ("\n", "holds no keys"),
    ],
)
def test_a_bad_keys_file_names_the_entry_and_never_the_key(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "keys.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as raised:
        load_api_keys(path)
    assert "sk-secret" not in str(raised.value)


def test_a_bad_toml_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\nkey = "sk-secret-1"\n')
    with pytest.raises(ConfigError, match=r"Object missing required field `tenant` - at `\$.keys\[0\]`"):
        load_api_keys(path)
    with pytest.raises(ConfigError, match="cannot read it"):
        load_api_keys(tmp_path / "missing.toml")


def test_an_entry_never_prints_its_key() -> None:
    entry = ApiKeyEntry(key="sk-secret-1", tenant="a")
    assert "sk-secret" not in repr(entry) and "sk-secret" not in str(entry)


def test_keys_authenticate_to_their_tenant() -> None:
    tenants, _ = _tenants(ApiKeyEntry(key="sk-a", tenant="a"), ApiKeyEntry(key="sk-a2", tenant="a"), api_key="single")
    assert tenants.authenticate(_bearer("sk-a")).tenant == "a"
    assert tenants.authenticate(_bearer("sk-a2")).tenant == "a"
    assert tenants.authenticate("bearer single").tenant == DEFAULT_TENANT
    for header in (None, "", "Bearer", "Bearer sk-b", "Basic sk-a", "sk-a", _bearer("sk-a") + "x"):
        with pytest.raises(ProtocolError) as raised:
            tenants.authenticate(header)
        assert (raised.value.status, raised.value.code) == (401, "invalid_api_key")
    assert tenants.names == ["a", "default"]


def test_without_keys_everyone_is_the_default_tenant() -> None:
    tenants, _ = _tenants()
    assert not tenants.requires_key
    assert tenants.authenticate(None).tenant == DEFAULT_TENANT
    assert tenants.cache_salt(DEFAULT_TENANT, None) is None  # nothing to isolate: prefix caching as before
    assert tenants.cache_salt(DEFAULT_TENANT, "s") == "s"


def test_requests_per_minute_refill_and_retry_after() -> None:
    tenants, clock = _tenants(ApiKeyEntry(key="k", tenant="a", requests_per_minute=2))
    key = tenants.authenticate(_bearer("k"))
    for _ in range(2):  # a full bucket: a burst of 2
        tenants.admit(key).release()
    with pytest.raises(RateLimited) as raised:
        tenants.admit(key)
    assert (raised.value.status, raised.value.limit, raised.value.retry_after) == (429, "requests_per_minute", 30)
    clock.now += 29.0
    with pytest.raises(RateLimited) as raised:
        tenants.admit(key)
    assert raised.value.retry_after == 1
    clock.now += 1.0  # one request back every 30 s
    tenants.admit(key).release()
    with pytest.raises(RateLimited):
        tenants.admit(key)


def test_tokens_per_minute_charges_prompt_and_output_and_may_be_overdrawn() -> None:
    tenants, clock = _tenants(ApiKeyEntry(key="k", tenant="a", tokens_per_minute=600))  # 10 per second
    key = tenants.authenticate(_bearer("k"))
    lease = tenants.admit(key)
    lease.charge_tokens(500)  # the prompt
    second = tenants.admit(key)  # 100 left: admitted
    for _ in range(20):
        lease.charge_tokens(10)  # generated tokens of the first, as they arrive: 700 in all, 100 overdrawn
    lease.release()
    second.release()
    with pytest.raises(RateLimited) as raised:
        tenants.admit(key)
    assert (raised.value.limit, raised.value.retry_after) == ("tokens_per_minute", 10)  # 100 tokens at 10/s
    clock.now += 9.9
    with pytest.raises(RateLimited) as raised:
        tenants.admit(key)
    assert raised.value.retry_after == 1
    clock.now += 0.6
    tenants.admit(key).release()
    assert key.tokens is not None and key.tokens.level == pytest.approx(5.0)


def test_concurrency_slots_free_on_release_once() -> None:
    tenants, _ = _tenants(ApiKeyEntry(key="k", tenant="a", max_concurrent_requests=2))
    key = tenants.authenticate(_bearer("k"))
    first, second = tenants.admit(key), tenants.admit(key)
    with pytest.raises(RateLimited) as raised:
        tenants.admit(key)
    assert (raised.value.limit, raised.value.retry_after) == ("max_concurrent_requests", 1)
    first.release()
    first.release()  # twice: still one slot
    third = tenants.admit(key)
    with pytest.raises(RateLimited):
        tenants.admit(key)
    second.release()
    third.release()
    assert key.num_in_flight == 0


def test_a_refused_request_takes_nothing() -> None:
    tenants, _ = _tenants(ApiKeyEntry(key="k", tenant="a", requests_per_minute=1, max_concurrent_requests=1))
    key = tenants.authenticate(_bearer("k"))
    lease = tenants.admit(key)
    with pytest.raises(RateLimited, match="max concurrent requests"):
        tenants.admit(key)  # refused for concurrency: its request is not taken from the minute's
    assert key.requests is not None and key.requests.level == pytest.approx(0.0)
    lease.release()
    with pytest.raises(RateLimited, match="requests per minute"):
        tenants.admit(key)
    assert key.num_in_flight == 0


def test_salts_separate_tenants_and_cache_salts_injectively() -> None:
    tenants, _ = _tenants(ApiKeyEntry(key="k", tenant="a"))
    salts = [
        tenants.cache_salt("a", None), tenants.cache_salt("b", None), tenants.cache_salt("a", "x"),
        tenants.cache_salt("b", "x"), tenants.cache_salt("a", '", "x'), tenants.cache_salt('a", "', "x"),
    ]  # fmt: skip
    assert len(set(salts)) == len(salts)
    assert salts[0] == tenants.cache_salt("a", None)  # stable, so a tenant's own prefixes still hit
    shared = Tenants([ApiKeyEntry(key="k", tenant="a")], isolate_prefix_cache=False)
    assert shared.cache_salt("a", None) is None and shared.cache_salt("b", "x") == "x"


def test_server_settings(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    path.write_text(json.dumps({"key": "k", "tenant": "a", "requests_per_minute": 3}) + "\n")
    config = load_config(overrides={"server": {"api_keys": str(path), "tenant_prefix_caching": "shared"}})
    tenants = Tenants.from_config(config.server)
    assert tenants.authenticate(_bearer("k")).tenant == "a" and not tenants.isolate_prefix_cache
    with pytest.raises(ConfigError, match="tenant_prefix_caching"):
        load_config(overrides={"server": {"tenant_prefix_caching": "open"}})
