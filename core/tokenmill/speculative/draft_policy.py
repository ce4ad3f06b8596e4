"""How many drafts each request verifies: the count that maximises expected tokens per second (goodput).

Verifying drafts is not free: each drafted position is one more token in the
target's forward pass, and a draft model spends a forward per position. Whether
that pays depends on the batch (a big batch is compute-bound and every token
costs its full share), on the hardware, and on how predictable each request is.
So the engine measures instead of guessing (after SmartSpec, Liu et al. 2024):

- the target step's time by its number of tokens (``StepCostModel``: measured
  means per token count over recent steps, priced on their lower convex hull,
  since a step is flat in its tokens until the machine turns compute-bound and
  steep after), one
  model for steps that verify drafts and one for plain steps. The two cost
  differently, not along one curve: verifying has a fixed cost of its own (the
  target's distributions at every position, the acceptance walk), and on a GPU
  a plain step replays a CUDA graph while verification runs eagerly. One line
  through both would read the fixed cost as a cost per token;
- the speculator's time per draft position (one ``propose`` divided by its
  longest draft list, over calls whose requests all drafted the step before:
  a request's first call also reads its prompt into a draft model; for a tree,
  the whole call, which scores every candidate at once);
- each request's acceptance rate ``alpha``: the chance that a draft is accepted
  given the ones before it were, estimated from its own verifications
  (accepted drafts are successes, a rejection is a failure). A new request
  starts from the pooled rate of recent verifications (all requests,
  exponentially weighted) worth two of its own, so a new request need not
  relearn from an even chance what recent requests showed. While a request gets
  no drafts its rate drifts back to an even chance, so that it is tried again.

A speculator that drafts trees (``tokenmill.speculative.draft_tree``) gets, instead of a
request's rate, one measured rate per node of its tree: how often that node was on
the accepted path (exponentially weighted, from a prior of one half). Every
request verifies the same first ``k`` nodes of the tree (a prefix is a tree:
parents come first), ``k`` the one with the most expected tokens per second,
``1 + rate_0 + ... + rate_(k-1)`` tokens per request; every ``k`` is weighed,
since a poor node early in the stored order can precede better ones. Unlike a
request's rate, a node's rate does not drift back while it is not drafted:
it is the speculator's, not the text's, and drifting would keep retrying
unprofitable nodes. Instead, one step in 64 (offset from the plain one) gives
one request the whole tree, which keeps every node's rate measured and shows
the cost model large steps.

After 64 decisions in a row that drafted, with no step without drafts
measured since, one drafts nothing, so that the plain step's cost stays
measured; steps where the speculator found nothing to draft measure it too.
With ``alpha``, draft position ``j`` (0-based) adds ``alpha^(j + 1)`` tokens in
expectation. Each step the policy hands out draft positions one at a time,
always to the request whose next position is most likely to be accepted, and
keeps the first ``n`` of them with the most expected tokens per second, as for
a tree: a longer prefix must beat the best shorter one by 0.5% per position,
and the chosen one the plain step by 3%. At a large batch nothing is handed
out and the speculator is not even called; at c=1 a predictable request gets up
to ``num_speculative_tokens``.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

#: Weight of the past per observation (about the last 50 steps count).
_DECAY = 0.98
#: Per step without drafts, a request's acceptance counts keep this much of their weight (the rest goes to the
#: prior of one success and one failure).
_FORGET = 0.9
#: The drafts a step verifies must raise expected tokens per second by this fraction over a plain step: the cost
#: model is built from noisy timings, and drafting that barely pays on paper loses as often as it wins.
_MIN_GAIN = 0.03
#: A longer prefix of a tree's nodes (or of a step's chain positions) need only beat the best shorter one by this
#: much per extra node, as long as the nodes together pay ``_MIN_GAIN``: a tree's later nodes each add little (a
#: few hundredths of a token) and their rates are measured over every request's verifications, not one request's.
_MIN_GAIN_PER_DRAFT = 0.005
#: Handing out chain positions stops once the step's expected tokens per second fall this far below the best (or
#: after more positions than one request may get without a new best: at 32 requests, all their first ones).
_GIVE_UP = 0.1
#: The whole-tree exploration step happens only in batches of at most this many requests: trees pay where a
#: step holds few tokens; in a large batch exploring costs more than it teaches. Exploring a verification step's
#: cost (nothing measured lately) gives the maximum to at most this many requests too.
_MAX_EXPLORE_BATCH = 4
#: After this many decisions in a row that drafted, one drafts nothing, so the cost model keeps measuring what a
#: step costs without drafts (a policy that always drafts would only ever see steps with drafts, and guess the
#: alternative); a measurement is forgotten some 150 steps later. Steps that draft nothing anyway (nothing paid,
#: or the speculator found nothing) measure it too, so a forced plain step is rarely needed; forcing one often
#: cuts runs of accepted drafts.
_EXPLORE_EVERY = 64
#: One step in this many (offset from the plain one) gives one request a tree's every node: it costs what a step
#: of the whole tree costs more, and only keeps measuring the rates of nodes the policy does not verify.
_EXPLORE_TREE_EVERY = 64
#: Before the fit has seen different token counts: each token costs this fraction of a 1-token step.
_PRIOR_SLOPE = 0.15
#: Token counts up to this one have a cost bucket each; larger ones share eight buckets per doubling.
_EXACT_BUCKETS = 32
#: A cost bucket whose weight has decayed below this (150 steps after a single measurement) is forgotten.
_FORGOTTEN_WEIGHT = 0.05
#: A new request's acceptance rate starts as the pooled rate of recent verifications, worth this many of its own.
_PRIOR_WEIGHT = 2.0


@dataclass
class _Rate:
    """A chance estimated from (weighted) successes and failures."""

    successes: float = 1.0
    failures: float = 1.0

    @property
    def value(self) -> float:
        return self.successes / (self.successes + self.failures)

    def observe(self, successes: float, failures: float, decay: float = 1.0) -> None:
        self.successes = decay * self.successes + successes
        self.failures = decay * self.failures + failures

    def drift(self) -> None:
        """Move part of the way back to an even chance (one success, one failure)."""
        self.successes = _FORGET * self.successes + (1 - _FORGET)
        self.failures = _FORGET * self.failures + (1 - _FORGET)

    def gain(self, position: int) -> float:
        """As a request's acceptance rate: the expected tokens its draft ``position`` (0-based) adds, the chance
        that it and every draft before it are accepted."""
        return self.value ** (position + 1)


def _prior(value: float) -> _Rate:
    """A rate of ``value`` worth ``_PRIOR_WEIGHT`` observations."""
    return _Rate(_PRIOR_WEIGHT * value, _PRIOR_WEIGHT * (1 - value))


class _Line:
    """Seconds of a step as ``a + b * num_tokens``, by exponentially weighted least squares, with a prior slope."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = _DECAY
        self._w, self._x, self._y = d * self._w + 1, d * self._x + num_tokens, d * self._y + seconds
        self._xx, self._xy = d * self._xx + num_tokens**2, d * self._xy + num_tokens * seconds

    @property
    def slope(self) -> float:
        """Seconds per token; 0 before any observation."""
        if self._w == 0:
            return 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        variance = self._xx / self._w - mean_x**2
        # A prior slope (a fraction of a 1-token step) carries the fit until token counts have varied.
        prior = _PRIOR_SLOPE * mean_y / (1 + _PRIOR_SLOPE * mean_x)
        slope = (self._xy / self._w - mean_x * mean_y + prior) / (variance + 1) if variance >= 0 else prior
        return max(slope, 0.0)

    def seconds(self, num_tokens: int) -> float:
        if self._w == 0:
            return 0.0
        return max(self._y / self._w + self.slope * (num_tokens - self._x / self._w), 1e-9)


