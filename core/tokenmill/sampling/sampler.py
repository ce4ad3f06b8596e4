"""The sampler interface, and ``TorchSampler``: each request's next token from the model's logits.

The engine calls the sampler once per step, in the engine process, with the
float32 logits of the last position of every request that needs a token (R
rows). All work is vectorised over the batch; the only per-row Python is
drawing random numbers for seeded requests from their own generators.

Order (vLLM/OpenAI semantics): raw logprobs → logits processors (``logit_bias``,
``min_tokens``, plugins) → repetition penalty → frequency and presence
penalties → greedy rows take the argmax; other rows: temperature → top-k →
top-p → min-p → exponential-race draw.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from tokenmill.device_copy import to_device
from tokenmill.sampling.logits_processor import LogitsProcessor, SamplingRow

logger = logging.getLogger(__name__)


@dataclass
class SamplingMetadata:
    """One step's sampling inputs for R rows; built by the engine each step with ``from_requests``.

    Tensors live on the logits' device. The flags after ``max_num_logprobs`` only let the
    sampler skip stages no row uses; their defaults mean "run the stage", so a hand-built
    instance is correct, just slower.
    """

    temperature: torch.Tensor  # [R] float32 (0 = greedy)
    top_k: torch.Tensor  # [R] int64, vocab_size where off
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    repetition_penalty: torch.Tensor  # [R] float32
    presence_penalty: torch.Tensor  # [R] float32
    frequency_penalty: torch.Tensor  # [R] float32
    prompt_token_ids: torch.Tensor  # [R, max_prompt_len] int64, padded with vocab_size
    output_token_ids: torch.Tensor  # [R, max_output_len] int64, padded with vocab_size
    generators: dict[int, torch.Generator]  # row -> that request's own generator (seeded rows that sample)
    max_num_logprobs: int | None  # max over rows of SamplingParams.logprobs; None when no row wants logprobs
    all_greedy: bool = False
    all_random: bool = False
    no_penalties: bool = False
    no_top_k: bool = False
    no_top_p: bool = False
    no_min_p: bool = False
    unseeded_rows: torch.Tensor | None = None  # [num_unseeded] int64: rows that sample with the sampler's generator
    #: Each active logits processor with the rows it applies to and their states.
    logits_processors: list[tuple[LogitsProcessor, list[int], list[SamplingRow]]] = field(default_factory=list)
    #: Rows whose logits processor raised this step: row -> error naming the processor. Filled by
    #: ``apply_logits_processors``; the engine fails those requests.
    errors: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.unseeded_rows is None:
            # Hand-built metadata: find on the host which rows draw randomness (one device sync).
            is_greedy = (self.temperature == 0).tolist()
            self.generators = {row: g for row, g in self.generators.items() if not is_greedy[row]}
            rows = [row for row, greedy in enumerate(is_greedy) if not greedy and row not in self.generators]
            self.unseeded_rows = torch.tensor(rows, dtype=torch.int64, device=self.temperature.device)  # [num_unseeded]

    def apply_logits_processors(self, logits: torch.Tensor) -> torch.Tensor:
        """Run each active logits processor over its rows; a processor that raises leaves the logits as they
        were and records an error for each of its rows in ``errors``. Samplers call this once per step,
        after taking raw logprobs and before penalties. Never modifies ``logits``; returns a new tensor
        when a processor ran."""
        if not self.logits_processors:
            return logits
        logits = logits.clone()
        for processor, rows, states in self.logits_processors:
            try:
                logits = processor.apply(logits, rows, states)
            except Exception as exc:  # a plugin's failure fails its requests, not the engine
                logger.exception("logits processor %r failed", processor.name)
                for row in rows:
                    self.errors[row] = f"logits processor {processor.name!r} failed: {type(exc).__name__}: {exc}"
        return logits

    @classmethod
    def from_requests(
        cls,
        rows: Sequence[SamplingRow],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        logits_processors: Sequence[LogitsProcessor] = (),
    ) -> SamplingMetadata:
        """Build one step's metadata; the engine calls it once per step, in the engine process.

        Row i is the request ``rows[i]`` (its params and token histories). ``generators[i]`` is that
        request's own generator (on ``device``) or None to draw from the sampler's. ``vocab_size`` is
        the logits' width (it is also the padding id). Token histories are copied to ``device`` only
        when some row has a penalty that reads them. Each of ``logits_processors`` applies to the rows
        for which its ``is_active`` is true.
        """
        num_reqs = len(rows)
        assert len(generators) == num_reqs
        params = [row.params for row in rows]
        active, errors = _active_processors(logits_processors, rows)
        is_greedy = [p.is_greedy for p in params]
        # Seeded greedy rows draw nothing, so their generators stay untouched.
        seeded = {row: g for row, g in enumerate(generators) if g is not None and not is_greedy[row]}
        unseeded = [row for row in range(num_reqs) if not is_greedy[row] and row not in seeded]
        top_k = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        has_repetition = any(p.repetition_penalty != 1.0 for p in params)
        no_penalties = not has_repetition and all(p.presence_penalty == p.frequency_penalty == 0 for p in params)
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        no_history: list[Sequence[int]] = [[] for _ in params]

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(values, device, torch.float32)  # [num_reqs]

        return cls(
            temperature=floats([p.temperature for p in params]),
            top_k=to_device(top_k, device),  # [num_reqs]
            top_p=floats([p.top_p for p in params]),
            min_p=floats([p.min_p for p in params]),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            presence_penalty=floats([p.presence_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            prompt_token_ids=_pad(
                [r.prompt_token_ids for r in rows] if has_repetition else no_history, vocab_size, device
            ),
            output_token_ids=_pad(
                [r.output_token_ids for r in rows] if not no_penalties else no_history, vocab_size, device
            ),
            generators=seeded,
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            no_penalties=no_penalties,
            no_top_k=all(k == vocab_size for k in top_k),
            no_top_p=all(p.top_p == 1.0 for p in params),
            no_min_p=all(p.min_p == 0.0 for p in params),
            unseeded_rows=to_device(unseeded, device),  # [num_unseeded]
            logits_processors=active,
            errors=errors,
        )


@dataclass
class SamplerOutput:
    """One step's sampled tokens, plus logprobs of the raw (unprocessed) distribution when asked."""

    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None  # [R] float32: logprob of the sampled token; None when max_num_logprobs is None
    top_token_ids: torch.Tensor | None  # [R, max_num_logprobs] int64, most likely first
    top_logprobs: torch.Tensor | None  # [R, max_num_logprobs] float32


