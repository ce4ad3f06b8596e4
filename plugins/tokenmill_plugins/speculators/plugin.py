"""Registers the built-in speculators (registration only: no torch import here)."""

from __future__ import annotations

from tokenmill import hookimpl
from tokenmill.hookspecs import Register


@hookimpl
def tokenmill_register_speculators(register: Register) -> None:
    register("ngram", "tokenmill_plugins.speculators.ngram:NgramSpeculator")
    register("draft_model", "tokenmill_plugins.speculators.draft_model:DraftModelSpeculator")
    register("medusa", "tokenmill_plugins.speculators.medusa:MedusaSpeculator")
