"""Where the engine computes, and how (CUDA graphs for decode steps)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from tokenmill.config.base import ConfigSection, PositiveInt, describe

#: Batch sizes (running requests) of the decode steps captured as CUDA graphs, unless configured.
DEFAULT_CUDA_GRAPH_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class DeviceConfig(ConfigSection, frozen=True):
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        describe("Device to run on; 'auto' picks cuda when a GPU is visible, else cpu."),
    ] = "auto"
    num_threads: Annotated[
        PositiveInt | None,
        describe("CPU threads for torch; unset leaves torch's default (one per core)."),
    ] = None
    cuda_graphs: Annotated[
        bool,
        describe(
            "Capture decode steps (one new token per request) as CUDA graphs at start-up, one per batch size in "
            "cuda_graph_batch_sizes, and replay them. Used only on a CUDA device with an attention backend that "
            "supports capture (triton); prefill and mixed steps, and larger batches, run eagerly."
        ),
    ] = True
    cuda_graph_batch_sizes: Annotated[
        tuple[PositiveInt, ...],
        describe(
            "Batch sizes to capture decode graphs for; a step of n requests replays the smallest one >= n, "
            "padded. Sorted and deduplicated; each is capped at scheduler.max_num_seqs."
        ),
    ] = DEFAULT_CUDA_GRAPH_BATCH_SIZES

    def __post_init__(self) -> None:
        if self.cuda_graphs and not self.cuda_graph_batch_sizes:
            raise ValueError(
                "cuda_graph_batch_sizes is empty but cuda_graphs is on; list at least one batch size, "
                "or set cuda_graphs = false (--no-cuda-graphs)"
            )
        normalised = tuple(sorted(set(self.cuda_graph_batch_sizes)))
        if normalised != self.cuda_graph_batch_sizes:
            msgspec.structs.force_setattr(self, "cuda_graph_batch_sizes", normalised)
