"""Registers the built-in transport (no zmq or torch imported here)."""

from __future__ import annotations

from tokenmill.hookspecs import Register, hookimpl


@hookimpl
def tokenmill_register_transports(register: Register) -> None:
    register("zmq", "tokenmill.transport.zmq_transport:ZmqTransport")