@dataclass
class _Measured:
    """A token-count bucket's exponentially weighted sums: weight, tokens and seconds."""

    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0


class StepCostModel:
    """Seconds of a target step by its number of tokens, as measured: a step is not a line in its tokens. Up to
    the point where the machine turns compute-bound, more tokens cost little (each pass reads every weight
    once); past it, each token costs its share of the compute. A line through small and large steps would
    overprice the middle (docs/speculative_decoding.md, "When it pays").

    So the model keeps an exponentially weighted mean time per bucket of token counts (each count up to
    ``_EXACT_BUCKETS``, then eight buckets per doubling) and prices a count on the lower convex hull of those means:
    flat-then-steep is convex, and the hull passes under a mean that a passing load or a cold step pushed up. A
    count measured too high once would otherwise not be chosen, so not measured again, for as long as it is
    remembered. A mean measured too low is chosen, so measured again, and corrects itself. Past the hull's ends the
    nearest segment goes on (a single point: along a least-squares line through all steps, which starts from a prior
    slope). Every bucket's weight decays with every step, whether it verified drafts or not (``age``), and a bucket
    is forgotten about 150 steps after its last measurement (more if it was measured often)."""

    def __init__(self) -> None:
        self._line = _Line()
        self._buckets: dict[int, _Measured] = {}
        self._points: list[tuple[float, float]] | None = None  # (mean tokens, mean seconds) per bucket, sorted

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._line.observe(num_tokens, seconds)
        self.age()
        measured = self._buckets.setdefault(_bucket(num_tokens), _Measured())
        measured.weight, measured.tokens, measured.seconds = (
            measured.weight + 1, measured.tokens + num_tokens, measured.seconds + seconds
        )  # fmt: skip

    def age(self) -> None:
        """One step passed (observed here or not): every bucket's weight decays, and a faded one is forgotten."""
        self._points = None
        for key, measured in list(self._buckets.items()):
            measured.weight, measured.tokens, measured.seconds = (
                _DECAY * measured.weight, _DECAY * measured.tokens, _DECAY * measured.seconds
            )  # fmt: skip
            if measured.weight < _FORGOTTEN_WEIGHT:
                del self._buckets[key]

    @property
    def measured(self) -> bool:
        """Whether a step was observed here in about the last 150 steps (``observe`` or ``age``)."""
        return bool(self._buckets)

    def seconds(self, num_tokens: int) -> float:
        """Predicted step time; 0 before any observation."""
        if self._points is None:
            self._points = _lower_hull(sorted((m.tokens / m.weight, m.seconds / m.weight)
                                              for m in self._buckets.values()))  # fmt: skip
        points = self._points
        if not points:
            return self._line.seconds(num_tokens)
        if len(points) == 1:
            (x, y), slope = points[0], self._line.slope
        else:  # the hull's segment over num_tokens, or the nearest end segment
            above = min(max(bisect.bisect_left(points, (num_tokens, -1.0)), 1), len(points) - 1)
            (x, y), (x1, y1) = points[above - 1], points[above]
            slope = (y1 - y) / (x1 - x)
        return max(y + slope * (num_tokens - x), 1e-9)


