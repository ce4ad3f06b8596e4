"""Structured outputs: which grammar backend constrains requests that ask for a JSON schema, a regex, a choice
or a grammar (docs/structured_outputs.md).

The table is vLLM's ``--structured-outputs-config`` (the same JSON keys)::

    tokenmill serve --structured-outputs-config '{"backend": "xgrammar"}'
"""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, describe

#: The default backend setting: the first installed of ``AUTO_BACKENDS``, else any installed one.
AUTO_BACKEND = "auto"
#: What ``auto`` prefers, in order: llguidance (under vLLM's name for it), then xgrammar.
AUTO_BACKENDS = ("guidance", "xgrammar")


class StructuredOutputsConfig(ConfigSection, frozen=True):
    backend: Annotated[
        str,
        describe(
            "Structured-output backend plugin by name: 'guidance' (llguidance, also named 'llguidance') or "
            "'xgrammar' (`pip install tokenmill[xgrammar]`); 'auto' takes 'guidance' when it is installed (it is a "
            "dependency), else 'xgrammar', else any installed backend."
        ),
    ] = AUTO_BACKEND
    disable_any_whitespace: Annotated[
        bool,
        describe(
            "Generate JSON without whitespace between its tokens for every request (a request can also ask with "
            "structured_outputs.disable_any_whitespace). Small models otherwise may pad JSON with whitespace."
        ),
    ] = False
    max_number_digits: Annotated[
        int,
        describe(
            "Most digits in a row in a JSON number (its integer part, fraction and exponent each), for JSON schemas, "
            "json_object and tool calls: JSON puts no bound on them, and a model may write digits until max_tokens. "
            "0 bounds nothing (llama.cpp's JSON grammars bound each part to 16)."
        ),
    ] = 32
    enable_in_reasoning: Annotated[
        bool,
        describe(
            "With a reasoning parser (parsers.reasoning_parser): constrain the reasoning too, from the first "
            "token (vLLM's setting); by default a constraint starts after the reasoning ends (</think>)."
        ),
    ] = False
