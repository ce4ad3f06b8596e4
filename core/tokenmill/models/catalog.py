"""What each installed architecture is and supports, for ``tokenmill plugins`` and docs/models.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.plugin_manager import Registry

#: The registered name of the architecture that runs any transformers decoder (``model.model_impl``; vLLM's name
#: for its own fallback).
FALLBACK_ARCHITECTURE = "TransformersForCausalLM"


@dataclass(frozen=True)
class ArchitectureSupport:
    """One row of the architectures table."""

    architecture: str  # the Hugging Face ``architectures[0]`` it serves
    implementation: str  # the class that runs it
    plugin: str  # the plugin that registers it
    is_fallback: bool  # the transformers fallback (serves every architecture without a native plugin)
    supports_tensor_parallel: bool
    supports_quantization: bool  # tokenmill's quantizers (int8, int4, GGUF blocks, GPTQ, AWQ...)
    reads_gguf: bool  # the gguf weight format maps llama.cpp's architecture to it
    error: str | None = None  # why its class does not import


def architecture_table(registry: Registry) -> list[ArchitectureSupport]:
    """Every registered architecture, in registration order (built-ins first); imports each class."""
    from tokenmill.plugin_manager import PluginError, Slot
    from tokenmill.weights.gguf_architectures import HF_ARCHITECTURES as GGUF_CLASSES

    rows = []
    for registration in registry.registrations(Slot.ARCHITECTURE):
        try:
            cls = registry.load(Slot.ARCHITECTURE, registration.name)
            error = None
        except PluginError as exc:
            cls, error = None, str(exc)
        rows.append(
            ArchitectureSupport(
                architecture=registration.name,
                implementation=registration.import_path.rpartition(":")[2],
                plugin=registration.plugin,
                is_fallback=registration.name == FALLBACK_ARCHITECTURE,
                supports_tensor_parallel=bool(getattr(cls, "supports_tensor_parallel", False)),
                supports_quantization=bool(getattr(cls, "supports_quantization", False)),
                reads_gguf=registration.name in GGUF_CLASSES,
                error=error,
            )
        )
    return rows
