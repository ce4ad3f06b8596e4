"""What every conformance check shares."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")


class ConformanceError(AssertionError):
    """An implementation broke its slot's contract; the message names the case and what to change."""


def fail(message: str) -> NoReturn:
    raise ConformanceError(message)


@contextmanager
def calling(what: str) -> Iterator[None]:
    """Report an exception raised inside the implementation as a contract violation naming ``what``."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as exc:
        raise ConformanceError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def conformance_check(check: Callable[P, None]) -> Callable[P, None]:
    """Mark a check: whatever the implementation raises while it runs becomes an ``AssertionError``."""

    @functools.wraps(check)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        with calling(f"{check.__name__}: the implementation"):
            check(*args, **kwargs)

    return run


def instantiate(implementation: type[T] | T, *args: Any, **kwargs: Any) -> T:
    """An instance of ``implementation``: a class is built with ``args`` as the engine would build it,
    an instance is used as it is."""
    if isinstance(implementation, type):
        return implementation(*args, **kwargs)
    return implementation
