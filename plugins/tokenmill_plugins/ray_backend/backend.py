"""``server.backend = 'ray'``: the engine backend the front end builds; Ray is imported when it connects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.config import ConfigError
from tokenmill.engine_backend import EngineBackend

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine_client import EngineClient
    from tokenmill.transport.base import Transport
    from tokenmill_plugins.ray_backend.replicas import RayCluster


class RayEngineBackend(EngineBackend):
    """``server.data_parallel_size`` engine replicas as Ray actors, one per bundle of a placement group, on the
    cluster ``server.ray_address`` (else ``RAY_ADDRESS``, else one this server starts on its host and stops);
    ``tokenmill_plugins.ray_backend.replicas`` does the work. Without Ray installed, ``connect`` fails in one
    line."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._cluster: RayCluster | None = None

    def connect(self) -> None:
        try:
            from tokenmill_plugins.ray_backend.replicas import RayCluster
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise ConfigError(
                "server.backend 'ray' (--backend ray) needs Ray, which is not installed: pip install 'tokenmill[ray]'"
            ) from None
        self._cluster = RayCluster.connect(self.config)

    def start_engines(self, transport: Transport) -> list[EngineClient]:
        if self._cluster is None:
            raise RuntimeError("RayEngineBackend.start_engines before connect")
        return self._cluster.start_engines(transport)

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None
