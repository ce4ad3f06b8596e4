"""The built-in logits processors (logit_bias, min_tokens) and how a failing processor is contained."""

from __future__ import annotations

import torch

from tokenmill.sampling.logits_processor import (
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    MinTokensLogitsProcessor,
    SamplingRow,
)
from tokenmill.sampling.sampler import SamplingMetadata, TorchSampler
from tokenmill.sampling_params import InvalidRequestError, SamplingParams

VOCAB = 16
CPU = torch.device("cpu")


def _row(params: SamplingParams, output: list[int] | None = None, eos: tuple[int, ...] = (0,)) -> SamplingRow:
    return SamplingRow("r", params, [1, 2], output or [], eos)


def _metadata(params: list[SamplingParams], rows: list[SamplingRow], processors: list[LogitsProcessor]):  # type: ignore[no-untyped-def]
    return SamplingMetadata.from_requests(rows, [None] * len(params), VOCAB, CPU, logits_processors=processors)


def test_logit_bias_adds_to_the_named_tokens_of_its_rows_only() -> None:
    biased = SamplingParams(temperature=0, logit_bias={3: 100.0, 5: -100.0})
    plain = SamplingParams(temperature=0)
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0
    metadata = _metadata([biased, plain], [_row(biased), _row(plain)], [LogitBiasLogitsProcessor()])
    processed = TorchSampler().process_logits(logits, metadata)
    assert processed[0, 3] == 100.0 and processed[0, 5] == -90.0
    assert torch.equal(processed[1], logits[1])
    assert TorchSampler()(logits, metadata).token_ids.tolist() == [3, 5]


def test_logit_bias_is_validated_when_the_params_are_built() -> None:
    for bad in ({3: 101.0}, {-1: 1.0}):
        try:
            SamplingParams(logit_bias=bad)
        except InvalidRequestError as exc:
            assert "logit_bias" in str(exc)
        else:
            raise AssertionError(f"logit_bias={bad} was accepted")


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    processor = MinTokensLogitsProcessor()
    assert processor.is_active(_row(params, output=[9]))
    assert not processor.is_active(_row(params, output=[9, 9]))
    assert not processor.is_active(_row(SamplingParams(min_tokens=0)))
    logits = torch.zeros(1, VOCAB)
    logits[0, 0], logits[0, 4] = 10.0, 9.0  # EOS and the stop id are the favourites
    metadata = _metadata([params], [_row(params, output=[9])], [processor])
    token_id = int(TorchSampler()(logits, metadata).token_ids[0])
    assert token_id not in (0, 4)


class _Exploding(LogitsProcessor):
    name = "exploding"

    def is_active(self, row: SamplingRow) -> bool:
        return bool(row.params.extra_args and row.params.extra_args.get("explode"))

    def apply(self, logits: torch.Tensor, rows: list[int], states: list[SamplingRow]) -> torch.Tensor:
        logits[rows] = 0.0
        raise RuntimeError("boom")


def test_a_processor_that_raises_fails_only_its_rows() -> None:
    exploding = SamplingParams(temperature=0, extra_args={"explode": True})
    plain = SamplingParams(temperature=0)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [plain, exploding, plain]
    metadata = _metadata(params, [_row(p) for p in params], [_Exploding()])
    out = TorchSampler()(logits, metadata)
    assert set(metadata.errors) == {1}
    assert "logits processor 'exploding' failed: RuntimeError: boom" in metadata.errors[1]
    assert out.token_ids[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=-1).tolist()
