"""Configuration: one frozen section per subsystem, gathered in ``EngineConfig``."""

from tokenmill.config.attention import AttentionConfig
from tokenmill.config.cache import CacheConfig
from tokenmill.config.device import DeviceConfig
from tokenmill.config.engine import ConfigError, EngineConfig, load_config
from tokenmill.config.model import ModelConfig
from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.config.server import ServerConfig

__all__ = [
    "AttentionConfig",
    "CacheConfig",
    "ConfigError",
    "DeviceConfig",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "load_config",
]
