"""What every config section shares: strict msgspec structs with documented fields.

Each field is ``Annotated[type, Meta(description=...)]``: the description is
the field's documentation, and ``tokenmill serve --help`` and
docs/configuration.md are generated from it. ``Meta(extra={"flag": ...})``
names the CLI flag when the plain field name would be ambiguous.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class ConfigSection(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every config section: unknown keys are errors, values are immutable."""


#: Value types with constraints, usable inside ``X | None`` (msgspec puts bounds on the number, not the union).
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


def describe(text: str, *, flag: str | None = None) -> msgspec.Meta:
    """Field metadata: its documentation and, when the field name would be ambiguous, its CLI flag."""
    extra = {"flag": flag} if flag else None
    return msgspec.Meta(description=text, extra=extra)
