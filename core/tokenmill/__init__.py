"""tokenmill: a plugin-based LLM inference runtime.

Plugin authors import from here (or from ``tokenmill.interfaces``, which holds
every slot's interface, and ``tokenmill.testing``, the test kit). Names whose
modules need torch are imported lazily, so a process that never touches them
(the API front end) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill._lazy import lazy_getattr
from tokenmill.hookspecs import hookimpl
from tokenmill.interfaces import _EXPORTS as _INTERFACES

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from tokenmill.config import EngineConfig as EngineConfig
    from tokenmill.config import ModelConfig as ModelConfig
    from tokenmill.engine import EngineCore as EngineCore
    from tokenmill.hookspecs import Register as Register
    from tokenmill.interfaces import *  # noqa: F403
    from tokenmill.kv_cache.block_hash import block_hashes as block_hashes
    from tokenmill.llm import LLM as LLM
    from tokenmill.lora.request import LoRARequest as LoRARequest
    from tokenmill.messages import (
        EngineCoreOutput as EngineCoreOutput,
    )
    from tokenmill.messages import (
        EngineCoreRequest as EngineCoreRequest,
    )
    from tokenmill.messages import (
        TokenLogprobs as TokenLogprobs,
    )
    from tokenmill.outputs import CompletionOutput as CompletionOutput
    from tokenmill.outputs import RequestOutput as RequestOutput
    from tokenmill.plugin_manager import PluginError as PluginError
    from tokenmill.plugin_manager import Slot as Slot
    from tokenmill.request import Request as Request
    from tokenmill.sampling_params import SamplingParams as SamplingParams
    from tokenmill.sampling_params import StructuredOutputsParams as StructuredOutputsParams
    from tokenmill.scheduler import FCFSScheduler as FCFSScheduler
    from tokenmill.tokenizer import IncrementalDetokenizer as IncrementalDetokenizer
    from tokenmill.tokenizer import Tokenizer as Tokenizer
    from tokenmill.weights.format import WeightsError as WeightsError


__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY_EXPORTS: dict[str, str] = {
    **_INTERFACES,
    "CompletionOutput": "tokenmill.outputs",
    "EngineConfig": "tokenmill.config",
    "EngineCore": "tokenmill.engine",
    "EngineCoreOutput": "tokenmill.messages",
    "EngineCoreRequest": "tokenmill.messages",
    "FCFSScheduler": "tokenmill.scheduler",
    "IncrementalDetokenizer": "tokenmill.tokenizer",
    "LLM": "tokenmill.llm",
    "LoRARequest": "tokenmill.lora.request",
    "ModelConfig": "tokenmill.config",
    "PluginError": "tokenmill.plugin_manager",
    "Register": "tokenmill.hookspecs",
    "Request": "tokenmill.request",
    "RequestOutput": "tokenmill.outputs",
    "SamplingParams": "tokenmill.sampling_params",
    "Slot": "tokenmill.plugin_manager",
    "StructuredOutputsParams": "tokenmill.sampling_params",
    "TokenLogprobs": "tokenmill.messages",
    "Tokenizer": "tokenmill.tokenizer",
    "WeightsError": "tokenmill.weights.format",
    "block_hashes": "tokenmill.kv_cache.block_hash",
}

__all__ = ["__version__", "hookimpl", *sorted(_LAZY_EXPORTS)]


__getattr__ = lazy_getattr(__name__, _LAZY_EXPORTS, globals())
