"""CUDA graphs for decode steps (``tokenmill.cuda_graphs``).

Without a GPU this checks everything but the capture itself: which batch sizes
are captured, how a step is padded to one, the static buffers, the config and
its flags, and that a padded forward over the static buffers (what a graph
records) gives the eager forward's logits, with the built-in ``torch`` backend
and with ``triton`` under the Triton interpreter. The capture-and-replay test
is marked ``gpu``.

``TRITON_INTERPRET=1`` is set when this module is imported on a machine
without CUDA, before anything imports the Triton kernels (as in
``tests/plugins/test_attention_plugins.py``).
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import ClassVar

import click
import numpy
import pytest
import torch
from click.testing import CliRunner
from tokenmill_plugins.fused_experts.triton_experts import TritonFusedExperts
from tokenmill_plugins.quant.weight_only import Int8Quantizer

from tests.factories import make_engine, run_to_completion, save_hf_model, save_tiny_model
from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from tokenmill.config import ConfigError, EngineConfig, load_config
from tokenmill.config.device import DEFAULT_CUDA_GRAPH_BATCH_SIZES
from tokenmill.config.options import config_options
from tokenmill.cuda_graphs import (
    CudaGraphRunner,
    DecodeGraphBuffers,
    bucket_for,
    capture_batch_sizes,
    cuda_graph_batch_sizes,
)
from tokenmill.engine import now
from tokenmill.layers.fused_experts import install_fused_experts
from tokenmill.messages import EngineCoreRequest
from tokenmill.model_loader import load_model
from tokenmill.model_runner import ModelRunner, SequenceChunk
from tokenmill.sampling_params import SamplingParams
from tokenmill.step_batch import pad_decode_batch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, at their import

CUDA = torch.device("cuda")  # a device object needs no GPU; nothing is allocated on it without one


class _GraphSafeBackend(AttentionBackend):
    name: ClassVar[str] = "graph-safe"
    supports_cuda_graphs: ClassVar[bool] = True

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        raise NotImplementedError


class _EagerOnlyBackend(_GraphSafeBackend):
    name: ClassVar[str] = "eager-only"
    supports_cuda_graphs: ClassVar[bool] = False


# ---------------------------------------------------------------- which batch sizes


def test_capture_batch_sizes_are_sorted_deduplicated_and_capped() -> None:
    assert capture_batch_sizes((8, 1, 2, 2, 4), max_num_seqs=256) == (1, 2, 4, 8)
    assert capture_batch_sizes((8, 1, 2, 16, 4), max_num_seqs=6) == (1, 2, 4, 6)  # 8 and 16 become 6
    assert capture_batch_sizes((8, 16), max_num_seqs=3) == (3,)
    assert capture_batch_sizes(DEFAULT_CUDA_GRAPH_BATCH_SIZES, max_num_seqs=256) == DEFAULT_CUDA_GRAPH_BATCH_SIZES
    assert capture_batch_sizes(DEFAULT_CUDA_GRAPH_BATCH_SIZES, max_num_seqs=100)[-3:] == (64, 96, 100)
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes must be positive, got 0"):
        capture_batch_sizes((4, 0), max_num_seqs=8)


def test_graphs_only_on_cuda_with_a_backend_that_supports_them(caplog: pytest.LogCaptureFixture) -> None:
    sizes = (1, 2, 4, 8, 16)
    dense = torch.nn.Linear(2, 2)
    assert cuda_graph_batch_sizes(True, sizes, 12, CUDA, _GraphSafeBackend(), dense) == (1, 2, 4, 8, 12)
    assert cuda_graph_batch_sizes(False, sizes, 12, CUDA, _GraphSafeBackend(), dense) == ()  # --no-cuda-graphs
    assert cuda_graph_batch_sizes(True, sizes, 12, torch.device("cpu"), _GraphSafeBackend(), dense) == ()
    with caplog.at_level(logging.INFO, logger="tokenmill.cuda_graphs"):
        assert cuda_graph_batch_sizes(True, sizes, 12, CUDA, _EagerOnlyBackend(), dense) == ()
    assert "'eager-only' does not support capture" in caplog.text


@pytest.mark.parametrize(
    ("fused_experts", "quantization", "captured"),
    [("triton", "none", True), ("torch", "none", False), ("triton", "int8", False)],
)
def test_mixture_of_experts_is_captured_only_with_experts_that_stay_on_the_device(
    fused_experts: str, quantization: str, captured: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ``torch`` fused experts read each step's routing on the host, which a capture forbids (and the
    ``triton`` ones hand quantized experts to them): such a model runs eagerly, saying why, rather than failing
    at start-up."""
    if quantization == "int8" and not Int8Quantizer.is_available():
        pytest.skip("the int8 kernels need AVX2, FMA and a compiler")
    save_tiny_model(tmp_path, "qwen3-moe-tiny")
    loaded = load_model(load_config(overrides={"model": {"model": str(tmp_path), "quantization": quantization}}))
    if fused_experts == "triton":  # built directly: auto picks it on CUDA only
        install_fused_experts(loaded.model, TritonFusedExperts())
    with caplog.at_level(logging.INFO, logger="tokenmill.cuda_graphs"):
        sizes = cuda_graph_batch_sizes(True, (1, 2, 4), 8, CUDA, _GraphSafeBackend(), loaded.model)
    assert sizes == ((1, 2, 4) if captured else ())
    assert ("read each step's routing on the host" in caplog.text) == (not captured)


