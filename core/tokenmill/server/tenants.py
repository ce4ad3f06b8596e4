"""Tenants: API keys from a file, each naming its tenant and its limits; who may send a request, and when.

``server.api_keys`` names a file with one entry per key: TOML (``[[keys]]`` tables) when the file ends in
``.toml``, JSON lines otherwise (one object per line; blank lines are skipped)::

    [[keys]]
    key = "sk-team-a-..."
    tenant = "team-a"
    requests_per_minute = 60
    tokens_per_minute = 100000
    max_concurrent_requests = 4
    lora_adapters = ["team-a-sql"]        # the LoRA adapters the key may use (docs/lora.md#tenants)
    default_lora_adapter = "team-a-sql"   # what a request naming the base model runs with

The key of ``server.api_key`` (if set) belongs to tenant ``default``, with no limits; so does every request
when no key is configured at all.

Limits are per key, as token buckets that refill continuously (a limit of N per minute holds N and gains N/60
each second, so a key may burst to N and then sustains N per minute):

- ``requests_per_minute``: each generation request (``/v1/completions``, ``/v1/chat/completions``) takes one
  from the bucket when it arrives, before it is validated; with none left it is refused with 429 and
  ``Retry-After`` = seconds until one is back.
- ``tokens_per_minute``: prompt plus generated tokens. A request is admitted while the bucket is above zero;
  its prompt is charged when it is sent to the engine and its generated tokens as they arrive, so a long
  request may overdraw the bucket, and the key's next request waits, ``Retry-After`` = seconds until the
  bucket is back above zero. A request in flight is never cut off.
- ``max_concurrent_requests``: requests of the key in flight (streams included, until their last event);
  ``Retry-After`` is 1 s, since when a slot frees depends on how long the running requests generate.

Keys are held only as SHA-256 digests and compared by digest, so a lookup's time says nothing about how
close a guess came, and no key is ever logged, printed or put in a metric label (metrics are by tenant).

Prefix caching: with tenants (``server.api_keys`` set), each request's prefix-cache salt is its tenant plus its
``cache_salt`` field, so one tenant never gets a prefix-cache hit on blocks another tenant computed (no
time-to-first-token side channel) unless ``server.tenant_prefix_caching`` is ``shared``; ``cache_salt``
separates caches further within a tenant, as in vLLM.

LoRA adapters (``lora.enable_lora``): a key with ``lora_adapters`` may use those adapters and no other; an adapter
that some key lists (or names as its ``default_lora_adapter``) belongs to those keys, and every other key gets the
404 of a model that does not exist for it (never the base model instead). A key without ``lora_adapters`` may use
the adapters no key lists. With ``default_lora_adapter``, a request of the key naming the base model runs with
that adapter.
"""

from __future__ import annotations

import hashlib
import math
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec

from tokenmill.config import ConfigError, ServerConfig
from tokenmill.server.protocol import ProtocolError

#: The tenant of ``server.api_key``'s key, and of every request when no key is configured.
DEFAULT_TENANT = "default"

#: What a limit's 429 says is over, by the limit's name.
LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")

_PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class ApiKeyEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One key of the ``server.api_keys`` file."""

    key: Annotated[str, msgspec.Meta(min_length=1)]
    tenant: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    requests_per_minute: _PositiveInt | None = None
    tokens_per_minute: _PositiveInt | None = None
    max_concurrent_requests: _PositiveInt | None = None
    #: The LoRA adapters (served names) the key may use; None: those no key lists.
    lora_adapters: list[str] | None = None
    #: The adapter a request of the key runs with when it names the base model (allowed even if not listed).
    default_lora_adapter: str | None = None

    def __repr__(self) -> str:  # never print the key
        return f"ApiKeyEntry(tenant={self.tenant!r}, ...)"


class _KeysFile(msgspec.Struct, forbid_unknown_fields=True):
    keys: list[ApiKeyEntry]


def load_api_keys(path: str | Path) -> list[ApiKeyEntry]:
    """The entries of a keys file (TOML when it ends in ``.toml``, else JSON lines). Raises ``ConfigError``
    naming the file, the entry and what is wrong; never the key itself."""
    path = Path(path)
    where = f"server.api_keys ({path})"
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror}") from None
    entries: list[tuple[str, ApiKeyEntry]] = []
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{where}: not valid TOML: {exc}") from None
        try:
            keys = msgspec.convert(data, _KeysFile).keys
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{where}: {_describe(exc)} (a [[keys]] table per key)") from None
        entries = [(f"[[keys]] table {number}", entry) for number, entry in enumerate(keys, 1)]
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                entries.append((f"line {number}", msgspec.json.decode(line, type=ApiKeyEntry)))
            except msgspec.ValidationError as exc:
                raise ConfigError(f"{where}: line {number}: {_describe(exc)}") from None
            except msgspec.DecodeError:
                raise ConfigError(f"{where}: line {number} is not a JSON object (one per line)") from None
    if not entries:
        raise ConfigError(f"{where}: holds no keys")
    seen: dict[str, str] = {}
    for label, entry in entries:
        if entry.key in seen:
            raise ConfigError(f"{where}: {label} repeats the key of {seen[entry.key]} (each key once)")
        seen[entry.key] = label
    return [entry for _, entry in entries]


def _describe(exc: msgspec.ValidationError) -> str:
    # msgspec names the field and the expectation ("Expected `int` >= 1 - at `$.keys[0].tokens_per_minute`"),
    # never the value, so no key leaks into the message.
    return str(exc)


class TokenBucket:
    """Holds up to ``capacity``, refilled at ``capacity / 60`` per second; may be overdrawn (``charge``)."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # per second
        self.level = self.capacity
        self.updated = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def seconds_until(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds ``amount`` (0 when it already does)."""
        self._refill(now)
        return max(0.0, (amount - self.level) / self.rate)

    def is_overdrawn(self, now: float) -> bool:
        """Whether the bucket holds nothing (or less)."""
        self._refill(now)
        return self.level <= 0

    def charge(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


class RateLimited(ProtocolError):
    """A key over one of its limits: 429 with ``Retry-After``."""

    def __init__(self, limit: str, value: int, retry_after: float) -> None:
        self.limit = limit
        seconds = max(1, math.ceil(retry_after))
        what = limit.replace("_", " ")
        super().__init__(
            429, f"Rate limit reached for this API key: {what} ({value}). Retry after {seconds} s.",
            type="rate_limit_error", code="rate_limit_exceeded", retry_after=seconds,
        )  # fmt: skip


@dataclass(eq=False)
class KeyState:
    """One key's limits and what it has used; the app holds one per key for the server's life."""

    tenant: str
    entry: ApiKeyEntry | None  # None: server.api_key's key, or no key at all (no limits)
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    num_in_flight: int = 0


@dataclass(eq=False)
class Lease:
    """One admitted request of a key: charge its tokens, release its concurrency slot (once) when it ends."""

    state: KeyState
    clock: Callable[[], float]
    is_released: bool = field(default=False)

    @property
    def tenant(self) -> str:
        return self.state.tenant

    def charge_tokens(self, count: int) -> None:
        if self.state.tokens is not None and count:
            self.state.tokens.charge(count, self.clock())

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.state.num_in_flight -= 1


class Tenants:
    """Who a request's key belongs to and whether it may run now. Used from the front end's event loop only.

    :param entries: the keys file's entries (``load_api_keys``); empty without ``server.api_keys``.
    :param api_key: ``server.api_key``, tenant ``default`` with no limits.
    :param isolate_prefix_cache: salt each tenant's prefix cache apart (``server.tenant_prefix_caching``).
    """

    def __init__(
        self,
        entries: list[ApiKeyEntry],
        api_key: str | None = None,
        isolate_prefix_cache: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.has_tenants = bool(entries)
        self.requires_key = bool(entries) or api_key is not None
        self.isolate_prefix_cache = isolate_prefix_cache and self.has_tenants
        self._open = KeyState(DEFAULT_TENANT, None)  # every request when no key is configured
        self._by_digest: dict[bytes, KeyState] = {}
        now = clock()
        if api_key is not None:
            self._by_digest[_digest(api_key)] = KeyState(DEFAULT_TENANT, None)
        for entry in entries:
            state = KeyState(entry.tenant, entry)
            if entry.requests_per_minute is not None:
                state.requests = TokenBucket(entry.requests_per_minute, now)
            if entry.tokens_per_minute is not None:
                state.tokens = TokenBucket(entry.tokens_per_minute, now)
            self._by_digest[_digest(entry.key)] = state
        #: Adapters some key lists: only those keys may use them.
        self.claimed_adapters = {
            name
            for entry in entries
            for name in [*(entry.lora_adapters or ()), *filter(None, [entry.default_lora_adapter])]
        }
        #: Every tenant name, for metrics that start at zero.
        self.names = sorted({state.tenant for state in self._by_digest.values()} | {DEFAULT_TENANT})

    @property
    def restricts_adapters(self) -> bool:
        """Whether some key lists adapters or names a default one (``ConfigError`` without ``lora.enable_lora``)."""
        return any(e.lora_adapters is not None or e.default_lora_adapter is not None for e in self._entries())

    def may_use_adapter(self, state: KeyState | None, name: str) -> bool:
        """Whether ``state``'s key may use (or load, or unload) the adapter served as ``name``: one it lists or
        names as its default, or, for a key that lists none, one no key lists."""
        entry = state.entry if state is not None else None
        if entry is not None and name == entry.default_lora_adapter:
            return True
        if entry is None or entry.lora_adapters is None:
            return name not in self.claimed_adapters
        return name in entry.lora_adapters

    def default_adapter(self, state: KeyState | None) -> str | None:
        """The adapter a request of ``state``'s key runs with when it names the base model (None: the base)."""
        return state.entry.default_lora_adapter if state is not None and state.entry is not None else None

    def _entries(self) -> list[ApiKeyEntry]:
        return [state.entry for state in self._by_digest.values() if state.entry is not None]

    @classmethod
    def from_config(cls, config: ServerConfig) -> Tenants:
        entries = load_api_keys(config.api_keys) if config.api_keys is not None else []
        return cls(entries, config.api_key, config.tenant_prefix_caching == "isolated")

    def authenticate(self, authorization: str | None) -> KeyState:
        """The key state of an ``Authorization: Bearer <key>`` header; 401 for a missing or unknown key."""
        if not self.requires_key:
            return self._open
        scheme, _, key = (authorization or "").partition(" ")
        state = self._by_digest.get(_digest(key.strip())) if scheme.lower() == "bearer" else None
        if state is None:
            raise ProtocolError(
                401, "Incorrect API key provided.", type="invalid_request_error", code="invalid_api_key"
            )
        return state

    def admit(self, state: KeyState) -> Lease:
        """Take a concurrency slot and one request of ``state``'s key, or raise ``RateLimited`` (taking
        nothing) naming the first limit it is over."""
        entry = state.entry
        if entry is None:
            state.num_in_flight += 1
            return Lease(state, self.clock)
        now = self.clock()
        if entry.max_concurrent_requests is not None and state.num_in_flight >= entry.max_concurrent_requests:
            raise RateLimited("max_concurrent_requests", entry.max_concurrent_requests, 1.0)
        if state.requests is not None and (wait := state.requests.seconds_until(1.0, now)) > 0:
            assert entry.requests_per_minute is not None
            raise RateLimited("requests_per_minute", entry.requests_per_minute, wait)
        if state.tokens is not None and state.tokens.is_overdrawn(now):
            assert entry.tokens_per_minute is not None
            raise RateLimited("tokens_per_minute", entry.tokens_per_minute, state.tokens.seconds_until(0.0, now))
        if state.requests is not None:
            state.requests.charge(1.0, now)
        state.num_in_flight += 1
        return Lease(state, self.clock)

    def cache_salt(self, tenant: str, request_salt: str | None) -> str | None:
        """The prefix-cache salt of a request: its tenant and its ``cache_salt`` (an injective encoding, so no
        two pairs share a salt), or just its ``cache_salt`` when tenants share prefix caches."""
        if not self.isolate_prefix_cache:
            return request_salt
        return msgspec.json.encode([tenant, request_salt]).decode()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
