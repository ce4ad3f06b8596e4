"""``StructuredOutputRequest``: one request's constraint, from its compile in a worker thread to its matcher.

The engine attaches one to every request whose ``SamplingParams.structured_outputs`` is set. The scheduler
keeps such a request waiting until ``is_ready`` (vLLM's WAITING_FOR_FSM: other requests keep being served),
advances its matcher with every token the request keeps and trims its drafts to those the grammar allows;
the executor fills its rows of each step's token bitmask. With a reasoning parser the request first reasons
freely: its matcher is held back (``grammar`` is None, nothing is masked) until the reasoning's end token, and
the grammar starts with the token after it (vLLM's behaviour). Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputGrammar

if TYPE_CHECKING:
    from tokenmill.parsers.reasoning_parser import ReasoningParser

#: What a compile resolves to: a maker of fresh matchers over the compiled grammar.
GrammarFactory = Callable[[], StructuredOutputGrammar]


class StructuredOutputRequest:
    """A request's constraint: ready once its grammar compiled (or failed to), and its reasoning parser is built
    when it has one (``reasoner``)."""

    def __init__(
        self,
        params: StructuredOutputsParams,
        compiled: Future[GrammarFactory],
        reasoner: Future[ReasoningParser] | None = None,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self.params = params
        self._compiled = compiled
        self._reasoner = reasoner
        self._prompt_token_ids = prompt_token_ids
        self._matcher: StructuredOutputGrammar | None = None
        self._reasoning: ReasoningParser | None = None  # set while the request reasons
        #: Why the constraint cannot be used (it failed to compile, or a token broke it); the request fails.
        self.error: str | None = None

    @property
    def grammar(self) -> StructuredOutputGrammar | None:
        """The matcher in force: None while the grammar compiles and while the request reasons."""
        return self._matcher if self._reasoning is None else None

    @property
    def is_reasoning(self) -> bool:
        return self._reasoning is not None

    def is_ready(self) -> bool:
        """Whether the compile has finished (successfully or not); never waits. Called by the scheduler for a
        waiting request each step until it is."""
        if self._matcher is not None or self.error is not None:
            return True
        if not self._compiled.done() or (self._reasoner is not None and not self._reasoner.done()):
            return False
        exc = self._compiled.exception() or (self._reasoner.exception() if self._reasoner is not None else None)
        if exc is not None:
            self.error = f"structured_outputs: {exc}"
            return True
        self._matcher = self._compiled.result()()
        if self._reasoner is not None:
            reasoner = self._reasoner.result()
            # Reasoning unless the prompt closed it (a chat template with thinking off).
            self._reasoning = None if reasoner.is_reasoning_end(self._prompt_token_ids) else reasoner
        return True

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance the matcher over tokens the request keeps (while it reasons, look for the reasoning's end: the
        grammar takes the tokens after it); False (and ``error`` set) when the grammar does not allow them, which
        only a backend whose masks are wrong lets happen."""
        assert self._matcher is not None, "the request runs only once its grammar is ready"
        if self._reasoning is not None:
            end = next((i for i, t in enumerate(token_ids) if self._reasoning.is_reasoning_end([t])), None)
            if end is None:
                return True
            self._reasoning = None
            token_ids = token_ids[end + 1 :]
        if not token_ids or self._matcher.accept_tokens(token_ids):
            return True
        self.error = f"structured_outputs: the grammar does not allow the sampled token(s) {token_ids}"
        return False

    def num_allowed_drafts(self, token_ids: list[int], is_tree: bool) -> int:
        """How many of a step's drafts, from the first, are worth verifying: those the grammar allows; while the
        request reasons, those before the reasoning's end (the grammar's first mask needs the token after it),
        and a tree of drafts only whole."""
        if self._reasoning is not None:
            end = next((i for i, t in enumerate(token_ids) if self._reasoning.is_reasoning_end([t])), len(token_ids))
            return end if not is_tree or end == len(token_ids) else 0
        if self._matcher is None or is_tree:
            return len(token_ids)
        return self._matcher.validate_tokens(token_ids)

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and took its end: the request stops."""
        grammar = self.grammar
        return grammar is not None and grammar.is_terminated()

    def fork(self) -> StructuredOutputRequest:
        """The state for another completion of the same request (n > 1), at the start of the grammar (reasoning,
        when the parent started so); called when the completions fork, before any of them has a token."""
        child = StructuredOutputRequest(self.params, self._compiled, self._reasoner, self._prompt_token_ids)
        child.is_ready()
        return child