def test_which_backends_declare_graph_support() -> None:
    from tokenmill_plugins.attention.triton_backend import TritonAttentionBackend

    from tokenmill.attention.torch_backend import TorchAttentionBackend

    assert AttentionBackend.supports_cuda_graphs is False
    assert TorchAttentionBackend.supports_cuda_graphs is False  # repeat_interleave and masks sized on the host
    assert TritonAttentionBackend.supports_cuda_graphs is True


def test_bucket_for_picks_the_smallest_that_fits() -> None:
    sizes = (1, 2, 4, 8)
    assert [bucket_for(n, sizes) for n in range(10)] == [None, 1, 2, 4, 4, 8, 8, 8, 8, None]


# ---------------------------------------------------------------- config and flags


def test_config_normalises_and_validates_batch_sizes() -> None:
    assert load_config().device.cuda_graphs is True
    assert load_config().device.cuda_graph_batch_sizes == DEFAULT_CUDA_GRAPH_BATCH_SIZES
    config = load_config(overrides={"device": {"cuda_graph_batch_sizes": [8, 1, 8, 4]}})
    assert config.device.cuda_graph_batch_sizes == (1, 4, 8)
    with pytest.raises(ConfigError, match=r"invalid setting device.cuda_graph_batch_sizes\[1\]: Expected `int` >= 1"):
        load_config(overrides={"device": {"cuda_graph_batch_sizes": [4, 0]}})
    with pytest.raises(ConfigError, match="cuda_graph_batch_sizes is empty but cuda_graphs is on"):
        load_config(overrides={"device": {"cuda_graph_batch_sizes": []}})
    off = load_config(overrides={"device": {"cuda_graphs": False, "cuda_graph_batch_sizes": []}})
    assert (off.device.cuda_graphs, off.device.cuda_graph_batch_sizes) == (False, ())


def test_toml_round_trip_keeps_the_batch_sizes(tmp_path: Path) -> None:
    config = load_config(overrides={"device": {"cuda_graph_batch_sizes": [3, 1]}})
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml())
    assert "cuda_graph_batch_sizes = [1, 3]" in path.read_text()
    assert load_config(path) == config


def test_flags_set_the_batch_sizes_as_integers() -> None:
    seen: list[EngineConfig] = []

    @click.command()
    @config_options
    def command(config: EngineConfig) -> None:
        seen.append(config)

    flags = ["--cuda-graph-batch-sizes", "4", "--cuda-graph-batch-sizes", "2", "--no-cuda-graphs"]
    result = CliRunner().invoke(command, flags)
    assert result.exit_code == 0, result.output
    assert (seen[0].device.cuda_graphs, seen[0].device.cuda_graph_batch_sizes) == (False, (2, 4))
    result = CliRunner().invoke(command, ["--cuda-graph-batch-sizes", "two"])
    assert result.exit_code != 0 and "not a valid integer" in result.output


# ---------------------------------------------------------------- padding a step


def test_pad_decode_batch_fills_padding_rows_with_the_scratch_block() -> None:
    chunks = [SequenceChunk([11], 5, [3, 0]), SequenceChunk([12], 0, [7]), SequenceChunk([13], 8, [1, 2, 6])]
    padded = pad_decode_batch(chunks, batch_size=4, block_size=4, scratch_block=9)
    assert (padded.num_reqs, padded.batch_size, padded.max_seq_len) == (3, 4, 9)
    assert padded.token_data.dtype == numpy.int64 and padded.seq_lens.dtype == numpy.int32
    assert padded.token_data[0].tolist() == [11, 12, 13, 0]  # input ids
    assert padded.token_data[1].tolist() == [5, 0, 8, 0]  # positions
    # slot = block_tables[req, pos // 4] * 4 + pos % 4; the padding row writes the scratch block's first slot
    assert padded.token_data[2].tolist() == [0 * 4 + 1, 7 * 4 + 0, 6 * 4 + 0, 9 * 4]
    assert padded.seq_lens.tolist() == [6, 1, 9, 1]
    assert padded.block_tables.tolist() == [[3, 0, 0], [7, 0, 0], [1, 2, 6], [9, 0, 0]]


