"""Controllers: K climbs with an agreeing draft, falls with a disagreeing one and as the batch
grows, obeys room, and drafting stops early when the draft is unsure."""

from __future__ import annotations

import pytest
from fixed_costs import flat_costs, gguf_costs

from specrt.runtime import SpeculativeRuntime
from specrt.runtime.controller import Adaptive, Fixed, Heuristic, make_controller
from specrt.runtime.costs import PREFIX, StepCosts
from specrt.runtime.joint import (
    K_MARGIN,
    PROBE_AFTER,
    PROBE_AFTER_ALONE,
    PROBE_BANK,
    SWITCH_GAIN,
    WARM_UP_K,
    decide_round,
    decide_together,
)
from specrt.runtime.policy import RoundContext
from specrt.runtime.pool import PooledAcceptance
from specrt.runtime.pricing import expected_tokens, first_step_rows, price_round

PROMPT = "def fibonacci(n):"


def _observe(policy: Adaptive, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
    """What a round of one request tells its policy and the shared costs."""
    policy.observe(k, accepted)
    for _ in range(k):
        policy.costs.observe_draft(1, draft_s / k)
    policy.costs.observe_verify(k + 1, verify_s)


@pytest.fixture(scope="module")
def agree(agree_bundle):
    return SpeculativeRuntime.load(agree_bundle, threads=1)


@pytest.fixture(scope="module")
def disagree(disagree_bundle):
    return SpeculativeRuntime.load(disagree_bundle, threads=1)


def test_k_climbs_to_k_max_when_the_draft_always_agrees(agree):
    result = agree.generate(PROMPT, max_new_tokens=100, controller="heuristic", ignore_eos=True)
    ks = result.stats.ks
    assert result.stats.acceptance_rate == 1.0
    assert max(ks) == 8  # reached K_max
    assert ks.count(8) >= len(ks) // 2  # and stayed


def test_adaptive_climbs_to_k_max_when_every_draft_is_accepted():
    """Deterministic costs (the loop's own are wall-clock): a cheap draft, a flat curve. K
    climbs to K_max: the base the recent drafts are shrunk toward is the request's own long
    run, all kept (shrunk toward the prior alone, the estimate stayed at ~0.91 and K_max
    priced within K_MARGIN of K = 7, so K stopped one below)."""
    costs = StepCosts(draft={1: 0.001}, verify={n: 0.010 for n in range(1, 10)})
    policy = Adaptive(k_model=8, costs=costs)
    ks = []
    for _ in range(12):
        k = policy.decide(RoundContext(room=8, position=20, remaining=256)).k
        _observe(policy, k, k, 0.001 * k, 0.010)
        ks.append(k)
    assert ks[-6:] == [8] * 6 and ks[0] < 8
    assert policy.alpha() > 0.95


def test_adaptive_on_an_always_agreeing_draft(agree_bundle):
    """With fixed costs (a cheap draft, a flat verify curve) the choice depends on acceptance
    alone: it drafts, and all is kept."""
    rt = SpeculativeRuntime.load(agree_bundle, threads=1, calibrate=False)
    rt.costs = flat_costs()
    result = rt.generate(PROMPT, max_new_tokens=100, ignore_eos=True)
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.tokens_per_target_call > 1.2


def test_k_falls_to_k_min_when_the_draft_never_agrees(disagree):
    result = disagree.generate(PROMPT, max_new_tokens=60, controller="heuristic", ignore_eos=True)
    assert result.stats.accepted == 0
    assert result.stats.ks[-6:-1] == [1] * 5  # the last round is capped by the budget


def test_adaptive_stops_drafting_when_the_draft_never_agrees(disagree_bundle):
    """K = 0 (the target alone) beats any K once acceptance is near 0; a draft is still tried
    now and then, so a draft that starts agreeing is noticed. Fixed costs: whether a probe is
    cheap enough is then not up to the CPU."""
    rt = SpeculativeRuntime.load(disagree_bundle, threads=1, calibrate=False)
    rt.costs = flat_costs()
    result = rt.generate(PROMPT, max_new_tokens=80, ignore_eos=True)
    ks = result.stats.ks
    assert result.stats.accepted == 0
    assert ks[-30:].count(0) >= 25 and 1 in ks[-30:]
    assert any("probing" in reason for reason in result.stats.reasons)


def test_adaptive_explains_each_decision(agree_bundle):
    uncalibrated = SpeculativeRuntime.load(agree_bundle, threads=1, calibrate=False)
    stats = uncalibrated.generate(PROMPT, max_new_tokens=40, ignore_eos=True).stats
    assert len(stats.reasons) == len(stats.ks) == stats.rounds
    assert stats.reasons[0].startswith("warming up")
    assert any("alpha=" in reason and "tok/s" in reason for reason in stats.reasons)


def test_calibrated_costs_are_used_from_the_first_round(agree):
    costs = agree.calibrate()  # as loaded: earlier tests' rounds refined the shared curves
    assert agree.bundle.max_draft == 8 and agree.bundle.max_lookup == 32
    assert sorted(costs.verify) == [*range(1, 10), 16, 24, 33]  # K = 0..8, then long windows
    assert costs.draft_step > 0 and all(t > 0 for t in costs.verify.values())
    assert sorted(costs.draft) == [1, 16, 33]  # one slot: a step of one row, and catch-ups
    one_slot = StepCosts(draft={1: 0.010, 16: 0.040, 33: 0.074})  # an int4 draft's shape
    extrapolated = 0.074 + (0.074 - 0.040) / 17 * (500 - 33)
    assert one_slot.catch_up_cost(500) == pytest.approx(extrapolated - 0.010)  # not free
    stats = agree.generate(PROMPT, max_new_tokens=20, ignore_eos=True).stats
    assert "c_verify(K)/c_verify(0)=" in stats.reasons[0]


def _policy_with(verify: dict[int, float], alpha: float) -> Adaptive:
    return Adaptive(k_model=8, costs=StepCosts(draft={1: 0.01}, verify=verify), prior_alpha=alpha)


def test_a_steep_verify_curve_means_shorter_speculation():
    """Same acceptance and draft cost; only the measured verify curve differs."""
    flat = {n: 0.100 + 0.002 * (n - 1) for n in range(1, 10)}  # weight-bound float32
    steep = {n: 0.040 + 0.015 * (n - 1) for n in range(1, 10)}  # compute-bound int4
    ctx = RoundContext(room=8, position=10, remaining=256)
    k_flat = _policy_with(flat, 0.8).decide(ctx).k
    k_steep = _policy_with(steep, 0.8).decide(ctx).k
    # Hand-computed: E(K) / (0.01 K + c(K+1)) peaks at K=5 for the flat curve (23.1 tok/s;
    # K=4 prices within K_MARGIN of it, 22.7, and drafts less) and at K=1 for the steep one
    # (27.7 tok/s).
    assert (k_flat, k_steep) == (4, 1)


def test_of_rounds_priced_alike_the_one_drafting_less_is_taken():
    """The flat curve above: at acceptance 0.8, K = 5 prices best by 1.5 % over K = 4, inside
    the prices' own error, so K = 4 is taken; at 0.95, K = 8 prices 3.1 % over K = 7, and is
    taken. Control: the plain best price takes K = 5 at 0.8."""
    flat = {n: 0.100 + 0.002 * (n - 1) for n in range(1, 10)}
    ctx = RoundContext(room=8, position=10, remaining=256)
    for alpha, most, taken in ((0.8, 5, 4), (0.95, 8, 8)):
        policy = _policy_with(flat, alpha)
        rates = [
            price_round([k], [alpha], ["model"], [(0, 256)], (), policy.costs)[0] for k in range(9)
        ]
        assert max(range(9), key=rates.__getitem__) == most  # the control
        assert (1 + K_MARGIN) * rates[taken] >= rates[most]
        assert policy.decide(ctx).k == taken, alpha


def test_verify_cost_interpolates_and_extrapolates_the_measured_curve():
    costs = StepCosts(draft={1: 0.01}, verify={1: 0.10, 3: 0.14, 5: 0.30})
    assert costs.verify_cost(3) == 0.14
    assert costs.verify_cost(2) == pytest.approx(0.12)  # between 1 and 3
    assert costs.verify_cost(4) == pytest.approx(0.22)  # between 3 and 5
    assert costs.verify_cost(7) == pytest.approx(0.46)  # beyond: slope of 3..5
    assert StepCosts(verify={2: 0.2}).verify_cost(9) == 0.2  # one point: flat
    spiky = StepCosts(verify={1: 0.10, 2: 0.50, 3: 0.12})  # a noisy sample at 2
    assert spiky.verify_cost(2) == 0.12  # never above a larger count's measurement
    assert spiky.verify_cost(1) == 0.10
    costs.observe_verify(1, 0.12)  # 20 % over its price: a one-row call is all reads
    assert costs.verify_cost(1) == pytest.approx(0.106)
    assert costs.verify_cost(3) == pytest.approx(1.06 * 0.10 + 0.04)  # the rows' arithmetic


def test_one_stall_cannot_price_a_call_out_of_reach_but_a_lasting_slowdown_shows():
    """A shared machine stalls now and then; a stall seen once moves the estimate 15 %, where
    it would have moved it 3.7x (and K = 0 would never measure that call again)."""
    costs = StepCosts(verify={16: 0.30})
    costs.observe_verify(16, 3.0)  # another tenant took the cores for one call
    assert costs.verify_cost(16) == pytest.approx(0.30 * 1.15)
    for _ in range(6):  # the machine is now twice as slow, and stays so
        costs.observe_verify(16, 0.60)
    assert costs.verify_cost(16) > 0.55


def _batch_costs() -> StepCosts:
    """A float32-like machine: up to 8 rows cost one weight pass, then compute adds 12.5 ms a
    row; a draft step costs 10 ms for one row and a little more per extra row."""
    verify = {n: 0.1 + 0.0125 * max(0, n - 8) for n in range(1, 160)}
    return StepCosts(draft={1: 0.010, 2: 0.011, 4: 0.012, 8: 0.015, 16: 0.020}, verify=verify)


def test_k_falls_as_the_batch_grows():
    """The same requests, the same acceptance: only the batch size changes, and with it the
    verify call's rows. K = 0 wins once each extra row costs compute."""
    costs = _batch_costs()
    chosen = {}
    for size in (1, 2, 4, 8, 16):
        policies = [Adaptive(costs=costs, prior_alpha=0.7) for _ in range(size)]
        contexts = [RoundContext(room=8, position=50, remaining=256)] * size
        decisions = decide_together(policies, contexts, costs)
        assert len({d.k for d in decisions}) == 1  # one K for the batch
        chosen[size] = decisions[0].k
        assert (f"batch {size}: " in decisions[0].reason) == (size > 1)
    ks = [chosen[size] for size in (1, 2, 4, 8, 16)]
    assert ks == sorted(ks, reverse=True) and ks[0] >= 3 and ks[-1] == 0, chosen


def test_each_request_keeps_its_own_room_and_fixed_requests_pad_the_call():
    costs = _batch_costs()
    policies = [Adaptive(costs=costs), Adaptive(costs=costs), Fixed(6)]
    contexts = [RoundContext(8, 50, 256), RoundContext(1, 50, 256), RoundContext(8, 50, 256)]
    decisions = decide_round(policies, contexts, costs)
    assert decisions[2].k == 6  # a fixed request decides alone
    assert decisions[1].k <= 1  # room for one draft only
    # The call is 7 tokens wide anyway (the fixed request): drafting costs little (K = 3, since
    # more prices within K_MARGIN of it).
    assert decisions[0].k >= 3


def _stopped(costs: StepCosts, alpha: float) -> Adaptive:
    """A request whose own long run says `alpha` (its recent drafts forgotten), its pool at
    the prior 0.7: an accepted probe would price it afresh from 0.7 (`Adaptive.hopeful`)."""
    policy = Adaptive(costs=costs, prior_alpha=0.7)
    policy.record["model"] = [0.0, policy.pool_weight * (0.7 / alpha - 1)]
    assert policy.alpha() == pytest.approx(alpha)
    return policy


def test_a_request_without_drafts_is_probed_now_and_then():
    costs = _batch_costs()
    policy = _stopped(costs, 0.01)
    ctx = RoundContext(room=8, position=50, remaining=256)
    for _ in range(PROBE_AFTER_ALONE):
        assert policy.decide(ctx).k == 0
        policy.observe(0, 0)
    decision = policy.decide(ctx)
    assert decision.k == 1 and "probing" in decision.reason


def test_a_probe_is_priced_net_of_the_draft_it_expects_to_keep():
    """Alone on the gguf curves, 29 rounds without drafts and 16 tokens for the draft model to
    catch up on: a probe costs 71 ms beyond its round, 52 ms less the draft a request at
    acceptance 0.3 expects to keep (0.3 of a 61 ms round), within 3 % of the rounds it waited
    (53 ms). Control: at acceptance 0.01 the same probe waits on."""
    ctx = RoundContext(room=8, position=2000, remaining=256, lag=16)
    decisions = []
    for alpha in (0.3, 0.01):
        policy = _stopped(gguf_costs(), alpha)
        policy.idle = policy.bank = 29  # all it took part in
        decisions.append(policy.decide(ctx))
    assert [d.k for d in decisions] == [1, 0] and "probing" in decisions[0].reason
    policy.idle = policy.bank = 40  # and probes once it has waited longer
    assert policy.decide(ctx).k == 1


def test_alone_a_probe_spends_a_share_of_every_round_its_request_took_part_in():
    """Alone, a probe may cost PROBE_SHARE of every round its request took part in, less what
    its probes cost, at most PROBE_BANK rounds banked (`joint._allowance`): not of each wait
    alone, so rounds before a stop pay for the first probe after it. On the gguf curves a
    probe 16 tokens behind at acceptance 0.3 costs 52 ms net, the share of ~29 rounds of 61
    ms. After 200 rounds without drafts, the full bank pays for two probes, PROBE_AFTER_ALONE
    rounds apart; the third waits for the rounds to refill it (the rejected probes lowered
    its estimate, so each costs more than the last)."""
    policy = _stopped(gguf_costs(), 0.3)
    for _ in range(200):
        policy.observe(0, 0)
    assert policy.bank == PROBE_BANK
    ctx = RoundContext(room=8, position=2000, remaining=256, lag=16)
    probes = []
    for n in range(80):
        k = policy.decide(ctx).k
        policy.observe(k, 0)
        probes += [n] * k
    assert probes[:2] == [0, PROBE_AFTER_ALONE + 1] and probes[2] - probes[1] >= 20


def test_the_first_draft_step_is_priced_with_what_the_draft_has_not_read():
    """A round that kept every draft leaves the draft model two tokens to read, so in a batch
    the first draft step is about twice as wide as the rest. The curves are the gguf 1.5B
    target's and the int4 0.5B draft's, calibrated at 8 slots on a 2-core AVX-512 EPYC (fixed
    here: no CPU decides the test). At 4 requests and acceptance 0.85 the target alone is the
    better round, as measured there; priced at one row a request, K = 1 would have looked 7 %
    better than K = 0."""
    costs = gguf_costs()
    verify = costs.verify
    assert first_step_rows([(1, 0.85)]) == pytest.approx(1.85)
    assert first_step_rows([(1, 0.85)] * 4) == pytest.approx(4 * (2 - 0.15**4))
    batch = [Adaptive(costs=costs, prior_alpha=0.85) for _ in range(4)]
    assert [d.k for d in decide_together(batch, [RoundContext(8, 100, 256)] * 4, costs)] == [0] * 4
    one_row_each = 4 * expected_tokens(0.85, 1) / (costs.draft_cost("model", 1, 4) + verify[8])
    assert one_row_each > 1.05 * 4 / verify[4]  # the old price: K = 1 looked better
    alone = Adaptive(costs=costs, prior_alpha=0.85)
    assert alone.decide(RoundContext(8, 100, 256)).k >= 1  # one request still drafts


def test_a_new_request_starts_from_the_acceptance_its_runtime_has_seen():
    """In a batch of 2 on the gguf target's curves, drafting one token pays from an acceptance
    of about 0.8: requests starting from the fixed prior (0.7) would never draft, and there no
    probe widens the call to learn better. Requests that start from what the runtime's earlier
    requests accepted (above 0.9 here) draft, then follow their own drafts; a runtime that has
    judged none yet drafts to learn (warming up), and prices from what it learnt."""
    costs = gguf_costs()
    contexts = [RoundContext(8, 100, 256)] * 2
    prior_only = [Adaptive(costs=costs, prior_alpha=0.7) for _ in range(2)]
    assert [d.k for d in decide_together(prior_only, contexts, costs)] == [0, 0]  # the trap
    pool = PooledAcceptance()
    fresh = [Adaptive(costs=costs, prior_alpha=0.7, pool=pool) for _ in range(2)]
    first = decide_together(fresh, contexts, costs)
    assert first[0].k >= 1 and "learning" in first[0].reason  # one learns for the batch
    assert first[1].k == 0 and "waiting" in first[1].reason
    earlier = Adaptive(costs=costs, prior_alpha=0.7, pool=pool)
    earlier.decide(RoundContext(8, 100, 256))
    for accepted in [4] * 8 + [3] * 2:
        earlier.observe(4, accepted)
    assert pool.warm("model") and pool.alpha("model") > 0.9
    after = [Adaptive(costs=costs, prior_alpha=0.7, pool=pool) for _ in range(2)]
    decided = decide_together(after, contexts, costs)
    assert min(d.k for d in decided) >= 1 and "warming up" not in decided[0].reason
    poor = PooledAcceptance()
    poor.observe("model", 2, 8)  # ten drafts judged, one in five accepted: not worth drafting
    assert poor.warm("model")
    learnt = [Adaptive(costs=costs, prior_alpha=0.7, pool=poor) for _ in range(2)]
    assert [d.k for d in decide_together(learnt, contexts, costs)] == [0, 0]
    alone = Adaptive(costs=costs, prior_alpha=0.7, pool=PooledAcceptance())
    assert "warming up" not in alone.decide(RoundContext(8, 100, 256)).reason  # alone, probes learn
    assert make_controller("adaptive", 8, costs, pool=pool).pool is pool


def test_a_request_is_shrunk_toward_the_other_requests_not_itself():
    """Alone in its runtime, a request's base is the prior, not the pool of its own drafts:
    once an accepted probe drops its old drafts (the text moved on), it starts again from 0.7,
    where counted twice its opening's rejections held it at 0 (the control: the pool with its
    share). Another request reads those drafts; a share faded to nothing is forgotten."""
    pool = PooledAcceptance()
    policy = Adaptive(costs=gguf_costs(), pool=pool)
    for _ in range(10):
        policy.observe(1, 0)
    assert pool.warm("model") and pool.alpha("model") == 0.0  # the control
    assert not pool.warm("model", policy.member) and pool.alpha("model", policy.member) is None
    policy.counts.clear()  # as an accepted probe does, its long run too
    policy.record.clear()
    assert policy.alpha() == pytest.approx(policy.prior_alpha)
    other = Adaptive(costs=gguf_costs(), pool=pool)
    assert other.learning("model") is False and other.alpha() == 0.0
    for _ in range(800):
        other.observe(1, 1)
    assert (policy.member, "model") not in pool.shares
    assert policy.alpha() > 0.99  # the other request's drafts, all kept


def test_one_rejected_draft_does_not_end_a_requests_drafting():
    """A request's own drafts are a small sample, so its estimate is shrunk toward what the
    runtime's requests accepted. In a batch of 2 on the gguf target's curves, with the pool at
    0.9, two new requests whose first drafts are both rejected still draft (their estimates
    fall toward the pool's, not to 0.6), where an estimate from their own drafts alone priced
    K = 0 and, since no probe widens a batch's call, never drafted again. (The rejection
    counts twice, in its recent drafts and in its long run, the base they are shrunk toward.)"""
    costs = gguf_costs()
    pool = PooledAcceptance()
    pool.observe("model", 45, 5)
    batch = [Adaptive(costs=costs, pool=pool) for _ in range(2)]
    first = decide_together(batch, [RoundContext(8, 100, 256)] * 2, costs)
    assert min(d.k for d in first) >= 1
    for policy, decision in zip(batch, first, strict=True):
        policy.observe(decision.k, 0)
    after = decide_together(batch, [RoundContext(8, 100, 256, lag=1)] * 2, costs)
    assert min(d.k for d in after) >= 1
    assert 0.65 < batch[0].alpha() < pool.alpha("model")
    loner = Adaptive(costs=costs, prior_alpha=0.7)  # without a pool, the prior is the base
    loner.observe(8, 8)
    assert 0.7 < loner.alpha() < 1.0


def test_only_the_requests_of_a_source_not_yet_learnt_warm_up():
    """A request drafting by lookup (its source new to the runtime) warms up alone; the
    request drafting by the model, whose acceptance the runtime knows, still prices its K,
    knowing the lookup's width."""
    costs = gguf_costs()
    pool = PooledAcceptance()
    pool.observe("model", 2, 8)
    policies = [Adaptive(costs=costs, pool=pool) for _ in range(2)]
    lookup, model = RoundContext(8, 100, 256, source="ngram"), RoundContext(8, 100, 256)
    warming, priced = decide_together(policies, [lookup, model], costs)
    assert warming.k == WARM_UP_K and "warming up (ngram" in warming.reason
    assert priced.k == 0 and "tok/s" in priced.reason


def test_a_cold_batch_learns_the_drafts_acceptance_through_one_request():
    """Four requests after 1,000 tokens, the runtime's pool cold: one request drafts to learn
    for the batch (the one whose draft model has least to read, then the same one again), the
    others wait at K = 0 without their draft models reading a thing; where every draft is
    rejected, the learner stays at K = 1, and once the pool is warm nobody drafts. The control:
    every request of the batch drafting to learn (the old rule) paid four first reads and
    three rounds of drafts. Where the learner's drafts are all kept, the batch drafts once the
    pool is warm."""
    costs = gguf_costs()
    pool = PooledAcceptance()
    batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
    lags = [40, 36, 36, 40]  # the sinks and scout of each prompt's end (unread)
    ks_by_round = []
    while batch[0].learning("model"):
        contexts = [RoundContext(8, 1048 + len(ks_by_round), 128, lag=lag) for lag in lags]
        decided = decide_together(batch, contexts, costs)
        ks_by_round.append([d.k for d in decided])
        for i, (policy, decision) in enumerate(zip(batch, decided, strict=True)):
            policy.observe(decision.k, 0)
            lags[i] = 1 if decision.k else lags[i] + 1
        assert len(ks_by_round) <= 12
    assert all(ks == [0, 1, 0, 0] for ks in ks_by_round)  # the control: [1, 1, 1, 1] first
    assert "waiting" in decided[0].reason and "learning" in decided[1].reason
    contexts = [RoundContext(8, 1060, 128, lag=lag) for lag in lags]
    assert [d.k for d in decide_together(batch, contexts, costs)] == [0, 0, 0, 0]
    kept = PooledAcceptance()
    short = [Adaptive(costs=costs, pool=kept) for _ in range(2)]
    ks = []
    while short[1].learning("model"):
        decided = decide_together(short, [RoundContext(8, 100, 256, lag=1)] * 2, costs)
        ks.append(decided[0].k)
        assert decided[1].k == 0
        short[0].observe(decided[0].k, decided[0].k)
    assert ks == [1] * 9  # at K = 1, POOL_WARM drafts (decayed) are judged in nine rounds
    assert (
        min(d.k for d in decide_together(short, [RoundContext(8, 120, 236, lag=1)] * 2, costs)) >= 1
    )


def test_a_batch_keeps_its_course_where_drafting_and_the_target_alone_price_alike():
    """At 4 requests and acceptance 0.9 on the gguf target's curves, K = 1 prices within 5 % of
    the target alone. A batch that drafted last round (its draft model caught up) keeps
    drafting; one that did not keeps to the target alone. Flipping on noise made every return
    to drafting pay a catch-up."""
    costs = gguf_costs()
    alone_rate = 4 / costs.verify_cost(4)
    k1_rate = price_round([1] * 4, [0.9] * 4, ["model"] * 4, [(2, None)] * 4, (), costs)[0]
    assert alone_rate < k1_rate < SWITCH_GAIN * alone_rate

    def ks(last_k: int) -> list[int]:
        batch = [Adaptive(costs=costs, prior_alpha=0.9) for _ in range(4)]
        for policy in batch:
            policy.observe(last_k, last_k)
        return [d.k for d in decide_together(batch, [RoundContext(8, 100, 256, lag=2)] * 4, costs)]

    assert min(ks(last_k=1)) >= 1  # drafting, and drafting still pays a little: it goes on
    assert ks(last_k=0) == [0] * 4  # not drafting: 1 % is no reason to start


def _spells(costs: StepCosts, truth: StepCosts, alpha: float, spells) -> list[int]:
    """4 requests at acceptance alpha on `costs`, whose calls take what `truth` prices times
    the machine's spell (`spells`: (factor, rounds) each): how many of them draft, round by
    round (each request's estimate held at alpha; one drafting alone is a probe)."""
    batch = [Adaptive(costs=costs, prior_alpha=alpha, pool_weight=1e9) for _ in range(4)]
    ctx, ks = RoundContext(8, 100, 256, lag=2), []
    for factor, rounds in spells:
        for _ in range(rounds):
            decisions = decide_together(batch, [ctx] * 4, costs)
            rows = 4 * (max(d.k for d in decisions) + 1)
            costs.observe_verify(rows, factor * truth.verify_cost(rows, 4), requests=4)
            for policy, decision in zip(batch, decisions, strict=True):
                policy.observe(decision.k, decision.k)
            ks.append(sum(1 for d in decisions if d.k))
    return ks


def _own_times(costs: StepCosts) -> StepCosts:
    """The same curves priced as before the model: each count at its own times, lately."""
    own = StepCosts(draft=dict(costs.draft))
    own.verify = dict(costs.verify)
    return own


def test_a_slow_spell_prices_every_option_of_a_round_alike():
    """4 clients at acceptance 0.5 after a long prompt, where K = 1 earns 1.12x the target
    alone, on a machine that slows by a third for 5 rounds and recovers: every option is
    priced by one model, the spell moves them alike, and the batch drafts throughout.
    Control: priced at each count's own last times, the drafting call took the slow spell's
    price while the call without drafts kept its own, and the batch stopped for good (but for
    probes): what the runtime did after 4,000 tokens at 4 clients, where it priced the
    drafting call 1.28-1.58x the call without drafts while fixed K = 1's rounds took 1.07x
    the target alone's in that turn."""
    truth = StepCosts(draft=dict(gguf_costs().draft), verify={4: 0.55, 8: 0.70, 12: 0.85})
    alone = 4 / truth.verify_cost(4, 4)
    k1 = price_round([1] * 4, [0.5] * 4, ["model"] * 4, [(2, 256)] * 4, (), truth)[0]
    assert k1 > 1.1 * alone
    spells = [(1.0, 10), (1.35, 5), (1.0, 40)]
    model = StepCosts(draft=dict(truth.draft), verify=dict(truth.verify))
    assert _spells(model, truth, 0.5, spells) == [4] * 55
    assert _spells(_own_times(truth), truth, 0.5, spells)[15:] == [0] * 40


def test_a_drift_scales_the_wide_calls_a_batch_does_not_make():
    """8 clients at K = 0 on a compute-bound curve, and the machine slows by 30 %: the 16-row
    call a round at K = 1 would make, untimed, is priced 30 % dearer too. (A shift learnt on
    the 8-row calls added their 41 ms to it, 18 % where 30 % was due, and the batch drafted at
    0.86x the target alone.)"""
    shape = dict(gguf_costs().verify)
    costs = StepCosts(verify=dict(shape))
    for _ in range(16):
        costs.observe_verify(8, 1.3 * shape[8], requests=8)
    assert costs.verify_cost(8, 8) == pytest.approx(1.3 * shape[8], rel=0.02)
    assert costs.verify_cost(16, 8) == pytest.approx(1.3 * shape[16], rel=0.02)


# After 8,000 tokens at 4 clients the gguf target's 4-row call takes 0.55 s and its 8-row call
# 0.70 s (1.27x; calibration at 48 tokens said 1.46x): the context term that puts them there.
LONG_4, LONG_8, LONG_AT = 0.55, 0.70, 8040


def _long_costs(per_request: bool = True) -> StepCosts:
    """The gguf pair's curves with the context term that prices LONG_4 and LONG_8 at LONG_AT
    (per row and per request; or, `per_request=False`, with none), the context there."""
    calibrated, span = gguf_costs(), LONG_AT - PREFIX
    per_row = (LONG_8 - calibrated.verify[8] - LONG_4 + calibrated.verify[4]) / (4 * span)
    request = (LONG_4 - calibrated.verify[4]) / (4 * span) - per_row
    costs = StepCosts(draft=dict(calibrated.draft), verify=dict(calibrated.verify))
    if per_request:
        costs.per_request, costs.per_row = request, per_row
    costs.observe_verify(4, LONG_4, context=LONG_AT, requests=4)
    return costs


def test_a_long_prompt_is_priced_by_the_context_each_request_reads():
    """After 8,000 tokens at 4 clients, the calls' context term (a request's cache is read
    once a call whatever its width, and each row attends over it) prices the 8-row call at
    1.27x the 4-row one, as it takes, and 4 clients at acceptance 0.5 draft: K = 1 earns 1.1x
    the target alone. A short request after them is priced at calibration again. Control:
    carried by the drifts alone, the 8-row call kept about calibration's 1.46x of the 4-row
    one and the batch stayed at K = 0 (the fault measured at 8,000 tokens)."""

    def ks(costs: StepCosts) -> list[int]:
        batch = [Adaptive(costs=costs, prior_alpha=0.5, pool_weight=1e9) for _ in range(4)]
        contexts = [RoundContext(8, LONG_AT, 100, lag=2)] * 4
        return [d.k for d in decide_together(batch, contexts, costs)]

    costs = _long_costs()
    assert costs.verify_cost(4, 4) == pytest.approx(LONG_4)
    assert costs.verify_cost(8, 4) == pytest.approx(LONG_8)
    assert ks(costs) == [1] * 4
    costs.observe_verify(1, gguf_costs().verify[1], context=100)  # a short request after them
    assert costs.verify_cost(4) == pytest.approx(gguf_costs().verify[4], rel=0.05)
    carried = _long_costs(per_request=False)
    assert carried.verify_cost(8, 4) / carried.verify_cost(4, 4) > 1.4
    assert ks(carried) == [0] * 4


def test_a_first_slow_call_after_a_long_prompt_moves_every_price_alike():
    """After 8,000 tokens at 4 clients (2-core EPYC), each turn's first 8-row call took
    2.3-2.5x the 4-row call, the next ones 1.07x. Timed so once or twice, the call moves the
    drift, every option's price with it, and 4 clients at acceptance 0.5 draft on. Control:
    priced at its own times, the 8-row call took that time as its price, and the batch
    stopped (a look-back batch stayed at K = 0 for 64 rounds where fixed K = 1 ran 1.15x)."""

    def ks(costs: StepCosts) -> list[int]:
        for _ in range(2):
            costs.observe_verify(8, 2.3 * LONG_4, context=LONG_AT, requests=4)
        batch = [Adaptive(costs=costs, prior_alpha=0.5, pool_weight=1e9) for _ in range(4)]
        for policy in batch:
            policy.observe(1, 1)
        contexts = [RoundContext(8, LONG_AT, 100, lag=2)] * 4
        return [d.k for d in decide_together(batch, contexts, costs)]

    assert ks(_long_costs()) == [1] * 4
    own = _own_times(gguf_costs())
    own.verify |= {4: LONG_4, 8: 2.3 * LONG_4}
    assert ks(own) == [0] * 4


def test_a_spell_that_slows_the_reads_leaves_the_width_where_it_was():
    """4 clients after 4,000 tokens on the EPYC's model (its context term as calibrated there),
    at acceptance 0.45: where the machine is quiet, K = 1 earns less than the target alone
    and the batch stays at K = 0; where a neighbour's memory traffic adds 0.15 s
    to every call's reads (the EPYC's cells: the round at K = 0 took 0.18-0.43 s turn by turn
    while a round at K = 1 cost 0.10-0.16 s more in each), the calls without drafts move the
    reads' drift most, the width's arithmetic little, and the batch drafts, as fixed K = 1 won
    those turns. Control: one drift scaling every part priced the width's extra up with the
    reads and kept the batch at K = 0 (what issue 54's question after 4,000 tokens did, turn
    after turn, 0.93x fixed K = 1)."""

    def costs() -> StepCosts:
        epyc = StepCosts(
            draft=dict(gguf_costs().draft), verify=dict(gguf_costs().verify), per_request=5.3e-6
        )
        epyc.per_row, epyc.context = 1e-6, 4040
        return epyc

    def ks(costs: StepCosts) -> list[int]:
        batch = [Adaptive(costs=costs, prior_alpha=0.45, pool_weight=1e9) for _ in range(4)]
        return [d.k for d in decide_together(batch, [RoundContext(8, 4040, 100, lag=2)] * 4, costs)]

    quiet = costs()
    assert ks(quiet) == [0] * 4
    spell, base = costs(), quiet.verify_cost(4, 4)
    for _ in range(20):
        spell.observe_verify(4, base + 0.15, context=4040, requests=4)
    assert spell.verify_cost(4, 4) == pytest.approx(base + 0.15, rel=0.01)
    assert spell.verify_cost(8, 4) - spell.verify_cost(4, 4) < 1.4 * (
        quiet.verify_cost(8, 4) - base
    )
    assert ks(spell) == [1] * 4
    scaled = costs()
    scaled.drift = ((base + 0.15) / base,) * 2
    assert ks(scaled) == [0] * 4


def test_a_batch_that_stopped_drafting_probes_at_a_share_of_its_wait():
    """4 clients at K = 0 after a long prompt, where a probe widens a 0.55 s call to 0.70 s
    (1.27x, past the 1.1x of a round the old rule allowed, so such a batch never learnt
    again): one request probes (the one whose draft model has least to read) once the
    rounds waited cover its cost at PROBE_SHARE, and the batch waits as long again before
    the next."""
    costs = _long_costs()
    assert costs.verify_cost(8, 4) > 1.1 * costs.verify_cost(4, 4)
    batch = [Adaptive(costs=costs, prior_alpha=0.3, pool_weight=1e9) for _ in range(4)]
    lags = [30, 20, 30, 30]
    probes = []
    for n in range(120):
        contexts = [RoundContext(8, 8040 + n, 500, lag=lag) for lag in lags]
        decided = decide_together(batch, contexts, costs)
        for i, (policy, decision) in enumerate(zip(batch, decided, strict=True)):
            policy.observe(decision.k, 0)
            lags[i] = 1 if decision.k else lags[i] + 1
            if decision.k:
                probes.append((n, i))
                assert "probing" in decision.reason
    assert probes and all(i == 1 for _, i in probes)  # the least behind, each time
    gaps = [b - a for (a, _), (b, _) in zip(probes, probes[1:], strict=False)]
    assert probes[0][0] >= PROBE_AFTER and min(gaps, default=PROBE_AFTER) >= PROBE_AFTER
    assert len(probes) <= 120 // PROBE_AFTER


def test_no_probe_where_no_acceptance_could_pay(monkeypatch):
    """In a batch of 16 at K = 0, one probe makes the call 32 rows (twice the cost here): even
    drafts all kept would not pay for the wider call, so however long the batch has waited
    (its share would allow a probe), nobody probes. Control: allowed to hope, one probes."""
    costs = _batch_costs()
    policies = [Adaptive(costs=costs, prior_alpha=0.3) for _ in range(16)]
    for policy in policies:
        policy.idle = 10 * PROBE_AFTER
    decisions = decide_together(policies, [RoundContext(8, 50, 256)] * 16, costs)
    assert [d.k for d in decisions] == [0] * 16
    monkeypatch.setattr("specrt.runtime.joint._could_pay", lambda *args: True)
    decisions = decide_together(policies, [RoundContext(8, 50, 256)] * 16, costs)
    assert sorted(d.k for d in decisions) == [0] * 15 + [1]


def test_no_probe_soon_where_none_it_could_pass_would_change_the_course(monkeypatch):
    """4 clients after 1,000 tokens on an AMX Xeon: a round at K = 1 costs 1.63x one at K = 0
    (0.27 s against 0.163), so drafting pays from acceptance 0.63, and their pool says 0.45. A
    probe that kept its draft would price its request afresh from that pool (0.51), and no
    course would change: the batch waits PROBE_HOPELESS rounds, not PROBE_AFTER. Control:
    hoping for every draft kept, it probed every ~16 rounds, each probe 115 ms over its round
    (~4 % of the turn; the cell ran 0.90-0.93x the target alone)."""
    from specrt.runtime.joint import PROBE_HOPELESS
    from specrt.runtime.pool import PooledAcceptance

    def ks(idle: int) -> list[int]:
        costs = StepCosts(
            draft={1: 0.020, 4: 0.045, 8: 0.050}, verify={4: 0.163, 8: 0.220, 12: 0.28}
        )
        pool = PooledAcceptance()
        pool.observe("model", 45, 55, pool.member())  # the batch's earlier drafts
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        for policy in batch:
            policy.idle, policy.last_k = idle, 0
        contexts = [RoundContext(8, 1100, 100, lag=2)] * 4
        return sorted(d.k for d in decide_together(batch, contexts, costs))

    assert ks(PROBE_AFTER) == [0] * 4
    assert ks(PROBE_HOPELESS) == [0, 0, 0, 1]
    monkeypatch.setattr(Adaptive, "hopeful", lambda self, source="model": 0.999)
    assert ks(PROBE_AFTER) == [0, 0, 0, 1]


def test_a_draft_cache_far_behind_is_priced_and_not_probed():
    """A request that sat at K = 0 must first feed the draft model every token it missed, and
    in a batch everyone waits for that call: the round is priced with it (spread over the
    rounds its 16 tokens left take), and no probe starts one where it costs more than the
    round it joins."""
    costs = _batch_costs()
    assert costs.catch_up_cost(1) == 0.0
    assert costs.catch_up_cost(9) == pytest.approx(0.015 + 0.005 / 8 - 0.010)
    policy = Adaptive(costs=costs, prior_alpha=0.8)
    near, far = RoundContext(8, 300, 16, lag=1), RoundContext(8, 300, 16, lag=300)
    assert policy.decide(near).k >= 1 and policy.decide(far).k >= 1  # worth it at this alpha
    rate = [float(policy.decide(ctx).reason.split("-> ")[1].split()[0]) for ctx in (near, far)]
    assert rate[1] < rate[0]  # the catch-up is in the price
    idle = _stopped(costs, 0.01)
    idle.idle = idle.bank = PROBE_AFTER
    # Alone, a request spreads its catch-up over its idle rounds...
    assert idle.decide(RoundContext(8, 300, 256, lag=PROBE_AFTER)).k == 1
    assert (
        idle.decide(RoundContext(8, 300, 256, lag=1500)).k == 0
    )  # ...but 1,500 tokens is too many
    # In a batch the others wait for it: a catch-up of 300 tokens is no probe's business, and
    # of the requests whose probe is cheap, one probes per round.
    pair = [_stopped(costs, 0.01) for _ in range(3)]
    for policy in pair:
        policy.idle = PROBE_AFTER
    lags = [
        RoundContext(8, 300, 256, lag=300),
        RoundContext(8, 300, 256, lag=1),
        RoundContext(8, 300, 256),
    ]
    assert [d.k for d in decide_together(pair, lags, costs)] == [0, 1, 0]


def test_a_catch_up_is_spread_over_the_answer_left():
    """A catch-up serves every later round: early in a long answer a request far behind drafts
    again, near its end the same catch-up is not worth it."""
    costs = _batch_costs()
    batch = [Adaptive(costs=costs, prior_alpha=0.8) for _ in range(2)]

    def ks(remaining: int) -> list[int]:
        contexts = [RoundContext(8, 300, remaining, lag=300)] * 2
        return [d.k for d in decide_together(batch, contexts, costs)]

    assert min(ks(1000)) >= 1
    assert ks(4) == [0, 0]


def test_long_context_halves_k():
    policy = Adaptive(k_model=8, long_context=100)
    assert policy.decide(RoundContext(room=8, position=50, remaining=256)).k == 4  # warming up
    for _ in range(3):
        _observe(policy, 8, 8, draft_s=0.008, verify_s=0.011)
    assert policy.decide(RoundContext(room=8, position=50, remaining=256)).k >= 7  # K_MARGIN
    decision = policy.decide(RoundContext(room=8, position=500, remaining=256))
    assert decision.k == 4 and "long context" in decision.reason


def test_after_a_long_prompt_k_starts_at_one_and_grows_with_the_drafts_kept():
    """A fresh request on the flat curve at acceptance 0.8: at a short position it drafts 4
    (the control), past the long context 1 until its own drafts are judged, 1 more for each
    kept, and once DOUBT_AFTER were judged, what its price says."""
    flat = {n: 0.100 + 0.002 * (n - 1) for n in range(1, 10)}
    policy = _policy_with(flat, 0.8)
    assert policy.decide(RoundContext(room=8, position=10, remaining=256)).k == 4
    long = RoundContext(room=8, position=2000, remaining=256)
    first = policy.decide(long)
    assert first.k == 1 and "own drafts unknown" in first.reason
    policy.observe(1, 1)
    assert policy.decide(long).k == 2
    policy.observe(2, 2)
    assert policy.decide(long).k == 4  # three kept; long context caps K at 4
    policy.observe(4, 0)
    policy.observe(policy.decide(long).k, 0)  # (decayed) four judged: priced from here
    priced = policy.decide(long)
    assert priced.k >= 1 and "own drafts unknown" not in priced.reason


def test_adaptive_prefers_short_k_when_drafts_are_expensive():
    policy = Adaptive(k_model=8)
    for k in (2, 6):
        _observe(policy, k, k // 2, draft_s=k * 0.09, verify_s=0.1 + 0.001 * k)
    assert policy.decide(RoundContext(room=8, position=10, remaining=256)).k <= 2
    cheap = Adaptive(k_model=8)
    for k in (2, 6):
        _observe(cheap, k, k, draft_s=k * 0.005, verify_s=0.1 + 0.001 * k)
    assert cheap.decide(RoundContext(room=8, position=10, remaining=256)).k >= 7  # K_MARGIN


def test_low_confidence_stops_drafting_early(agree):
    unsure = Fixed(8)
    unsure.confidence_threshold = 1.01  # no draft distribution is ever this confident
    stats = agree.generate(PROMPT, max_new_tokens=60, ignore_eos=True, controller=unsure).stats
    assert stats.ks[0] == 8
    assert stats.drafted == sum(min(k, 1) for k in stats.ks)  # one draft per round, not eight


def test_heuristic_and_fixed_respect_room():
    assert Fixed(6).decide(RoundContext(room=2, position=0, remaining=256)).k == 2
    policy = Heuristic(k_max=8, start=8)
    assert policy.decide(RoundContext(room=3, position=0, remaining=256)).k == 3
    policy.observe(3, 1)
    assert policy.k == 7


@pytest.mark.parametrize("spec", ["fixed:x", "fixed:-1", "heuristic:2", "speedy"])
def test_bad_controller_specs(spec):
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError):
        make_controller(spec, 8)
