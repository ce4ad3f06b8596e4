"""``ConstraintValidator``: a request's constraint checked before the request is accepted.

The API front end (and ``LLM``) holds one. It builds the configured backend once (the front end starts that as
it starts: ``prepare``), only when that backend says it ``validates`` (one that needs torch to do it, as
xgrammar, leaves the check to the engine's compile), and remembers the constraints that passed, so a schema sent
again is not checked again. Imports no torch.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from tokenmill.plugin_manager import PluginSystem, Slot
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputBackend
from tokenmill.structured_output.manager import CACHE_SIZE, backend_name, cache_key
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ConstraintValidator:
    """Checks constraints with the backend ``structured_outputs_config.backend`` selects."""

    def __init__(self, plugins: PluginSystem, configured: str, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.plugins = plugins
        self.name = backend_name(plugins, configured)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()
        self._passed: OrderedDict[tuple[str, str, bool, bool], None] = OrderedDict()

    def prepare(self, delay_s: float = 0.0) -> None:
        """Build the backend in a thread ``delay_s`` from now, if it validates. The front end calls it as it starts,
        with a delay that lets its start-up finish first: built by the first constrained request instead, it would
        take a core from the engine's running steps for a few hundred milliseconds (a thread beside a step holds
        every step thread up at its next barrier). A build that fails is tried again by the first ``validate``,
        which raises its error."""
        timer = threading.Timer(delay_s, self._prepare)
        timer.name, timer.daemon = "tokenmill-validator", True
        timer.start()

    def _prepare(self) -> None:
        try:
            self._validating_backend()
        except Exception:  # the first validate builds it again and reports why it cannot
            logger.debug("building the %s backend to validate constraints failed", self.name, exc_info=True)

    def _validating_backend(self) -> StructuredOutputBackend | None:
        """The backend, built on first call; None when it does not validate."""
        with self._lock:
            cls = self.plugins.load(Slot.STRUCTURED_OUTPUTS_BACKEND, self.name)
            if not getattr(cls, "validates", False):
                return None
            if self._backend is None:
                self._backend = self.plugins.instantiate(
                    Slot.STRUCTURED_OUTPUTS_BACKEND, self.name, cls, self.tokenizer, self.vocab_size
                )
            return self._backend

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the problem when ``params`` cannot compile. May take a while the first time
        (the backend reads the vocabulary, unless ``prepare`` has) and for a large schema: call it in a worker
        thread."""
        key = cache_key(params)
        with self._lock:
            if key in self._passed:
                self._passed.move_to_end(key)
                return
        backend = self._validating_backend()
        if backend is None:
            return
        backend.validate(params)
        with self._lock:
            self._passed[key] = None
            if len(self._passed) > CACHE_SIZE:
                self._passed.popitem(last=False)
