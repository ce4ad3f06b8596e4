"""The goodput draft policy: drafts where they raise expected tokens per second, none where they do not."""

from __future__ import annotations

from tokenmill.speculative.draft_policy import DraftPolicy, StepCostModel, _Line


def _policy(base_ms: float = 10.0, per_token_ms: float = 1.3, k: int = 8) -> DraftPolicy:
    """A policy that has measured steps of 1..64 tokens costing ``base + per_token * tokens``."""
    policy = DraftPolicy(k)
    for tokens in (1, 2, 5, 9, 16, 32, 64) * 10:
        policy.observe_step(tokens, (base_ms + per_token_ms * tokens) / 1000)
    return policy


def _trained(policy: DraftPolicy, request_id: str, accepted: int, drafted: int, rounds: int = 20) -> None:
    for _ in range(rounds):
        policy.observe_verification(request_id, drafted, accepted)


def test_the_step_cost_fit_recovers_a_line() -> None:
    model = StepCostModel()
    for tokens in (1, 3, 8, 20) * 20:
        model.observe(tokens, 0.010 + 0.002 * tokens)
    assert abs(model.seconds(5) - 0.020) < 0.0005
    assert abs(model.seconds(40) - 0.090) < 0.002


def test_the_step_cost_model_follows_a_step_that_is_flat_then_steep() -> None:
    """Measured on the float32 default model: 2 tokens 18.0 ms, 5 tokens 18.2 ms, 17 tokens 27.6 ms. A line
    through those steps (the planted model) prices 5 tokens near 19 ms; the model keeps what it measured and
    interpolates between the counts it has seen."""
    model, line = StepCostModel(), _Line()
    for tokens, ms in [(2, 18.0), (2, 18.0), (5, 18.2), (17, 27.6)] * 20:
        model.observe(tokens, ms / 1000)
        line.observe(tokens, ms / 1000)
    assert abs(model.seconds(5) - 0.0182) < 0.0001
    assert abs(model.seconds(3) - 0.01807) < 0.0001  # a third of the way from 2 to 5
    assert abs(model.seconds(11) - 0.0229) < 0.0001  # half way from 5 to 17
    assert abs(line.seconds(5) - 0.0182) > 0.0005
    assert model.seconds(33) > model.seconds(17) > model.seconds(1) > 0  # past the measured counts, along the line


def test_counts_are_priced_on_the_lower_convex_hull_and_old_measurements_are_forgotten() -> None:
    """A count measured too high once (a passing load, a cold step) would not be chosen again, so not measured
    again: the hull passes under it. One measured too low is chosen and measured again (not simulated here);
    some 150 steps after its last measurement (more if it was measured often) it is forgotten either way."""
    model = StepCostModel()
    for _ in range(20):
        for tokens in (2, 9):
            model.observe(tokens, 0.018)
    model.observe(5, 0.100)  # a spike: under the hull
    assert abs(model.seconds(5) - 0.018) < 0.0005
    model.observe(5, 0.010)  # the bucket's mean is now 0.055, still above the hull
    assert abs(model.seconds(5) - 0.018) < 0.0005
    for _ in range(10):
        model.observe(5, 0.010)  # measured low, and again: the hull dips to it
    assert model.seconds(5) < 0.0175
    for _ in range(150):  # 300 steps: longer than for one measurement, since it was measured 11 times
        for tokens in (2, 9):
            model.observe(tokens, 0.018)
    assert abs(model.seconds(5) - 0.018) < 0.0005  # forgotten


def test_a_predictable_request_alone_gets_every_draft_and_an_unpredictable_one_fewer() -> None:
    policy = _policy()
    _trained(policy, "copying", accepted=8, drafted=8)  # alpha near 1
    _trained(policy, "chatting", accepted=0, drafted=2)  # alpha near 0
    assert policy.num_drafts(["copying"], [8], 1) == [8]
    assert policy.num_drafts(["chatting"], [8], 1) == [0]
    assert policy.num_drafts(["copying"], [3], 1) == [3]  # the request's own limit (max_tokens) holds


def test_large_batches_draft_nothing() -> None:
    policy = _policy()
    ids = [f"r{i}" for i in range(32)]
    for request_id in ids:
        _trained(policy, request_id, accepted=1, drafted=2)  # alpha about 1/3
    assert policy.num_drafts(ids, [8] * 32, 32) == [0] * 32
    assert sum(policy.num_drafts(ids[:1], [8], 1)) > 0  # the same request alone does draft


def test_a_costly_speculator_drafts_less() -> None:
    cheap, costly = _policy(), _policy()
    for policy in (cheap, costly):
        _trained(policy, "r", accepted=3, drafted=4)  # alpha 0.75
    costly.observe_propose(longest=4, seconds=0.020)  # 5 ms per draft position: half a step
    assert sum(costly.num_drafts(["r"], [8], 1)) < sum(cheap.num_drafts(["r"], [8], 1))


def test_before_any_measurement_it_drafts_the_maximum_to_learn() -> None:
    assert DraftPolicy(4).num_drafts(["a", "b"], [8, 2], 2) == [4, 2]


def test_a_request_without_drafts_is_tried_again_later() -> None:
    policy = _policy()
    _trained(policy, "r", accepted=0, drafted=2, rounds=20)
    assert policy.num_drafts(["r"], [8], 1) == [0]
    later = [policy.num_drafts(["r"], [8], 1) for _ in range(60)]
    assert later[-1] != [0]


