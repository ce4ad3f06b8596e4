"""Which attention backend plugin computes attention."""

from __future__ import annotations

from typing import Annotated

from tokenmill.config.base import ConfigSection, describe


class AttentionConfig(ConfigSection, frozen=True):
    backend: Annotated[
        str,
        describe(
            "Attention backend plugin by name ('torch' is the built-in reference; 'auto' picks the "
            "fastest installed one that runs on the device); `tokenmill plugins` lists them.",
            flag="--attention-backend",
        ),
    ] = "auto"