class Sampler(ABC):
    """Turns one step's logits into one token per row.

    Built once per engine process with no arguments (plus ``options=`` when its plugin declares
    options); called once per step, in the engine process. A sampler must not modify ``logits``,
    call hooks or wait on the device (no ``.item()``/``.tolist()``); it takes raw logprobs first,
    then calls ``metadata.apply_logits_processors``, then honours every field of ``metadata``.
    ``tokenmill.testing.check_sampler`` checks a sampler against ``TorchSampler``.
    """

    #: Registered name.
    name: ClassVar[str]
    #: Whether it implements ``target_probs``, so speculative decoding can verify drafts against it; the
    #: engine runs without speculation otherwise.
    verifies_drafts: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` [R, vocab_size] float32."""

    def target_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution each row's token would be drawn from [R, vocab_size] float32 (rows sum to 1;
        one-hot on the argmax for greedy rows), after everything ``__call__`` applies. Speculative decoding
        verifies drafts against it (``tokenmill.speculative.rejection_sampler``) when ``verifies_drafts`` is
        true."""
        raise NotImplementedError(f"sampler {self.name!r} does not expose its distribution (target_probs)")


class TorchSampler(Sampler):
    """The vectorised torch sampler. ``generator`` serves rows without a seed of their own (the
    engine seed); None uses torch's default generator on the logits' device."""

    name: ClassVar[str] = "torch"
    verifies_drafts: ClassVar[bool] = True

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` [R, vocab_size] float32 (see ``Sampler``)."""
        assert logits.dim() == 2 and logits.dtype == torch.float32, (logits.shape, logits.dtype)
        # Logprobs describe the model's own distribution, so they come before any processing.
        raw_logprobs = logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None else None
        logits = self.process_logits(logits, metadata)
        greedy_token_ids = None if metadata.all_random else row_argmax(logits)  # [R]
        if greedy_token_ids is not None and metadata.all_greedy:
            token_ids = greedy_token_ids
        else:
            token_ids = self._sample(logits, metadata)
            if greedy_token_ids is not None:
                token_ids = torch.where(metadata.temperature == 0, greedy_token_ids, token_ids)
        if raw_logprobs is None or metadata.max_num_logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_token_ids=None, top_logprobs=None)
        top_logprobs, top_token_ids = raw_logprobs.topk(metadata.max_num_logprobs, dim=-1)  # [R, max_num_logprobs]
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1),  # [R]
            top_token_ids=top_token_ids,
            top_logprobs=top_logprobs,
        )

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """``logits`` after the logits processors and penalties; a new tensor if anything changed.

        Never modifies ``logits``. Greedy rows take the argmax of the result. Called by ``__call__``
        once per step; public so tests (and later, speculative verification) see the same logits
        the sampler does.
        """
        logits = metadata.apply_logits_processors(logits)
        if metadata.no_penalties:
            return logits
        num_reqs, vocab_size = logits.shape
        # One pad column (id vocab_size) absorbs the padding and is dropped.
        output_counts = torch.zeros(num_reqs, vocab_size + 1, device=logits.device)  # [R, vocab_size + 1]
        output_ids = metadata.output_token_ids
        output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=output_counts.dtype))
        output_counts = output_counts[:, :vocab_size]
        in_output = output_counts > 0
        in_prompt = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool, device=logits.device)  # [R, vocab_size + 1]
        in_prompt.scatter_(1, metadata.prompt_token_ids, True)
        seen = in_prompt[:, :vocab_size] | in_output
        penalty = metadata.repetition_penalty[:, None]
        repeated = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, repeated, logits)
        logits = logits - metadata.frequency_penalty[:, None] * output_counts
        return logits - metadata.presence_penalty[:, None] * in_output

    def target_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """See ``Sampler.target_probs``."""
        logits = self.process_logits(logits, metadata)
        if metadata.all_greedy:
            return torch.zeros_like(logits).scatter_(-1, row_argmax(logits)[:, None], 1.0)
        probs = self._probs(logits, metadata)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # min-p leaves the kept mass below 1
        if not metadata.all_random:
            one_hot = torch.zeros_like(probs).scatter_(-1, row_argmax(logits)[:, None], 1.0)
            probs = torch.where((metadata.temperature == 0)[:, None], one_hot, probs)
        return probs

    def _probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p: each row's sampling weights [R, vocab_size], not renormalised
        after min-p. Greedy rows get their temperature-1 weights, which the callers discard."""
        temperature = torch.where(metadata.temperature == 0, 1.0, metadata.temperature)  # avoid /0 on greedy rows
        logits = logits / temperature[:, None]
        if not (metadata.no_top_k and metadata.no_top_p):
            logits = _apply_top_k_top_p(logits, metadata)
        probs = logits.softmax(dim=-1)  # [R, vocab_size]
        if not metadata.no_min_p:
            # The ratio to the top token is the same before and after top-k/top-p renormalisation.
            threshold = metadata.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            probs.masked_fill_(probs < threshold, 0.0)
        return probs

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The draw from ``_probs``; greedy rows' results are discarded."""
        probs = self._probs(logits, metadata)
        # Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i / sum(p);
        # unnormalised p is fine, and each row depends only on its own q.
        return row_argmax(probs.div_(self._exponential(probs, metadata)))

    def _exponential(self, probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Exp(1) draws shaped like ``probs``; greedy rows get 1 and consume no randomness."""
        rows = metadata.unseeded_rows
        assert rows is not None
        num_reqs, vocab_size = probs.shape
        if rows.numel() == num_reqs:  # every row sampling and unseeded: one draw in place
            q = torch.empty_like(probs).exponential_(generator=self.generator)  # [R, vocab_size]
        else:
            q = torch.ones_like(probs)  # [R, vocab_size]
            if rows.numel():
                draws = torch.empty(rows.numel(), vocab_size, device=probs.device)  # [num_unseeded, vocab_size]
                q[rows] = draws.exponential_(generator=self.generator)
        for row, generator in metadata.generators.items():
            # A seeded row draws exactly [vocab_size] from its own generator, whatever the batch.
            q[row].exponential_(generator=generator)
        # Some torch backends can return an exact 0 (pytorch/pytorch#22557); 0/0 = NaN would win argmax.
        return q.clamp_min_(torch.finfo(q.dtype).tiny)


def row_argmax(rows: torch.Tensor) -> torch.Tensor:
    """Along the last dimension of ``rows``, each row's index of its first largest value (NaN counts as largest),
    as ``rows.argmax(dim=-1)`` gives it; for the sampler, the verifier and the speculators. ``max``'s indices are
    the same, and on the CPU its kernel is vectorised where ``argmax``'s is not (docs/benchmarks.md, "Greedy picks
    with max")."""
    return rows.max(dim=-1).indices


def _apply_top_k_top_p(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set to -inf what top-k, then top-p (on the renormalised top-k distribution), drop."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [R, vocab_size]
    if not metadata.no_top_k:
        ranks = torch.arange(logits.shape[-1], device=logits.device)  # [vocab_size]
        sorted_logits.masked_fill_(ranks >= metadata.top_k[:, None], float("-inf"))
    if not metadata.no_top_p:
        sorted_probs = sorted_logits.softmax(dim=-1)
        cumulative = sorted_probs.cumsum(dim=-1)
        # A token goes when the more likely ones already reach top_p; the top token never goes.
        mass_before = torch.nn.functional.pad(cumulative[:, :-1], (1, 0))  # [R, vocab_size]
        top_p = metadata.top_p[:, None]
        # top_p == 1 is "off": rounding in the cumsum must not drop the tail.
        sorted_logits.masked_fill_((mass_before >= top_p) & (top_p < 1.0), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _active_processors(
    processors: Sequence[LogitsProcessor], rows: Sequence[SamplingRow]
) -> tuple[list[tuple[LogitsProcessor, list[int], list[SamplingRow]]], dict[int, str]]:
    """Each processor with the rows it applies to; a row whose ``is_active`` raised gets an error instead."""
    active = []
    errors: dict[int, str] = {}
    for processor in processors:
        indices = []
        for index, row in enumerate(rows):
            try:
                if processor.is_active(row):
                    indices.append(index)
            except Exception as exc:  # a plugin's failure fails its request, not the engine
                errors[index] = f"logits processor {processor.name!r} failed: {type(exc).__name__}: {exc}"
        if indices:
            active.append((processor, indices, [rows[i] for i in indices]))
    return active, errors


def _pad(token_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Rows of ``token_ids`` right-padded with ``pad_id``, on ``device``."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    padded_ids = torch.tensor(padded, dtype=torch.int64).reshape(len(token_ids), max_len)  # [R, max_len]
    return to_device(padded_ids, device)
