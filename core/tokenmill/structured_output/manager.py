"""``StructuredOutputManager``: the engine's structured-output backend, its compile threads and its cache.

Built once per engine process. ``request`` is called on the engine loop for each new constrained request and
returns at once: the constraint compiles in a thread pool (the first call also builds the backend, which
reads the tokenizer's vocabulary), and the same constraint text compiles once (an LRU cache of the compiled
grammars, failures included). The request waits in the scheduler meanwhile. Imports no torch.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgspec

from tokenmill.config.structured_outputs import AUTO_BACKEND, AUTO_BACKENDS
from tokenmill.model_files import resolve_tokenizer
from tokenmill.parsers.reasoning_parser import ReasoningParser
from tokenmill.plugin_manager import PluginError, PluginSystem, Slot
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from tokenmill.structured_output.number_digits import NumberDigitCap, TokenTexts
from tokenmill.structured_output.request import GrammarFactory, StructuredOutputRequest
from tokenmill.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig

logger = logging.getLogger(__name__)

#: Compiled grammars kept for reuse.
CACHE_SIZE = 1024
#: The kinds of constraint whose output is JSON, where ``max_number_digits`` applies.
JSON_KINDS = ("json", "json_object")


def backend_name(plugins: PluginSystem, configured: str) -> str:
    """The backend ``structured_outputs_config.backend`` selects: itself, or for ``auto`` the first installed of
    ``AUTO_BACKENDS``, else the first installed by name; a ``PluginError`` when none is installed."""
    if configured != AUTO_BACKEND:
        return configured
    installed = plugins.registry.names(Slot.STRUCTURED_OUTPUTS_BACKEND)
    for name in (*AUTO_BACKENDS, *installed):
        if name in installed:
            return name
    raise PluginError(
        "structured_outputs_config.backend: no structured-output backend is installed "
        "(pip install llguidance, or tokenmill[xgrammar])"
    )


def build_backend(
    plugins: PluginSystem, configured: str, tokenizer: Tokenizer, vocab_size: int
) -> StructuredOutputBackend:
    """The configured backend over ``tokenizer``, for logits ``vocab_size`` wide."""
    name = backend_name(plugins, configured)
    backend: StructuredOutputBackend = plugins.create(Slot.STRUCTURED_OUTPUTS_BACKEND, name, tokenizer, vocab_size)
    return backend


def build_structured_outputs(config: EngineConfig, plugins: PluginSystem, vocab_size: int) -> StructuredOutputManager:
    """The engine's manager. Its backend and, with ``parsers.reasoning_parser`` (and not ``enable_in_reasoning``),
    the reasoning parser that says where a constraint starts are built in a compile thread (``prepare``: an engine
    process starts them once a front end has connected), over the model's tokenizer, read once."""
    settings = config.structured_outputs_config
    reasoning_parser = config.parsers.reasoning_parser
    lock = threading.Lock()
    tokenizers: list[Tokenizer] = []

    def tokenizer() -> Tokenizer:
        with lock:
            if not tokenizers:
                tokenizers.append(Tokenizer.from_path(resolve_tokenizer(config.model.model, config.model.tokenizer)))
            return tokenizers[0]

    def make_reasoner() -> ReasoningParser:
        assert reasoning_parser is not None
        parser: ReasoningParser = plugins.create(Slot.REASONING_PARSER, reasoning_parser, tokenizer())
        return parser

    return StructuredOutputManager(
        lambda: build_backend(plugins, settings.backend, tokenizer(), vocab_size),
        settings.disable_any_whitespace,
        max_number_digits=settings.max_number_digits,
        make_reasoner=make_reasoner if reasoning_parser is not None and not settings.enable_in_reasoning else None,
    )


def cache_key(params: StructuredOutputsParams) -> tuple[str, str, bool, bool]:
    """What a compiled grammar depends on: the kind of constraint, its text and the flags."""
    return (params.kind, params.spec, params.disable_any_whitespace, params.disable_additional_properties)


