"""``TransportSecurity`` from the ``[transport]`` settings: CURVE certificates read once, at start-up.

Certificates are the files ``zmq.auth.create_certificates(directory, name)`` writes (the czmq format): a
``name.key_secret`` file holding a key pair and a ``name.key`` file holding its public half. A file that is
missing or holds no key is a ``ConfigError`` naming the setting.
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.config import ConfigError
from tokenmill.config.transport import TransportConfig
from tokenmill.transport.base import Transport, TransportSecurity


def _load(path: str, setting: str, *, needs_secret: bool) -> tuple[bytes, bytes | None]:
    from zmq.auth.certs import load_certificate

    try:
        public_key, secret_key = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"transport.{setting}: cannot read a CURVE certificate from {path!r}: {exc}") from None
    if needs_secret and secret_key is None:
        raise ConfigError(
            f"transport.{setting}: {path!r} holds no secret key; give the '.key_secret' file, not the '.key' one"
        )
    return public_key, secret_key


def engine_security(config: TransportConfig) -> TransportSecurity:
    """An engine's side: its key pair and the front ends' public keys it lets in."""
    if config.curve_secret_key_file is None:
        return TransportSecurity(max_message_size=config.max_message_bytes)
    public_key, secret_key = _load(config.curve_secret_key_file, "curve_secret_key_file", needs_secret=True)
    allowed: set[bytes] = set()
    if config.curve_public_keys_dir is not None:
        directory = Path(config.curve_public_keys_dir)
        if not directory.is_dir():
            raise ConfigError(f"transport.curve_public_keys_dir: {str(directory)!r} is not a directory")
        for path in sorted(directory.glob("*.key")):
            allowed.add(_load(str(path), "curve_public_keys_dir", needs_secret=False)[0])
    return TransportSecurity(public_key, secret_key, frozenset(allowed), None, config.max_message_bytes)


def frontend_security(config: TransportConfig) -> TransportSecurity:
    """The front end's side: its key pair and the engines' public key."""
    if config.curve_secret_key_file is None:
        return TransportSecurity(max_message_size=config.max_message_bytes)
    public_key, secret_key = _load(config.curve_secret_key_file, "curve_secret_key_file", needs_secret=True)
    engine_key = None
    if config.curve_engine_public_key_file is not None:
        engine_key = _load(config.curve_engine_public_key_file, "curve_engine_public_key_file", needs_secret=False)[0]
    return TransportSecurity(public_key, secret_key, frozenset(), engine_key, config.max_message_bytes)


def check_supported(transport: Transport, config: TransportConfig) -> None:
    """Refuse to start when the config asks for keys that the selected transport cannot use."""
    if config.curve_secret_key_file is not None and not transport.supports_security:
        raise ConfigError(
            f"transport.curve_secret_key_file is set, but transport {config.backend!r} cannot authenticate "
            "(supports_security is false); unset it or use the 'zmq' transport"
        )


def security_kwargs(transport: Transport, security: TransportSecurity) -> dict[str, TransportSecurity]:
    """``{"security": security}`` for a transport that takes it, else nothing (its ``bind``/``connect`` don't)."""
    return {"security": security} if transport.supports_security else {}
