"""How the front end and the engines talk."""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, describe


class TransportConfig(ConfigSection, frozen=True):
    backend: Annotated[
        str,
        describe(
            "Transport plugin by name: the sockets and framing between the front end and engines "
            "('zmq' is built in: ipc:// on one host, tcp:// across hosts).",
            flag="--transport",
        ),
    ] = "zmq"
