"""Controllers: K climbs with an agreeing draft, falls with a disagreeing one, obeys load and
room, and drafting stops early when the draft is unsure."""

from __future__ import annotations

import pytest

from specrt.runtime import SpeculativeRuntime
from specrt.runtime.controller import Adaptive, Fixed, Heuristic, RoundContext, make_controller

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def agree(agree_bundle):
    return SpeculativeRuntime.load(agree_bundle, threads=1)


@pytest.fixture(scope="module")
def disagree(disagree_bundle):
    return SpeculativeRuntime.load(disagree_bundle, threads=1)


@pytest.mark.parametrize("controller", ["heuristic", "adaptive"])
def test_k_climbs_to_k_max_when_the_draft_always_agrees(agree, controller):
    result = agree.generate(PROMPT, max_new_tokens=100, controller=controller, ignore_eos=True)
    ks = result.stats.ks
    assert result.stats.acceptance_rate == 1.0
    assert max(ks) == 8  # reached K_max
    assert ks.count(8) >= len(ks) // 2  # and stayed (timing noise may cost the odd round)


@pytest.mark.parametrize("controller", ["heuristic", "adaptive"])
def test_k_falls_to_k_min_when_the_draft_never_agrees(disagree, controller):
    result = disagree.generate(PROMPT, max_new_tokens=60, controller=controller, ignore_eos=True)
    assert result.stats.accepted == 0
    assert result.stats.ks[-6:-1] == [1] * 5  # the last round is capped by the budget


def test_adaptive_explains_each_decision(agree):
    result = agree.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    stats = result.stats
    assert len(stats.reasons) == len(stats.ks) == stats.rounds
    assert stats.reasons[0].startswith("warming up")
    assert any("alpha=" in reason and "tok/s" in reason for reason in stats.reasons)


def test_load_caps_k(agree):
    idle = agree.generate(PROMPT, max_new_tokens=60, ignore_eos=True)
    busy = agree.generate(PROMPT, max_new_tokens=60, ignore_eos=True, load=3)
    assert max(idle.stats.ks) == 8
    assert max(busy.stats.ks) <= 8 // (1 + 3)
    assert "load 3 caps K at 2" in busy.stats.reasons[0]
    assert busy.token_ids == idle.token_ids


def test_long_context_halves_k():
    policy = Adaptive(k_max=8, long_context=100)
    assert policy.decide(RoundContext(k_max=8, position=50)).k == 4  # warming up
    for _ in range(3):
        policy.observe(8, 8, draft_s=0.008, verify_s=0.011)
    assert policy.decide(RoundContext(k_max=8, position=50)).k == 8
    decision = policy.decide(RoundContext(k_max=8, position=500))
    assert decision.k == 4 and "long context" in decision.reason


def test_adaptive_prefers_short_k_when_drafts_are_expensive():
    policy = Adaptive(k_max=8)
    for k in (2, 6):
        policy.observe(k, k // 2, draft_s=k * 0.09, verify_s=0.1 + 0.001 * k)
    assert policy.decide(RoundContext(k_max=8, position=10)).k <= 2
    cheap = Adaptive(k_max=8)
    for k in (2, 6):
        cheap.observe(k, k, draft_s=k * 0.005, verify_s=0.1 + 0.001 * k)
    assert cheap.decide(RoundContext(k_max=8, position=10)).k == 8


def test_low_confidence_stops_drafting_early(agree):
    unsure = Fixed(8)
    unsure.confidence_threshold = 1.01  # no draft distribution is ever this confident
    stats = agree.generate(PROMPT, max_new_tokens=60, ignore_eos=True, controller=unsure).stats
    assert stats.ks[0] == 8
    assert stats.drafted == sum(min(k, 1) for k in stats.ks)  # one draft per round, not eight


def test_heuristic_and_fixed_respect_room():
    assert Fixed(6).decide(RoundContext(k_max=2, position=0)).k == 2
    policy = Heuristic(k_max=8, start=8)
    assert policy.decide(RoundContext(k_max=3, position=0)).k == 3
    policy.observe(3, 1, 0.0, 0.0)
    assert policy.k == 7


@pytest.mark.parametrize("spec", ["fixed:x", "fixed:-1", "heuristic:2", "speedy"])
def test_bad_controller_specs(spec):
    from specrt.errors import SpecrtError

    with pytest.raises(SpecrtError):
        make_controller(spec, 8)
