"""``StructuredOutputRequest``: one request's constraint, from its compile in a worker thread to its matcher.

The engine attaches one to every request whose ``SamplingParams.structured_outputs`` is set. The scheduler
keeps such a request waiting until ``is_ready`` (vLLM's WAITING_FOR_FSM: other requests keep being served),
advances its matcher with every token the request keeps and trims its drafts to those the grammar allows;
the executor fills its rows of each step's token bitmask. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputGrammar

#: What a compile resolves to: a maker of fresh matchers over the compiled grammar.
GrammarFactory = Callable[[], StructuredOutputGrammar]


class StructuredOutputRequest:
    """A request's constraint: ready once its grammar compiled (or failed to)."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future[GrammarFactory]) -> None:
        self.params = params
        self._compiled = compiled
        #: The request's matcher, once the compile finished.
        self.grammar: StructuredOutputGrammar | None = None
        #: Why the constraint cannot be used (it failed to compile, or a token broke it); the request fails.
        self.error: str | None = None

    def is_ready(self) -> bool:
        """Whether the compile has finished (successfully or not); never waits. Called by the scheduler for a
        waiting request each step until it is."""
        if self.grammar is not None or self.error is not None:
            return True
        if not self._compiled.done():
            return False
        exc = self._compiled.exception()
        if exc is not None:
            self.error = f"structured_outputs: {exc}"
        else:
            self.grammar = self._compiled.result()()
        return True

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance the matcher over tokens the request keeps; False (and ``error`` set) when the grammar does not
        allow them, which only a backend whose masks are wrong lets happen."""
        assert self.grammar is not None, "the request runs only once its grammar is ready"
        if self.grammar.accept_tokens(token_ids):
            return True
        self.error = f"structured_outputs: the grammar does not allow the sampled token(s) {token_ids}"
        return False

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and took its end: the request stops."""
        return self.grammar is not None and self.grammar.is_terminated()

    def fork(self) -> StructuredOutputRequest:
        """The state for another completion of the same request (n > 1), at the start of the grammar; called
        when the completions fork, before any of them has a token."""
        child = StructuredOutputRequest(self.params, self._compiled)
        child.is_ready()
        return child
