"""Names imported on first use: a package that re-exports heavy modules (torch, transformers) stays cheap to import."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: imports ``exports[name]`` (a module) on first access to
    ``name`` and caches the value in ``namespace`` (the package's ``globals()``)."""

    def getattr_(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module_name), name)
        namespace[name] = value
        return value

    return getattr_