def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of ``points`` sorted by x (Andrew's monotone chain), left to right."""
    hull: list[tuple[float, float]] = []
    for x, y in points:
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (y - y0) - (y1 - y0) * (x - x0) > 0:  # a left turn: hull[-1] stays below
                break
            hull.pop()
        if hull and hull[-1][0] == x:  # the same x (buckets' means can coincide): keep the lower
            if y >= hull[-1][1]:
                continue
            hull.pop()
        hull.append((x, y))
    return hull


def _bucket(num_tokens: int) -> int:
    """The bucket of a token count: the count itself up to ``_EXACT_BUCKETS``, then eighths of a doubling."""
    if num_tokens <= _EXACT_BUCKETS:
        return num_tokens
    octave = num_tokens.bit_length() - 1
    return (octave << 3) + ((num_tokens << 3 >> octave) & 7) + (1 << 16)  # apart from the exact keys


class DraftPolicy:
    """Decides each step how many drafts each request may verify; see the module docstring."""

    def __init__(self, num_speculative_tokens: int, separate_plain_steps: bool = True) -> None:
        """``separate_plain_steps``: steps without drafts get a cost line of their own (see the module
        docstring); False fits one line through every step."""
        self.max_drafts = num_speculative_tokens
        self.step_cost = StepCostModel()  # steps with drafts (every step without ``separate_plain_steps``)
        self.plain_step_cost = StepCostModel() if separate_plain_steps else None
        self.seconds_per_draft_position = 0.0  # the speculator's, measured
        self._acceptance: dict[str, _Rate] = {}
        #: Every request's verifications together, exponentially weighted: where a new request's rate starts.
        self._pooled = _Rate()
        #: For a speculator drafting trees: per node, how often it was accepted (all requests together).
        self._node_rates: list[_Rate] = []
        self._num_decisions = 0
        self._drafting_streak = 0  # decisions in a row that drafted, with no step without drafts since

    def observe_step(self, num_tokens: int, seconds: float, drafted: bool = True) -> None:
        """One target step of ``num_tokens`` tokens took ``seconds``; ``drafted``: it verified drafts."""
        if not drafted:
            self._drafting_streak = 0
        if self.plain_step_cost is not None and not drafted:
            self.plain_step_cost.observe(num_tokens, seconds)
            self.step_cost.age()  # so a verification cost not measured for long is measured again
        else:
            self.step_cost.observe(num_tokens, seconds)
            if self.plain_step_cost is not None:
                self.plain_step_cost.age()

    def _plain_seconds(self, num_tokens: int) -> float:
        """Predicted time of a step without drafts."""
        plain = self.plain_step_cost.seconds(num_tokens) if self.plain_step_cost is not None else 0.0
        return plain if plain > 1e-9 else self.step_cost.seconds(num_tokens)  # 0: no plain step measured yet

    def observe_propose(self, longest: int, seconds: float) -> None:
        """One ``propose`` call whose longest draft list had ``longest`` tokens took ``seconds``; the engine
        reports only calls for requests that all drafted the step before."""
        if longest:
            # A tree's nodes come from one pass of the speculator (Medusa's heads score every candidate at once):
            # its cost is the call's, whatever the tree's size.
            per_position = seconds / (1 if self._node_rates else longest)
            self.seconds_per_draft_position = (
                per_position if self.seconds_per_draft_position == 0 else
                _DECAY * self.seconds_per_draft_position + (1 - _DECAY) * per_position
            )  # fmt: skip

    def observe_verification(
        self, request_id: str, num_drafts: int, num_accepted: int, tree_nodes: Sequence[int] | None = None
    ) -> None:
        """``num_accepted`` of the request's ``num_drafts`` drafts were accepted; for a tree of drafts,
        ``tree_nodes`` are the accepted ones (a path)."""
        # Accepted drafts are successes, a rejection is a failure.
        self._request_acceptance(request_id).observe(num_accepted, num_accepted < num_drafts)
        self._pooled.observe(num_accepted, num_accepted < num_drafts, _DECAY)
        if tree_nodes is not None:
            self._node_rates.extend(_Rate() for _ in range(num_drafts - len(self._node_rates)))
            accepted = set(tree_nodes)
            for node in range(num_drafts):
                self._node_rates[node].observe(node in accepted, node not in accepted, _DECAY)

    def _request_acceptance(self, request_id: str) -> _Rate:
        acceptance = self._acceptance.get(request_id)
        if acceptance is None:
            acceptance = self._acceptance[request_id] = _prior(self._pooled.value)
        return acceptance

    def _node_rate(self, node: int) -> float:
        """How often a tree's ``node`` is accepted; the prior's one half for a node never verified yet."""
        return self._node_rates[node].value if node < len(self._node_rates) else 0.5

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._acceptance.pop(request_id, None)

    def num_drafts(self, request_ids: Sequence[str], limits: Sequence[int], num_step_tokens: int) -> list[int]:
        """Drafts per request for the next step, at most ``limits[i]`` each; ``num_step_tokens`` is the
        step's size without drafts (this step's, as an estimate of the next)."""
        self._num_decisions += 1
        if self._drafting_streak >= _EXPLORE_EVERY:
            counts = [0] * len(request_ids)
        else:
            counts = self._decide(request_ids, limits, num_step_tokens)
        self._drafting_streak = self._drafting_streak + 1 if any(counts) else 0
        return counts

    def _decide(self, request_ids: Sequence[str], limits: Sequence[int], num_step_tokens: int) -> list[int]:
        """``num_drafts`` when no plain step is due: explore where nothing is measured, else what pays."""
        counts = [0] * len(request_ids)
        if not self.step_cost.measured:
            # Nothing measured yet, or not for about 150 steps: a few requests verify the maximum, so that one
            # slow early step cannot price drafting out for good.
            return [min(limit, self.max_drafts) if i < _MAX_EXPLORE_BATCH else 0 for i, limit in enumerate(limits)]
        explore_tree = self._node_rates and self._num_decisions % _EXPLORE_TREE_EVERY == _EXPLORE_TREE_EVERY // 2
        if explore_tree and 0 < len(request_ids) <= _MAX_EXPLORE_BATCH:
            # Trees: one request verifies the whole tree, so every node's rate stays measured and the cost model
            # sees large steps too.
            explored = self._num_decisions // _EXPLORE_TREE_EVERY % len(request_ids)
            counts[explored] = min(limits[explored], self.max_drafts)
            return counts
        if self._node_rates:
            counts = self._tree_prefix(limits, num_step_tokens)
        else:
            counts = self._chain_counts(request_ids, limits, num_step_tokens)
        if not any(counts):
            # Nothing drafted, so the speculator's cost is not measured: let the estimate fade, so that a cost
            # measured once under load (or on a prompt's first catch-up) does not rule drafting out for good.
            self.seconds_per_draft_position *= _FORGET
        for request_id, count in zip(request_ids, counts, strict=True):
            acceptance = self._acceptance.get(request_id)
            if count == 0 and acceptance is not None:
                # Drift back towards an even chance while not drafting, so a request that turns predictable
                # (starts quoting, say) is tried again.
                acceptance.drift()
        return counts

    def _tree_prefix(self, limits: Sequence[int], num_step_tokens: int) -> list[int]:
        """For a tree speculator: the same first ``k`` nodes of the tree for every request (fewer where its
        limit says so), ``k`` the one with the most expected tokens per second. The nodes' rates are the
        speculator's, shared by all requests, and the step's cost is a line in its tokens, so one ``k`` fits all.
        Every prefix is weighed, not only up to the first node that does not pay alone: a poor node early in
        the stored order can precede better ones. A longer prefix must beat the best shorter one by
        ``_MIN_GAIN_PER_DRAFT`` per extra node, and the chosen one the plain step by ``_MIN_GAIN``."""
        limits = [min(limit, self.max_drafts) for limit in limits]
        plain_rate = len(limits) / self._plain_seconds(num_step_tokens)
        ascending = sorted(limits)
        tokens, extra = float(len(limits)), 0
        best_k, best_rate = 0, plain_rate
        for k in range(1, (ascending[-1] if ascending else 0) + 1):
            drafting = len(ascending) - bisect.bisect_left(ascending, k)  # requests whose limit reaches node k
            tokens += drafting * self._node_rate(k - 1)
            extra += drafting
            rate = tokens / (self.step_cost.seconds(num_step_tokens + extra) + self.seconds_per_draft_position)
            if rate > best_rate * (1 + _MIN_GAIN_PER_DRAFT * (k - best_k)):
                best_k, best_rate = k, rate
        if best_rate < (1 + _MIN_GAIN) * plain_rate:
            best_k = 0  # the nodes together must pay as a chain's first position must
        return [min(best_k, limit) for limit in limits]

    def _chain_counts(self, request_ids: Sequence[str], limits: Sequence[int], num_step_tokens: int) -> list[int]:
        """For a chain speculator: draft positions handed out one at a time to the request whose next one is
        likeliest accepted, and the step keeps the first ``n`` of them with the most expected tokens per second:
        a longer prefix must beat the best shorter one by ``_MIN_GAIN_PER_DRAFT`` per extra position, and the
        chosen one the plain step by ``_MIN_GAIN``. Every prefix is weighed, not only up to the first position
        that does not pay alone: a step's cost can jump at one token count and then flatten, and a run of copied
        text pays for 8 drafts where the fourth alone did not."""
        # Kept from the first decision on, so that a request the pooled rate rules out drifts back and is tried.
        acceptances = [self._request_acceptance(r) for r in request_ids]
        tokens = float(len(request_ids))  # expected tokens of the step's drafting requests: one each without drafts
        num_tokens, longest = num_step_tokens, 0
        best_rate = plain_rate = tokens / self._plain_seconds(num_tokens)
        handed: list[int] = []  # the requests the positions went to, in order
        best = 0
        counts = [0] * len(request_ids)
        # Max-heap of each request's next draft position, by the chance it is accepted (the gain falls with the
        # position, so the positions of one request come out in order).
        heap = [(-acceptance.gain(0), i) for i, acceptance in enumerate(acceptances) if limits[i] > 0]
        heapq.heapify(heap)
        while heap:
            gain, i = heapq.heappop(heap)
            longest = max(longest, counts[i] + 1)
            tokens, num_tokens = tokens - gain, num_tokens + 1
            rate = tokens / (self.step_cost.seconds(num_tokens) + longest * self.seconds_per_draft_position)
            handed.append(i)
            counts[i] += 1
            if rate > best_rate * (1 + _MIN_GAIN_PER_DRAFT * (len(handed) - best)):
                best, best_rate = len(handed), rate
            elif rate < best_rate * (1 - _GIVE_UP) or len(handed) - best > self.max_drafts:
                break  # later positions are less likely still, and cost at least as much
            if counts[i] < min(limits[i], self.max_drafts):
                heapq.heappush(heap, (-acceptances[i].gain(counts[i]), i))
        counts = [0] * len(request_ids)
        if best_rate >= (1 + _MIN_GAIN) * plain_rate:
            for i in handed[:best]:
                counts[i] += 1
        return counts
