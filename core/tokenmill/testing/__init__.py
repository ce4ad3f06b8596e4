"""tokenmill's test kit for plugin authors (and for tokenmill's own tests).

- conformance checks, one per slot: ``check_attention_backend``, ``check_quantizer``, ``check_sampler``,
  ``check_logits_processor``, ``check_scheduler``, ``check_kv_cache_manager``, ``check_router``,
  ``check_kv_tier``, ``check_speculator``, ``check_transport``, ``check_layer_kernels``, ``check_lora_kernels``,
  ``check_structured_outputs_backend``, ``check_tool_parser``, ``check_reasoning_parser``; each raises
  ``AssertionError`` naming the case when an implementation breaks its interface's contract;
- tiny random models and engines: ``save_tiny_model``, ``make_engine``, ``run_to_completion``,
  ``make_scheduler``, ``make_requests``, ``TINY_CONFIGS``;
- a real server: ``start_server`` / ``TokenmillServer``; a plugin package installed by pip outside the tree:
  ``install_package``, ``pythonpath_env``;
- ``DictKVTier``, an in-memory reference KV tier;
- pytest fixtures (``tiny_model_dir``, ``tiny_engine``, ``tokenmill_server``, ``plugin_manager``) from
  ``tokenmill.testing.plugin``, which pytest loads by itself once tokenmill is installed.

See docs/plugins/testing.md. Every name is imported on first use: importing this package imports neither
torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill._lazy import lazy_getattr
from tokenmill.testing import factories as _factories
from tokenmill.testing.conformance import _EXPORTS as _CHECKS

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from tokenmill.testing.conformance import *  # noqa: F403
    from tokenmill.testing.factories import *  # noqa: F403
    from tokenmill.testing.kv_tier import DictKVTier  # noqa: F401
    from tokenmill.testing.packages import install_package, pythonpath_env  # noqa: F401
    from tokenmill.testing.server import TokenmillServer, free_port, start_server  # noqa: F401

_EXPORTS: dict[str, str] = {
    **_CHECKS,
    **dict.fromkeys(_factories.__all__, _factories.__name__),
    "DictKVTier": "tokenmill.testing.kv_tier",
    "TokenmillServer": "tokenmill.testing.server",
    "free_port": "tokenmill.testing.server",
    "install_package": "tokenmill.testing.packages",
    "pythonpath_env": "tokenmill.testing.packages",
    "start_server": "tokenmill.testing.server",
}

__all__ = [*sorted(_EXPORTS)]
__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