def test_plain_steps_get_their_own_cost_line() -> None:
    """As on the H200: a plain step replays a CUDA graph (1.3 ms), a verification step runs eagerly (6 ms plus
    0.1 ms a token). With its own model for plain steps, a predictable request alone drafts nothing; one model
    through both kinds of step of the same sizes (the planted model: as a batch sees them) underestimates a
    verification and drafts."""

    def observed(graphed: bool) -> DraftPolicy:
        policy = DraftPolicy(8, separate_plain_steps=graphed)
        for tokens in (1, 2, 5, 9) * 20:
            policy.observe_step(tokens, 1.3 / 1000, drafted=False)
            policy.observe_step(tokens, (6.0 + 0.1 * tokens) / 1000, drafted=True)
        _trained(policy, "copying", accepted=7, drafted=8)  # alpha about 0.88
        return policy

    assert observed(graphed=True).num_drafts(["copying"], [8], 1) == [0]
    assert sum(observed(graphed=False).num_drafts(["copying"], [8], 1)) > 0
    # Where verification is cheap after all (a graph or a CPU), the same policy drafts.
    cheap = DraftPolicy(8)
    for tokens in (1, 2, 5, 9) * 20:
        cheap.observe_step(tokens, (1.3 + 0.1 * tokens) / 1000, tokens > 1)
    _trained(cheap, "copying", accepted=7, drafted=8)
    assert sum(cheap.num_drafts(["copying"], [8], 1)) >= 4


def test_a_slow_first_verification_does_not_rule_drafting_out_for_good() -> None:
    """One cold verification step (8 times a plain step) and nothing accepted price drafting out, and with nothing
    drafted that price was never measured again: a whole benchmark run drafted nothing. About 150 steps later
    the measurement is forgotten and the maximum is verified again."""
    policy = DraftPolicy(8)
    for _ in range(20):
        policy.observe_step(1, 0.005, drafted=False)
    policy.observe_step(9, 0.040)
    policy.observe_verification("r", 8, 0)
    decisions = []
    while len(decisions) < 300 and (not decisions or decisions[-1] == 0):
        decisions.append(policy.num_drafts(["r"], [8], 1)[0])
        policy.observe_step(1, 0.005, drafted=False)
    assert decisions[0] == 0 and decisions[-1] == 8 and 100 < len(decisions) < 200, decisions


_INT4_STEP_MS = {1: 5.45, 2: 6.17, 3: 6.96, 4: 7.79, 5: 9.40, 6: 10.34, 7: 11.64, 9: 12.80}  # measured, copy workload


def _int4_policy() -> DraftPolicy:
    """A policy that has measured the int4 default model's steps (a plain step of 1 token, verification steps of
    2-9), with a copying request: 8 drafts accepted in 14 of 15 verifications."""
    policy = DraftPolicy(8)
    for _ in range(20):
        for tokens, ms in _INT4_STEP_MS.items():
            policy.observe_step(tokens, ms / 1000, drafted=tokens > 1)
    for accepted in [8] * 14 + [0]:
        policy.observe_verification("copying", 8, accepted)
    return policy


def test_a_chain_is_weighed_at_every_length_and_a_position_need_not_pay_3_percent_alone() -> None:
    """Each prefix of a request's positions is weighed, as for a tree: a longer one must beat the best shorter one
    by 0.5% per position, and the chosen one the plain step by 3%. A rule that stopped at the first position
    adding less than 3% verified too few drafts of copied text (docs/benchmarks-history.md, "Chain drafts weighed
    at every length, a pooled prior, ngram's index, greedy verification")."""
    policy = _int4_policy()
    alpha = policy._acceptance["copying"].value

    def rate(k: int) -> float:
        return sum(alpha**j for j in range(k + 1)) / policy.step_cost.seconds(1 + k)

    assert 1.005 < rate(8) / rate(7) < 1.03  # the eighth draft adds under 3%
    assert policy.num_drafts(["copying"], [8], 1) == [8]


def test_a_new_request_starts_from_the_rates_of_recent_requests() -> None:
    """On a workload whose drafts are accepted, a new request drafts at once what the old ones learned to; its own
    verifications then take over (a new request's pooled prior weighs as two of its own verifications)."""
    policy = _int4_policy()
    fresh = _int4_policy()
    fresh._pooled = type(fresh._pooled)()  # the planted policy: every new request starts from an even chance
    assert policy.num_drafts(["new"], [8], 1) == [8]
    assert 0 < fresh.num_drafts(["new"], [8], 1)[0] < 8
    for _ in range(10):
        policy.observe_verification("new", 8, 0)
    assert policy.num_drafts(["new"], [8], 1) == [0]


def test_steps_that_draft_nothing_anyway_measure_the_plain_step() -> None:
    """A speculator that finds nothing to draft from in some steps (``ngram`` on most steps of copied text) gives
    the plain step's cost for free: no step is kept from drafting for it. Without them, one decision in 65 drafts
    nothing."""
    policy = _int4_policy()
    with_plain_steps = []
    for step in range(64):
        with_plain_steps.append(policy.num_drafts(["copying"], [8], 1)[0])
        policy.observe_step(9 if step % 4 else 1, 0.0128 if step % 4 else 0.00545, drafted=step % 4 != 0)
    assert 0 not in with_plain_steps
    always_drafting = [policy.num_drafts(["copying"], [8], 1)[0] for _ in range(2 * 65)]
    assert always_drafting.count(0) == 2 and set(always_drafting) == {0, 8}


def test_a_new_request_that_the_pooled_rate_rules_out_is_tried_later() -> None:
    """Where recent drafts were rejected, a new request starts without drafts; its rate drifts back while it gets
    none, so it is tried later (a new request held only as the pooled rate, never stored, never drifted: one
    benchmark run drafted 5 times in 850 steps)."""
    policy = _int4_policy()
    for _ in range(200):
        policy.observe_verification("rejected", 8, 0)
    decisions = [policy.num_drafts(["new"], [8], 1)[0] for _ in range(60)]
    assert decisions[0] == 0 and any(decisions), decisions
