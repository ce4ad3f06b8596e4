"""Verifying draft tokens: rejection sampling against the target's distributions.

A request with drafts ``d_1..d_k`` gets ``k + 1`` rows of target distributions
from one forward pass: row ``j`` is the target's distribution ``p_j`` for the
token after ``d_j`` (row 0 follows the request's last token). Draft ``d_{j+1}``
is accepted with probability ``min(1, p_j(d) / q_j(d))``, where ``q_j`` is the
speculator's draft distribution (one-hot on the draft when it gave none). The
first rejection draws the replacement from ``normalise(max(0, p_j - q_j))`` and
ends the request's step; when every draft is accepted, a bonus token is drawn
from ``p_k``. The tokens then have exactly the target's distribution (Leviathan
et al. 2023, Chen et al. 2023).

Greedy rows have a one-hot ``p`` (the argmax), so the same rule keeps drafts
while they equal the argmax and then takes the argmax: token for token what
non-speculative greedy decoding produces. They draw no random numbers.

Everything is vectorised over the step's rows; the host reads the result once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verified:
    """One request's verified tokens: the accepted drafts, then the target's own token."""

    token_ids: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def rejection_sample(
    probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    is_greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> list[Verified]:
    """Verify every request's drafts in one pass.

    :param probs: [num_rows, vocab_size] float32, the target's distributions (``Sampler.target_probs``); the
        rows of request ``i`` are ``len(draft_token_ids[i]) + 1`` consecutive rows, in request order.
    :param draft_token_ids: per request, its drafts (possibly none: then its one row is simply sampled).
    :param draft_probs: per request, None (deterministic drafts) or [num_drafts, vocab_size] draft
        distributions.
    :param is_greedy: per request, whether it decodes greedily (its ``probs`` rows are one-hot).
    :param generators: per request, its own generator (seeded requests) or None for torch's default.
    :return: per request, the accepted drafts followed by one token drawn by the target.
    """
    num_rows, vocab_size = probs.shape
    device = probs.device
    counts = [len(drafts) + 1 for drafts in draft_token_ids]
    assert sum(counts) == num_rows, (counts, num_rows)
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)

    if all(is_greedy):  # one-hot rows: keep drafts while they are the argmax, then take the argmax
        argmax = probs.argmax(dim=-1).tolist()
        results = []
        for start, drafts in zip(starts, draft_token_ids, strict=True):
            kept = 0
            while kept < len(drafts) and drafts[kept] == argmax[start + kept]:
                kept += 1
            results.append(Verified([*drafts[:kept], argmax[start + kept]]))
        return results

    # Rows that verify a draft: their index, the draft, and the draft's probability under q.
    draft_rows = [start + j for start, drafts in zip(starts, draft_token_ids, strict=True) for j in range(len(drafts))]
    flat_drafts = [token for drafts in draft_token_ids for token in drafts]
    residual = probs.clone()  # [num_rows, vocab_size]: max(0, p - q) on draft rows, p on the last row
    accept_ratio = None
    if draft_rows:
        rows = torch.tensor(draft_rows, device=device)
        tokens = torch.tensor(flat_drafts, device=device)
        p_draft = probs[rows, tokens]  # [num_draft_rows]
        q_draft = torch.ones_like(p_draft)
        residual[rows, tokens] = 0.0  # one-hot q
        cursor = 0  # into the draft rows
        for start, drafts, q in zip(starts, draft_token_ids, draft_probs, strict=True):
            cursor += len(drafts)
            if q is None or not drafts:
                continue
            q = q.to(device=device, dtype=probs.dtype)  # [num_drafts, vocab_size]
            index = torch.arange(len(drafts), device=device)
            q_draft[cursor - len(drafts) : cursor] = q[index, torch.tensor(list(drafts), device=device)]
            residual[start : start + len(drafts)] = (probs[start : start + len(drafts)] - q).clamp_min_(0.0)
        accept_ratio = p_draft / q_draft
        # p <= q everywhere (p == q up to rounding) leaves no residual: a rejection there, possible only by
        # rounding, draws from p.
        empty = residual.sum(dim=-1) <= 0
        residual = torch.where(empty[:, None], probs, residual)
    uniforms = _uniforms(draft_token_ids, is_greedy, generators, device)  # [num_draft_rows]
    exponentials = _exponentials(counts, is_greedy, generators, vocab_size, device)  # [num_rows, vocab_size]
    greedy_rows = torch.tensor([g for g, n in zip(is_greedy, counts, strict=True) for _ in range(n)], device=device)
    # Exponential race: argmax(w / E) with E ~ Exp(1) picks i with probability w_i / sum(w), unnormalised w.
    drawn = torch.where(greedy_rows, residual.argmax(dim=-1), (residual / exponentials).argmax(dim=-1)).tolist()
    accepted = (uniforms < accept_ratio).tolist() if accept_ratio is not None else []

    results = []
    cursor = 0  # into the draft rows
    for start, drafts in zip(starts, draft_token_ids, strict=True):
        kept = 0
        while kept < len(drafts) and accepted[cursor + kept]:
            kept += 1
        cursor += len(drafts)
        results.append(Verified([*drafts[:kept], drawn[start + kept]]))
    return results


def _uniforms(
    draft_token_ids: Sequence[Sequence[int]],
    is_greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
) -> torch.Tensor:
    """One U[0, 1) per draft row; greedy requests get 0 (accept exactly when p(d) > 0) and draw nothing."""
    num_draft_rows = sum(len(d) for d in draft_token_ids)
    uniforms = torch.zeros(num_draft_rows, device=device)
    unseeded: list[int] = []
    position = 0
    for drafts, greedy, generator in zip(draft_token_ids, is_greedy, generators, strict=True):
        span = range(position, position + len(drafts))
        position += len(drafts)
        if greedy or not drafts:
            continue
        if generator is None:
            unseeded.extend(span)
        else:
            uniforms[span.start : span.stop] = torch.rand(len(drafts), generator=generator, device=device)
    if unseeded:
        uniforms[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), device=device)
    return uniforms


def _exponentials(
    counts: Sequence[int],
    is_greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:
    """Exp(1) draws [num_rows, vocab_size]; greedy requests' rows get 1 and draw nothing."""
    exponentials = torch.ones(sum(counts), vocab_size, device=device)
    start = 0
    unseeded: list[int] = []
    for count, greedy, generator in zip(counts, is_greedy, generators, strict=True):
        if not greedy:
            if generator is None:
                unseeded.extend(range(start, start + count))
            else:
                exponentials[start : start + count].exponential_(generator=generator)
        start += count
    if len(unseeded) == len(exponentials):
        exponentials.exponential_()
    elif unseeded:
        rows = torch.tensor(unseeded, device=device)
        exponentials[rows] = torch.empty(len(unseeded), vocab_size, device=device).exponential_()
    # Some torch backends can return an exact 0 (pytorch/pytorch#22557); w / 0 = inf or NaN would win.
    return exponentials.clamp_min_(torch.finfo(exponentials.dtype).tiny)
