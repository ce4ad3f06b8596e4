"""How the front end and the engines talk, and how a tcp:// engine knows its front end."""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, describe
from tokenmill.config.cache import parse_memory


class TransportConfig(ConfigSection, frozen=True):
    backend: Annotated[
        str,
        describe(
            "Transport plugin by name: the sockets and framing between the front end and engines "
            "('zmq' is built in: ipc:// on one host, tcp:// across hosts).",
            flag="--transport",
        ),
    ] = "zmq"
    curve_secret_key_file: Annotated[
        str | None,
        describe(
            "This process's ZeroMQ CURVE certificate: a '.key_secret' file as `zmq.auth.create_certificates` "
            "writes it (it holds the public and the secret key). With it, every tcp:// connection between the "
            "front end and the engines is authenticated and encrypted; ipc:// ones are left as they are (the "
            "socket file's permissions guard them). An engine also needs curve_public_keys_dir, a front end "
            "curve_engine_public_key_file (docs/serving.md#authenticated-engines).",
        ),
    ] = None
    curve_public_keys_dir: Annotated[
        str | None,
        describe(
            "On an engine (`tokenmill engine`) with curve_secret_key_file: the directory of the public "
            "certificates ('*.key') of the front ends allowed to connect; a peer with any other key, or "
            "without CURVE, is refused and counted.",
        ),
    ] = None
    curve_engine_public_key_file: Annotated[
        str | None,
        describe(
            "On the front end (`tokenmill serve --engine tcp://...`) with curve_secret_key_file: the engines' "
            "public certificate (a '.key' file); the front end talks only to engines holding its secret key.",
        ),
    ] = None
    max_message_size: Annotated[
        str,
        describe(
            "Largest message an engine reads from a front end, as a size ('64MiB'). A larger one is dropped "
            "and counted (tokenmill:engine_dropped_messages_total); ZeroMQ itself closes a connection that "
            "sends a frame over twice this size before buffering it.",
        ),
    ] = "64MiB"

    def __post_init__(self) -> None:
        try:
            size, _ = parse_memory(self.max_message_size)
        except ValueError as exc:
            raise ValueError(f"transport.max_message_size: {exc}") from None
        if size is None or size < 1024:
            raise ValueError(
                f"transport.max_message_size must be a size of at least 1KiB such as '64MiB', "
                f"got {self.max_message_size!r}"
            )

    @property
    def max_message_bytes(self) -> int:
        size, _ = parse_memory(self.max_message_size)
        assert size is not None  # checked in __post_init__
        return size