def test_pad_decode_batch_checks_block_tables() -> None:
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold 5 tokens"):
        pad_decode_batch([SequenceChunk([1], 4, [0])], batch_size=2, block_size=4, scratch_block=9)
    full = pad_decode_batch([SequenceChunk([1], 0, [5])], batch_size=1, block_size=4, scratch_block=9)
    assert full.block_tables.tolist() == [[5]] and full.token_data[:, 0].tolist() == [1, 0, 20]


def test_buffers_keep_their_addresses_and_start_as_padding() -> None:
    buffers = DecodeGraphBuffers(max_batch_size=4, max_blocks_per_seq=5, scratch_block=9, block_size=4, device="cpu")
    before = buffers.metadata(4, max_seq_len=20)
    assert before.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert before.seq_lens.tolist() == [1, 1, 1, 1] and before.slot_mapping.tolist() == [36] * 4
    assert before.block_tables[:, 0].tolist() == [9] * 4
    pointers = [t.data_ptr() for t in (before.positions, before.seq_lens, before.block_tables, before.slot_mapping)]

    long, short = SequenceChunk([12], 8, [1, 2, 6]), SequenceChunk([11], 5, [3, 0])
    buffers.load(pad_decode_batch([long, short], 2, block_size=4, scratch_block=9))
    buffers.load(pad_decode_batch([short], 1, block_size=4, scratch_block=9))
    one = buffers.metadata(1, max_seq_len=20)
    assert (one.max_query_len, one.max_seq_len, one.num_reqs, one.num_tokens) == (1, 20, 1, 1)
    assert buffers.input_ids(1).tolist() == [11] and one.positions.tolist() == [5] and one.seq_lens.tolist() == [6]
    assert one.slot_mapping.tolist() == [0 * 4 + 1] and one.query_start_loc.tolist() == [0, 1]
    # Row 0 was rewritten over two columns: its third is the long request's block, stale but a valid
    # block id that nothing reads (seq_lens 6 ends in the second block).
    assert one.block_tables.tolist() == [[3, 0, 6, 0, 0]]
    after = buffers.metadata(4, max_seq_len=20)
    assert [t.data_ptr() for t in (after.positions, after.seq_lens, after.block_tables, after.slot_mapping)] == (
        pointers
    )


# ---------------------------------------------------------------- the padded forward on CPU


