"""Configuration: one frozen section per subsystem, gathered in ``EngineConfig``."""

from tokenmill.config.attention import AttentionConfig
from tokenmill.config.cache import CacheConfig
from tokenmill.config.device import DeviceConfig
from tokenmill.config.engine import ConfigError, EngineConfig, load_config
from tokenmill.config.lora import LoRAConfig
from tokenmill.config.model import ModelConfig
from tokenmill.config.parallel import ParallelConfig
from tokenmill.config.parsers import ParsersConfig
from tokenmill.config.sampler import SamplerConfig
from tokenmill.config.scheduler import SchedulerConfig
from tokenmill.config.server import ServerConfig
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.config.structured_outputs import StructuredOutputsConfig
from tokenmill.config.transport import TransportConfig

__all__ = [
    "AttentionConfig",
    "CacheConfig",
    "ConfigError",
    "DeviceConfig",
    "EngineConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "ParsersConfig",
    "SamplerConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "TransportConfig",
    "load_config",
]
