"""The plugin's options: the ``[plugins.example-policies]`` table of a tokenmill config."""

from __future__ import annotations

import msgspec


class ExamplePoliciesOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Validated when the config loads (an unknown key is an error naming these) and handed to every class
    this plugin registers as ``options=``."""

    banned_token_ids: list[int] = msgspec.field(default_factory=list)
    """Token ids that no request may generate (``banned-words``); a request bans more with
    ``vllm_xargs = {"banned_token_ids": [...]}``."""
    prefer_lowest_index: bool = True
    """``least-in-flight``: break ties towards the engine with the lowest index (else the least waiting)."""
