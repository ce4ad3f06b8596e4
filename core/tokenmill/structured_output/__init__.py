"""Structured outputs: constrain a request's tokens to a JSON schema, a regex, a choice or a grammar.

``backend`` holds the slot's interfaces (``StructuredOutputBackend``, ``StructuredOutputGrammar``);
``manager`` compiles constraints off the engine loop, ``request`` is one request's state, and ``bitmask``
fills and applies each step's token masks (docs/structured_outputs.md).
"""

from tokenmill.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar

__all__ = ["StructuredOutputBackend", "StructuredOutputGrammar"]
