"""The one encoder/decoder pair for everything on the wire: msgspec msgpack, never pickle."""

from __future__ import annotations

import msgspec

from tokenmill.messages import FromEngine, ToEngine, ToShard

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)
_to_shard = msgspec.msgpack.Decoder(ToShard)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(frame: bytes) -> ToEngine:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` for a malformed frame."""
    return _to_engine.decode(frame)


def decode_from_engine(frame: bytes) -> FromEngine:
    return _from_engine.decode(frame)


def decode_to_shard(frame: bytes) -> ToShard:
    """A tensor-parallel worker's message from rank 0 (``tokenmill.parallel``)."""
    return _to_shard.decode(frame)
