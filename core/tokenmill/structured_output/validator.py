"""``ConstraintValidator``: a request's constraint checked before the request is accepted.

The API front end (and ``LLM``) holds one. It builds the configured backend on first use, only when that
backend says it ``validates`` (one that needs torch to do it, as xgrammar, leaves the check to the engine's
compile), and remembers the constraints that passed, so a schema sent again is not checked again. Imports no
torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tokenmill.plugin_manager import PluginSystem, Slot
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output.backend import StructuredOutputBackend
from tokenmill.structured_output.manager import CACHE_SIZE, backend_name, cache_key
from tokenmill.tokenizer import Tokenizer


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

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the problem when ``params`` cannot compile. May take a while the first time
        (the backend reads the vocabulary) and for a large schema: call it in a worker thread."""
        key = cache_key(params)
        with self._lock:
            if key in self._passed:
                self._passed.move_to_end(key)
                return
            cls = self.plugins.load(Slot.STRUCTURED_OUTPUTS_BACKEND, self.name)
            if not getattr(cls, "validates", False):
                return
            if self._backend is None:
                self._backend = self.plugins.instantiate(
                    Slot.STRUCTURED_OUTPUTS_BACKEND, self.name, cls, self.tokenizer, self.vocab_size
                )
            backend = self._backend
        backend.validate(params)
        with self._lock:
            self._passed[key] = None
            if len(self._passed) > CACHE_SIZE:
                self._passed.popitem(last=False)