class StructuredOutputManager:
    """Compiles constraints off the engine loop and hands each request its ``StructuredOutputRequest``.

    :param make_backend: builds the backend (called once, in a compile thread: when ``prepare`` is called, else
        on the first constrained request).
    :param disable_any_whitespace: ``structured_outputs_config.disable_any_whitespace``, applied to every
        request.
    :param max_number_digits: ``structured_outputs_config.max_number_digits``: JSON constraints' matchers are
        wrapped in a ``NumberDigitCap`` (0: not).
    :param make_reasoner: builds the reasoning parser (``parsers.reasoning_parser``), once, in a compile thread;
        given, a request's grammar starts after its reasoning (docs/structured_outputs.md#reasoning).
    """

    def __init__(
        self,
        make_backend: Callable[[], StructuredOutputBackend],
        disable_any_whitespace: bool = False,
        max_workers: int | None = None,
        make_reasoner: Callable[[], ReasoningParser] | None = None,
        max_number_digits: int = 0,
    ) -> None:
        self._make_backend = make_backend
        self._make_reasoner = make_reasoner
        self._reasoner: Future[ReasoningParser] | None = None
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._prepared: Future[StructuredOutputBackend] | None = None
        self.disable_any_whitespace = disable_any_whitespace
        self.max_number_digits = max_number_digits
        self._token_texts: TokenTexts | None = None
        workers = max_workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenmill-grammar")
        self._cache: OrderedDict[tuple[str, str, bool, bool], Future[GrammarFactory]] = OrderedDict()
        #: Compiles started (cache misses) and requests served from the cache, for tests and stats.
        self.num_compiles = 0
        self.num_cache_hits = 0

    def request(self, params: StructuredOutputsParams, prompt_token_ids: Sequence[int] = ()) -> StructuredOutputRequest:
        """The state of one new constrained request; its compile starts now unless the same constraint is
        cached. Called on the engine loop; never waits. ``prompt_token_ids`` tell whether it starts reasoning."""
        if self.disable_any_whitespace and not params.disable_any_whitespace:
            params = msgspec.structs.replace(params, disable_any_whitespace=True)
        key = cache_key(params)
        future = self._cache.get(key)
        if future is None:
            self.num_compiles += 1
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self.num_cache_hits += 1
            self._cache.move_to_end(key)
        if self._make_reasoner is not None and self._reasoner is None:
            self._reasoner = self._pool.submit(self._make_reasoner)
        return StructuredOutputRequest(params, future, self._reasoner, prompt_token_ids)

    def prepare(self) -> None:
        """Start building the backend (and the reasoning parser) in a compile thread, unless that has begun. The
        engine process calls it once a front end has connected, while nothing runs: built on the first constrained
        request instead, it would take a core from the steps running then for about half a second (a thread beside
        a step holds every step thread up at its next barrier). A build that fails is tried again by the first
        constrained request, which then fails with its error."""
        if self._prepared is None:
            self._prepared = self._pool.submit(self.backend)
            if self._make_reasoner is not None and self._reasoner is None:
                self._reasoner = self._pool.submit(self._make_reasoner)

    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (in whichever thread asks first)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _compile(self, params: StructuredOutputsParams) -> GrammarFactory:
        backend = self.backend()
        compiled = backend.compile_grammar(params)
        if not self.max_number_digits or params.kind not in JSON_KINDS:
            return lambda: backend.grammar(compiled)
        tokens = self.token_texts(backend)

        def capped() -> StructuredOutputGrammar:
            return NumberDigitCap(backend.grammar(compiled), tokens, self.max_number_digits)

        return capped

    def token_texts(self, backend: StructuredOutputBackend) -> TokenTexts:
        """The vocabulary's texts for ``NumberDigitCap``, read once."""
        with self._backend_lock:
            if self._token_texts is None:
                self._token_texts = TokenTexts(backend.tokenizer, backend.vocab_size)
            return self._token_texts

    def close(self) -> None:
        """Stop the compile threads (compiles under way finish); once, when the engine stops."""
        self._pool.shutdown(wait=False, cancel_futures=True)
