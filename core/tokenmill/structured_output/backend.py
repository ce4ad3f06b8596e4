"""The structured-output interfaces: a backend compiles constraints, a grammar matches one request's tokens.

A ``StructuredOutputBackend`` (slot ``structured_outputs_backend``, selected by
``structured_outputs_config.backend``) turns a request's ``StructuredOutputsParams`` into a compiled grammar,
once per distinct constraint (the core caches it by its text), in a worker thread of the engine process. Each
constrained request then gets a ``StructuredOutputGrammar`` of its own (vLLM's name): a matcher that advances
with every token the request keeps, fills that request's row of the step's token bitmask, and rolls back
drafts that speculative decoding tried and did not keep.

Bitmasks are vLLM's, llguidance's and xgrammar's layout: int32 ``[rows, ceil(vocab_size / 32)]`` on the
host, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from tokenmill.sampling_params import StructuredOutputsParams
    from tokenmill.tokenizer import Tokenizer


class StructuredOutputGrammar(ABC):
    """One request's matcher over a compiled grammar (vLLM's ``StructuredOutputGrammar``).

    Made by ``StructuredOutputBackend.grammar`` once the request's grammar is compiled. Every method runs in
    the engine process, on the engine loop, once per step at most (``fill_bitmask`` once per sampling row):
    none may block on I/O, call hooks or touch the device.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids`` (tokens the request keeps; the scheduler calls it after each step, and the
        executor for the drafts it verifies, rolled back after). False, and the matcher unusable, if the grammar
        does not allow them."""

    @abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many of ``token_ids``, from the first, the grammar allows in a row; the state is unchanged.
        The scheduler trims a request's drafts with it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row ``index`` of ``bitmask`` (int32, on the host)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and has accepted its end (EOS): nothing may follow."""


class StructuredOutputBackend(ABC):
    """Compiles constraints into grammars with a grammar library.

    Built once per process that uses it, lazily, as ``cls(tokenizer, vocab_size)`` (plus ``options=`` when
    its plugin declares options): ``tokenizer`` is the model's ``tokenmill.Tokenizer``, ``vocab_size`` the
    width of the model's logits (at least the tokenizer's; ids past the tokenizer's are never allowed). The
    API front end builds one to ``validate`` requests before they are accepted, and must not import torch
    for it; the engine builds one to compile and match. Construction may take a second (it reads the
    vocabulary) and runs in a worker thread.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Whether ``validate`` checks anything without importing torch; the API front end then builds the backend
    #: to refuse a constraint that cannot compile with a 400 before the request is accepted. Without it, the
    #: request fails in the engine, with the compile's message.
    validates: ClassVar[bool] = False

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` with a one-line message naming the problem when ``params`` can never compile.
        Called, when ``validates`` is set, in the API front end (and by ``LLM``) once per distinct constraint
        before a request is sent to an engine, in a worker thread: it must not import torch. The default checks
        nothing."""

    @abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """The compiled form of ``params``, shared by every request with the same constraint (the core caches it
        by ``kind``, ``spec`` and the flags). Called in a worker thread of the engine process, possibly several
        at once; raise ``ValueError`` naming the problem when it cannot compile."""

    @abstractmethod
    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher, at the start, over what ``compile_grammar`` returned. Called on the engine loop once
        per request (and per completion of an n > 1 request); must be cheap."""