def _engine_config(model_dir: Path, backend: str) -> EngineConfig:
    return load_config(
        overrides={"model": {"model": str(model_dir)}, "device": {"device": "cpu"}, "attention": {"backend": backend}}
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stand-in for a graph; the gpu test replays")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_forward_gives_the_eager_logits(backend: str, tmp_path: Path) -> None:
    """What a graph records (the model over the static buffers, padded to a bucket, max_seq_len = the context
    window) gives the eager step's logits, and writes only the step's slots and the scratch block."""
    save_hf_model("llama-tiny", tmp_path, head_dim=32)  # the Triton kernels take head_dim >= 32
    loaded = load_model(_engine_config(tmp_path, backend))
    scratch = 16
    runner = ModelRunner(loaded, num_blocks=scratch + 1, block_size=4)  # block 16: a scratch no table names
    graphs = CudaGraphRunner(
        loaded.model, loaded.attention, runner.kv_caches, 4, loaded.max_model_len, (1, 2, 4, 8), scratch
    )
    block_ids = [[3, 0], [7, 1, 12], [5]]
    prompts = [[1 + i for i in range(5)], [100 + i for i in range(9)], [300, 301]]
    runner.execute([SequenceChunk(p, 0, b) for p, b in zip(prompts, block_ids, strict=True)])

    def decode(rows: list[int]) -> list[SequenceChunk]:
        return [SequenceChunk([50 + row], len(prompts[row]), block_ids[row]) for row in rows]

    for rows, bucket in (([0, 1, 2], 4), ([2], 1), ([1, 0], 2)):  # narrower tables after wider ones: stale columns
        saved = [cache.clone() for cache in runner.kv_caches]
        eager = runner.execute(decode(rows))  # [len(rows), vocab]
        eager_caches = [cache.clone() for cache in runner.kv_caches]
        for cache, copy in zip(runner.kv_caches, saved, strict=True):
            cache.copy_(copy)
        with torch.inference_mode():
            assert graphs.load_step(decode(rows)) == bucket
            hidden = graphs.forward_padded(bucket)  # [bucket, hidden]
            logits = loaded.model.compute_logits(hidden[: len(rows)])
        torch.testing.assert_close(logits, eager, atol=2e-5, rtol=2e-5)
        for cache, expected in zip(runner.kv_caches, eager_caches, strict=True):
            torch.testing.assert_close(cache[:, :scratch], expected[:, :scratch], atol=1e-6, rtol=1e-6)
        assert all(torch.isfinite(cache[:, scratch, 0]).all() for cache in runner.kv_caches)
        for cache, copy in zip(runner.kv_caches, saved, strict=True):
            cache.copy_(copy)


def test_load_step_leaves_what_no_graph_can_run_to_the_eager_path() -> None:
    graphs = CudaGraphRunner(
        None,  # type: ignore[arg-type]  # deciding and loading a step needs no model
        _GraphSafeBackend(),
        [torch.zeros(2, 10, 4, 1, 8)],
        block_size=4,
        max_model_len=16,  # at most 4 blocks per sequence
        batch_sizes=(1, 2, 4),
        scratch_block=9,
    )
    decode = SequenceChunk([1], 3, [0])
    assert graphs.load_step([decode] * 3) == 4
    assert graphs.buffers.seq_lens.tolist() == [4, 4, 4, 1]
    assert graphs.load_step([]) is None
    assert graphs.load_step([decode] * 5) is None  # more requests than the largest graph
    assert graphs.load_step([decode, SequenceChunk([1, 2], 0, [1])]) is None  # a prefill chunk
    assert graphs.load_step([SequenceChunk([1], 3, [0, 1, 2, 3, 4])]) is None  # a table wider than the buffers
    assert graphs.load_step([SequenceChunk([1], 16, [0, 1, 2, 3, 4])]) is None  # past max_model_len
    assert (graphs.num_replays, graphs.num_graphs) == (0, 0)


def test_engine_on_cpu_captures_nothing_and_reserves_no_scratch_block(tmp_path: Path) -> None:
    save_hf_model("llama-tiny", tmp_path, head_dim=32)  # the Triton kernels take head_dim >= 32
    engine = make_engine(tmp_path)
    assert engine.config.device.cuda_graphs is True  # on by default, inert off CUDA
    assert engine.executor.runner.cuda_graphs is None
    assert engine.executor.runner.kv_caches[0].shape[1] == engine.layout.num_blocks == 256


# ---------------------------------------------------------------- capture and replay on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures and replays CUDA graphs: needs a CUDA GPU")
def test_graphs_give_the_eager_greedy_tokens(tmp_path: Path) -> None:
    """Greedy tokens with graphs equal those without, for batches on a bucket, between buckets and above the
    largest (eager until enough requests finish); requests finish at different steps, so the batch shrinks
    through the buckets."""
    save_hf_model("llama-tiny", tmp_path, head_dim=32)  # the Triton kernels take head_dim >= 32
    rng = random.Random(0)
    tokens: dict[bool, list[dict[str, list[int]]]] = {}
    batch_sizes = (1, 3, 4, 6, 11)
    for use_graphs in (False, True):
        engine = make_engine(
            tmp_path,
            device={"device": "cuda", "cuda_graphs": use_graphs, "cuda_graph_batch_sizes": [1, 2, 4, 8]},
            attention={"backend": "triton"},
            model={"dtype": "float32"},
            scheduler={"max_num_seqs": 16},
        )
        graphs = engine.executor.runner.cuda_graphs
        assert (graphs is not None) == use_graphs
        if graphs is not None:
            assert graphs.batch_sizes == (1, 2, 4, 8) and graphs.num_graphs == 4
            assert engine.executor.runner.kv_caches[0].shape[1] == engine.layout.num_blocks + 1
        runs = []
        rng.seed(0)
        for num_reqs in batch_sizes:
            requests = [
                EngineCoreRequest(
                    f"{num_reqs}-{i}",
                    [rng.randrange(512) for _ in range(rng.randrange(3, 30))],
                    SamplingParams(temperature=0, max_tokens=rng.randrange(4, 24), ignore_eos=True),
                    [],
                    now(),
                )
                for i in range(num_reqs)
            ]
            runs.append(run_to_completion(engine, requests))
        tokens[use_graphs] = runs
        if graphs is not None:
            assert graphs.num_replays > 0
    assert tokens[True] == tokens[False]
