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

Everything is vectorised over the step's rows; the host reads the result once. A request whose drafts form a
tree (``tokenmill.speculative.draft_tree``) is verified on its own, walking down the tree: at each node its children are
tried in order, child ``c`` accepted with probability ``r(c)`` where ``r`` starts as the node's ``p`` and each
rejected child's token is removed from it and the rest renormalised (SpecInfer's rule for deterministic
drafts, Miao et al. 2024); when none is accepted the token is drawn from ``r``. Every step of that walk draws
from ``p`` exactly, so the tokens do too; a greedy row takes the child that is the argmax, if any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.sampling.sampler import row_argmax
from tokenmill.speculative.draft_tree import is_chain


@dataclass(frozen=True)
class Verified:
    """One request's verified tokens: the accepted drafts, then the target's own token."""

    token_ids: list[int]
    #: Of a tree of drafts, the accepted path (the indices of the accepted drafts); None for a chain.
    tree_nodes: tuple[int, ...] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1

    @property
    def nodes(self) -> tuple[int, ...]:
        """The indices of the accepted drafts: ``0 .. num_accepted - 1`` for a chain, the path for a tree. Row
        0 of the request gave its first token, row ``nodes[j] + 1`` the one after ``nodes[j]``."""
        return self.tree_nodes if self.tree_nodes is not None else tuple(range(self.num_accepted))


def rejection_sample(
    probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    is_greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
    draft_parents: Sequence[Sequence[int] | None] = (),
) -> list[Verified]:
    """Verify every request's drafts in one pass.

    :param probs: [num_rows, vocab_size] float32, the target's distributions (``Sampler.target_probs``); the
        rows of request ``i`` are ``len(draft_token_ids[i]) + 1`` consecutive rows, in request order (row 0
        follows the request's last token, row ``j + 1`` draft ``j``).
    :param draft_token_ids: per request, its drafts (possibly none: then its one row is simply sampled).
    :param draft_probs: per request, None (deterministic drafts) or [num_drafts, vocab_size] draft
        distributions.
    :param is_greedy: per request, whether it decodes greedily (its ``probs`` rows are one-hot).
    :param generators: per request, its own generator (seeded requests) or None for torch's default.
    :param draft_parents: per request, None for a chain of drafts or each draft's parent for a tree (drafts
        must then be deterministic); empty: all chains.
    :return: per request, the accepted drafts followed by one token drawn by the target.
    """
    if all(is_greedy):
        return verify_greedy(row_argmax(probs).tolist(), draft_token_ids, draft_parents)
    trees = [i for i, parents in enumerate(draft_parents) if parents is not None and not is_chain(parents)]
    if not trees:
        return _sample_chains(probs, draft_token_ids, draft_probs, is_greedy, generators)
    results: list[Verified | None] = [None] * len(draft_token_ids)
    starts = [0]
    for drafts in draft_token_ids:
        starts.append(starts[-1] + len(drafts) + 1)
    for i in trees:
        parents = draft_parents[i]
        assert parents is not None and draft_probs[i] is None, "draft trees are deterministic"
        rows = probs[starts[i] : starts[i + 1]]
        results[i] = _sample_tree(rows, draft_token_ids[i], parents, is_greedy[i], generators[i])
    is_tree = set(trees)
    chains = [i for i in range(len(draft_token_ids)) if i not in is_tree]
    if chains:
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chains]).to(probs.device)
        sampled = _sample_chains(
            probs[rows], [draft_token_ids[i] for i in chains], [draft_probs[i] for i in chains],
            [is_greedy[i] for i in chains], [generators[i] for i in chains],
        )  # fmt: skip
        for i, result in zip(chains, sampled, strict=True):
            results[i] = result
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]


def verify_greedy(
    target_token_ids: Sequence[int],
    draft_token_ids: Sequence[Sequence[int]],
    draft_parents: Sequence[Sequence[int] | None] = (),
) -> list[Verified]:
    """``rejection_sample`` for greedy requests only, from the target's greedy token at every row (laid out as
    ``probs``'s rows): each request keeps its drafts while they are the target's token (for a tree, the child
    that is), then takes the target's token. Needs no distributions: the engine passes the sampler's own greedy
    tokens, which skips building one-hot rows over the vocabulary."""
    results = []
    start = 0
    for i, drafts in enumerate(draft_token_ids):
        parents = draft_parents[i] if i < len(draft_parents) else None
        targets = target_token_ids[start : start + len(drafts) + 1]
        start += len(drafts) + 1
        if parents is None or is_chain(parents):
            kept = 0
            while kept < len(drafts) and drafts[kept] == targets[kept]:
                kept += 1
            results.append(Verified([*drafts[:kept], targets[kept]]))
            continue
        nodes: list[int] = []
        current = -1  # the root: the request's last token
        while True:
            token = targets[current + 1]
            chosen = next((node for node, parent in enumerate(parents) if parent == current and drafts[node] == token),
                          None)  # fmt: skip
            if chosen is None:
                results.append(Verified([*(drafts[node] for node in nodes), token], tuple(nodes)))
                break
            nodes.append(chosen)
            current = chosen
    return results


def _sample_tree(
    probs: torch.Tensor,
    token_ids: Sequence[int],
    parents: Sequence[int],
    is_greedy: bool,
    generator: torch.Generator | None,
) -> Verified:
    """Walk one request's draft tree (``probs`` [num_drafts + 1, vocab_size]: row 0 the root's, row j + 1 draft
    j's) down from the root, as the module docstring describes."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    device = probs.device
    tokens: list[int] = []
    nodes: list[int] = []
    current = -1
    while True:
        row = probs[current + 1]  # [vocab_size]
        kids = children.get(current, [])
        if is_greedy:
            token = int(row_argmax(row))
            chosen = next((kid for kid in kids if token_ids[kid] == token), None)
        else:
            residual = row.clone()
            chosen = None
            for kid in kids:
                mass = float(residual.sum())
                if mass <= 0:
                    break
                uniform = float(torch.rand(1, generator=generator, device=device))
                if uniform * mass < float(residual[token_ids[kid]]):
                    chosen = kid
                    break
                residual[token_ids[kid]] = 0.0
            if chosen is None:
                # Nothing left (p <= what was tried, up to rounding): draw from p.
                weights = residual if float(residual.sum()) > 0 else row
                token = int(torch.multinomial(weights, 1, generator=generator))
        if chosen is None:
            tokens.append(token)
            return Verified(tokens, tuple(nodes))
        tokens.append(token_ids[chosen])
        nodes.append(chosen)
        current = chosen


def _sample_chains(
    probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    is_greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> list[Verified]:
    """``rejection_sample`` for chains of drafts, vectorised over the rows."""
    num_rows, vocab_size = probs.shape
    device = probs.device
    counts = [len(drafts) + 1 for drafts in draft_token_ids]
    assert sum(counts) == num_rows, (counts, num_rows)
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)

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
    drawn = torch.where(greedy_rows, row_argmax(residual), row_argmax(residual / exponentials)).tolist()
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
