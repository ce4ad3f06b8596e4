"""One conformance check per slot: ``check_<slot>(implementation)`` raises ``AssertionError`` naming the
case and what to change when an implementation breaks its interface's contract.

First-party implementations pass the same checks (``tests/testing/test_conformance.py``). Each check is
imported on first use, so checking a router does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill._lazy import lazy_getattr

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from tokenmill.testing.conformance._util import ConformanceError  # noqa: F401
    from tokenmill.testing.conformance.attention import ATTENTION_TOLERANCES, check_attention_backend  # noqa: F401
    from tokenmill.testing.conformance.fused_experts import check_fused_experts  # noqa: F401
    from tokenmill.testing.conformance.kv_cache import check_kv_cache_manager, check_kv_tier  # noqa: F401
    from tokenmill.testing.conformance.layer_kernels import (  # noqa: F401
        LAYER_KERNEL_TOLERANCES,
        check_layer_kernels,
    )
    from tokenmill.testing.conformance.lora_kernels import LORA_KERNEL_TOLERANCES, check_lora_kernels  # noqa: F401
    from tokenmill.testing.conformance.parsers import check_reasoning_parser, check_tool_parser  # noqa: F401
    from tokenmill.testing.conformance.quantizer import check_quantizer  # noqa: F401
    from tokenmill.testing.conformance.sampling import check_logits_processor, check_sampler  # noqa: F401
    from tokenmill.testing.conformance.scheduler import check_scheduler  # noqa: F401
    from tokenmill.testing.conformance.serving import check_router, check_transport  # noqa: F401
    from tokenmill.testing.conformance.speculator import check_speculator  # noqa: F401
    from tokenmill.testing.conformance.structured_outputs import check_structured_outputs_backend  # noqa: F401

_EXPORTS: dict[str, str] = {
    "ATTENTION_TOLERANCES": "tokenmill.testing.conformance.attention",
    "ConformanceError": "tokenmill.testing.conformance._util",
    "check_attention_backend": "tokenmill.testing.conformance.attention",
    "check_fused_experts": "tokenmill.testing.conformance.fused_experts",
    "check_kv_cache_manager": "tokenmill.testing.conformance.kv_cache",
    "check_kv_tier": "tokenmill.testing.conformance.kv_cache",
    "check_layer_kernels": "tokenmill.testing.conformance.layer_kernels",
    "LAYER_KERNEL_TOLERANCES": "tokenmill.testing.conformance.layer_kernels",
    "check_logits_processor": "tokenmill.testing.conformance.sampling",
    "check_lora_kernels": "tokenmill.testing.conformance.lora_kernels",
    "LORA_KERNEL_TOLERANCES": "tokenmill.testing.conformance.lora_kernels",
    "check_quantizer": "tokenmill.testing.conformance.quantizer",
    "check_reasoning_parser": "tokenmill.testing.conformance.parsers",
    "check_router": "tokenmill.testing.conformance.serving",
    "check_sampler": "tokenmill.testing.conformance.sampling",
    "check_scheduler": "tokenmill.testing.conformance.scheduler",
    "check_speculator": "tokenmill.testing.conformance.speculator",
    "check_structured_outputs_backend": "tokenmill.testing.conformance.structured_outputs",
    "check_tool_parser": "tokenmill.testing.conformance.parsers",
    "check_transport": "tokenmill.testing.conformance.serving",
}

__all__ = [*sorted(_EXPORTS)]

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
