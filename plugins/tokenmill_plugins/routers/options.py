"""The routers' options: the ``[plugins.routers]`` table of a tokenmill config."""

from __future__ import annotations

from typing import Annotated

import msgspec


class RoutersOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Validated when the config loads (an unknown key is an error naming these) and handed to each router
    as ``options=``. Loads are outstanding tokens (``EngineState.num_outstanding_tokens``)."""

    balance_abs_threshold: Annotated[int, msgspec.Meta(ge=0)] = 4096
    """``prefix_aware`` and ``lora_aware``: the load gap (most loaded engine's outstanding tokens less the least
    loaded's) past which, together with ``balance_rel_threshold``, the engines count as imbalanced and a request
    goes to the least loaded one whatever it has cached or holds (SGLang's ``--balance-abs-threshold``, there in
    requests)."""
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=1.0)] = 1.5
    """``prefix_aware`` and ``lora_aware``: the load ratio (most / least loaded) past which, together with
    ``balance_abs_threshold``, the engines count as imbalanced (SGLang's ``--balance-rel-threshold``)."""
    cache_threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    """``prefix_aware``: the smallest share of the prompt's tokens an engine must hold cached for the request
    to follow its prefix there; below it the request goes to the least loaded engine (SGLang's
    ``--cache-threshold``)."""
