"""Where the engine computes."""

from __future__ import annotations

from typing import Annotated, Literal

from tokenmill.config.base import ConfigSection, PositiveInt, describe


class DeviceConfig(ConfigSection):
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        describe("Device to run on; 'auto' picks cuda when a GPU is visible, else cpu."),
    ] = "auto"
    num_threads: Annotated[
        PositiveInt | None,
        describe("CPU threads for torch; unset leaves torch's default (one per core)."),
    ] = None
