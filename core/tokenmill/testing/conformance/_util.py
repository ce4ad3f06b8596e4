"""What every conformance check shares."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, TypeVar

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

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


def tiny_tokenizer(added_tokens: Sequence[str] = ()) -> Tokenizer:
    """The kit's tiny byte-level tokenizer (``save_tiny_tokenizer``: 512 ids, EOS ``<|im_end|>``), with
    ``added_tokens`` as its last ids (ordinary added tokens, as ``<think>`` is in Qwen3's vocabulary)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from tokenmill.testing.factories import save_tiny_tokenizer
    from tokenmill.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory(prefix="tokenmill-conformance-") as folder:
        save_tiny_tokenizer(Path(folder), 512 - len(added_tokens))
        if added_tokens:
            path = str(Path(folder) / "tokenizer.json")
            backend = HFTokenizer.from_file(path)
            backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
            backend.save(path)
        return Tokenizer.from_path(Path(folder))
