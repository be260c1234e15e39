"""Look-backs: after a long prompt, a request at K = 0 learns its draft's acceptance by letting
the draft model read what it missed and judging its guesses at the emitted tokens there, where a
probe would widen every row of the batch's call for one draft. The judgement is exactly the one
drafting would have made (greedy); the controller looks back before it drafts, starts drafting
only where the lower bound of what it judged pays, and looks back again at a share of its wait.
Outputs never change: a look-back only feeds the draft model tokens the target emitted."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from fixed_costs import gguf_costs

from specrt.runtime import Scheduler, SpeculativeRuntime, controller, joint
from specrt.runtime.controller import OPENING, Adaptive
from specrt.runtime.costs import StepCosts
from specrt.runtime.drafters import SINKS, ModelDrafter
from specrt.runtime.drafting import DraftJob, draft_together
from specrt.runtime.joint import (
    LOOK_BACK_AT,
    LOOK_SHARE,
    PROBE_AFTER,
    PROBE_HOPELESS,
    decide_together,
)
from specrt.runtime.policy import RoundContext
from specrt.runtime.pool import PooledAcceptance
from specrt.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def llama(bundles):
    return SpeculativeRuntime.load(bundles["llama"], threads=1, calibrate=False)


def _drafted(rt, prompt: list[int], seq: list[int]) -> list[bool]:
    """Whether a draft of one token after each prefix of seq past the prompt (a scouted draft
    model, drafting every round, its drafts judged against the next token) would be kept."""
    drafter = ModelDrafter(rt.draft, window=24)
    drafter.start(prompt, 0, None)
    kept = []
    for end in range(len(prompt), len(seq)):
        drafter.offer(seq[:end], 1)
        job = DraftJob(drafter, seq[:end], 1, SamplingParams(), np.random.default_rng(0))
        (proposal,), _ = draft_together([job])
        kept.append(proposal.tokens[0] == seq[end])
        drafter.rollback(end)
    return kept


def test_a_look_back_judges_what_drafting_would_have(agree_bundle, small_scout):
    """The agreeing pair after a 40-token prompt (scouted: the draft reads its sinks and last
    8) and 20 tokens after it, the target's answer with every third token changed, so that
    the draft's guesses are kept only now and then: one look-back judges the draft model's
    guess at each of the 20 and keeps exactly those that drafting one token every round would
    have had kept; its cache then holds what it read, so drafting goes on from there."""
    rt = SpeculativeRuntime.load(agree_bundle, threads=1, calibrate=False)
    prompt = [5 + (7 * i) % 50 for i in range(40)]
    answer = rt.generate(prompt, max_new_tokens=20, speculate=False, ignore_eos=True).token_ids
    seq = [*prompt, *(t if i % 3 else (t + 1) % 90 for i, t in enumerate(answer))]
    expected = _drafted(rt, prompt, seq)
    assert 0 < sum(expected) < len(expected)  # a pair that agrees only sometimes
    drafter = ModelDrafter(rt.draft, window=24)
    drafter.start(prompt, 0, None)
    assert drafter.offer(seq, 1).unjudged == 20
    assert drafter.look_back(seq) == expected and len(expected) == 20
    assert list(rt.draft.held(0)) == [*prompt[:SINKS], *seq[len(prompt) - 8 + SINKS :]]
    assert drafter.offer(seq, 1).unjudged == 0 and drafter.look_back(seq) == []


def test_a_look_back_far_behind_reads_the_last_look_back_tokens(llama, small_scout, monkeypatch):
    """A draft model LOOK_BACK tokens behind and more reads only the last LOOK_BACK (here 8)
    past its sinks, and judges the 7 emitted tokens among them that follow one it read."""
    from specrt.runtime import drafters

    monkeypatch.setattr(drafters, "LOOK_BACK", 8)
    prompt = [5 + (7 * i) % 50 for i in range(40)]
    seq = [*prompt, *range(60, 80)]
    drafter = ModelDrafter(llama.draft, window=24)
    drafter.start(prompt, 0, None)
    assert drafter.offer(seq, 1).unjudged == 7
    assert len(drafter.look_back(seq)) == 7
    assert list(llama.draft.held(0)) == [*prompt[:SINKS], *seq[-8:]]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_is_the_target_alone_through_look_backs(bundles, arch):
    """Two requests at once, adaptive with a 'long context' of 8 tokens on the tiny pairs:
    they look back before they draft and between stretches at K = 0; each output is the
    target alone's."""
    rt = SpeculativeRuntime.load(bundles[arch], threads=1, slots=2)
    prompts = [[3 + (7 * i + j) % 90 for i in range(24)] for j in (0, 5)]
    alone = [
        rt.generate(p, max_new_tokens=60, speculate=False, ignore_eos=True).token_ids
        for p in prompts
    ]
    scheduler = Scheduler(rt.target, rt.costs, slots=2)
    together = []
    for prompt in prompts:
        policy = Adaptive(costs=rt.costs, pool=rt.acceptance, long_context=8)
        together.append(rt.sequence(prompt, max_new_tokens=60, controller=policy, ignore_eos=True))
        scheduler.add(together[-1])
    while scheduler.busy:
        scheduler.step()
    assert [s.result.token_ids for s in together] == alone
    reasons = [reason for s in together for reason in s.result.stats.reasons]
    assert any("looking back" in reason for reason in reasons)


def _pair(unjudged: int, can_look: bool = True) -> list[RoundContext]:
    return [RoundContext(8, 2000, 256, lag=40, unjudged=unjudged, can_look=can_look)] * 2


def _ks(batch: list[Adaptive], contexts: list[RoundContext]) -> list:
    return decide_together(batch, contexts, batch[0].costs)


def test_after_a_long_prompt_a_batch_looks_back_before_it_drafts():
    """Two requests on the gguf curves after 2,000 tokens: each waits at K = 0 until it can
    judge LOOK_BACK_AT tokens, then looks back; with all judged guesses kept they draft, with
    a quarter they do not. Controls: requests that cannot look back (sampled, constrained),
    and a request alone, learn by drafting and probes as before look-backs."""

    def pair() -> list[Adaptive]:
        return [Adaptive(costs=gguf_costs()) for _ in range(2)]

    assert [d.k for d in _ks(pair(), _pair(LOOK_BACK_AT - 1))] == [0, 0]
    assert "waiting to look back" in _ks(pair(), _pair(LOOK_BACK_AT - 1))[0].reason
    assert [(d.k, d.look_back) for d in _ks(pair(), _pair(LOOK_BACK_AT))] == [(0, True)] * 2
    sure, doubtful = pair(), pair()
    for policy in sure:
        policy.looked_back(_guesses(LOOK_BACK_AT, LOOK_BACK_AT))
    for policy in doubtful:
        policy.looked_back(_guesses(LOOK_BACK_AT // 4, LOOK_BACK_AT))
    assert min(d.k for d in _ks(sure, _pair(1))) >= 1
    assert [d.k for d in _ks(doubtful, _pair(1))] == [0, 0]
    for decision in [
        *_ks(pair(), _pair(LOOK_BACK_AT, can_look=False)),
        Adaptive(costs=gguf_costs()).decide(_pair(LOOK_BACK_AT)[0]),
    ]:
        assert not decision.look_back and "look back" not in decision.reason


def test_a_start_is_priced_at_the_floor_of_what_was_judged(monkeypatch):
    """4 clients after 1,000 tokens (AMX Xeon: the 4-row call 0.153 s, the 8-row 0.205): a
    round at K = 1 pays from acceptance 0.62; their runtime's earlier drafts kept 0.4 and
    their first look-backs 12 of 16 each (estimates 0.74, floors 0.63, the higher of their
    own and their pool's lower bounds): the batch stays at K = 0. Control: a start priced at
    the estimate drafts, which a lucky opening set going at 0.55-0.6 (0.93x the target
    alone)."""

    def ks() -> list[int]:
        costs = StepCosts(draft={1: 0.020, 4: 0.040, 8: 0.050}, verify={4: 0.153, 8: 0.205})
        pool = PooledAcceptance()
        pool.observe("model", 20, 30, pool.member())  # the runtime's earlier drafts
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        for policy in batch:
            policy.looked_back(_guesses(12, 16))
        contexts = [RoundContext(8, 1100, 100, lag=2, can_look=True)] * 4
        return [d.k for d in decide_together(batch, contexts, costs)]

    assert ks() == [0] * 4
    monkeypatch.setattr(Adaptive, "floor", lambda self, source="model": self.alpha(source))
    assert ks() == [1] * 4


def test_a_batch_at_k0_looks_back_at_a_share_of_its_wait():
    """The same 4 clients at K = 0, their draft models 31 tokens behind: one request looks back
    (a 32-token draft call, 0.068 s) once the rounds they waited cover it at LOOK_SHARE, not
    PROBE_SHARE; it judges 31 guesses where a probe judges one. Control: requests that cannot
    look back wait on, and probe once no probe could change the course for PROBE_HOPELESS
    rounds (one kept draft beside their pool's 0.56 would not reach the 0.62 that pays)."""

    costs = StepCosts(draft={1: 0.020, 16: 0.045, 33: 0.070}, verify={4: 0.153, 8: 0.205})

    def decided(idle: int, can_look: bool) -> list:
        pool = PooledAcceptance()
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        for policy in batch:
            policy.looked_back(_guesses(9, 16))
            policy.idle = idle
        ctx = RoundContext(8, 1100, 100, lag=31, unjudged=31, can_look=can_look)
        return [d for d in decide_together(batch, [ctx] * 4, costs) if d.k or d.look_back]

    at = int(np.ceil(costs.draft_cost("model", 1, 32) / (LOOK_SHARE * 0.153)))
    assert at - 1 > PROBE_AFTER and not decided(at - 1, True)
    (look,) = decided(at, True)
    assert look.look_back and look.k == 0 and "looking back at 31 tokens" in look.reason
    assert not decided(at, False)
    (probe,) = decided(PROBE_HOPELESS, False)
    assert probe.k == 1 and "probing" in probe.reason


def test_a_batch_looks_back_at_the_request_judged_longest_ago(monkeypatch):
    """The 4 clients at K = 0: one request looked back 20 rounds after the others last did,
    so its look-back would judge fewer tokens and cost least. The batch looks back at one of
    the other three, whose counts are oldest. Control: the cheapest look-back (the rule
    before) went to the same request again and again (after 4,000 tokens of a question, the
    other three were never judged past their answers' openings)."""
    costs = StepCosts(draft={1: 0.020, 16: 0.045, 33: 0.070}, verify={4: 0.153, 8: 0.205})
    at = int(np.ceil(costs.draft_cost("model", 1, 32) / (LOOK_SHARE * 0.153)))

    def looker() -> int:
        pool = PooledAcceptance()
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        for policy in batch:
            policy.looked_back(_guesses(9, 16))
            policy.idle = at + 20
        batch[0].idle = at
        contexts = [RoundContext(8, 1100, 100, lag=31, unjudged=31, can_look=True)] * 4
        contexts[0] = RoundContext(8, 1100, 100, lag=25, unjudged=LOOK_BACK_AT, can_look=True)
        decisions = decide_together(batch, contexts, costs)
        (i,) = [i for i, d in enumerate(decisions) if d.look_back]
        return i

    assert looker() == 1
    cheapest = lambda policies, shares, looks: min(shares, key=shares.get)  # noqa: E731
    monkeypatch.setattr(joint, "_chosen", cheapest)
    assert looker() == 0


def test_a_batch_whose_runtime_knows_the_draft_is_priced_without_looking_first():
    """4 new requests after 1,000 tokens (a round at K = 1 pays from acceptance 0.62), their
    own drafts unknown, where their runtime's other requests kept 0.8 of their drafts: they
    draft at once, priced from that; where those kept 0.4, they wait at K = 0, neither looking
    back nor drafting. Control: a runtime that has not judged any draft looks back first."""
    costs = StepCosts(draft={1: 0.020, 4: 0.040, 8: 0.050}, verify={4: 0.153, 8: 0.205})

    def decided(kept: int, judged: int) -> list:
        pool = PooledAcceptance()
        pool.observe("model", kept, judged - kept, pool.member())
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        ctx = RoundContext(8, 1100, 100, lag=40, unjudged=LOOK_BACK_AT, can_look=True)
        return decide_together(batch, [ctx] * 4, costs)

    assert all(d.k >= 1 and not d.look_back for d in decided(80, 100))
    assert all(d.k == 0 and not d.look_back for d in decided(40, 100))
    assert all(d.look_back for d in decided(0, 0))


def test_a_batch_drafting_after_a_long_prompt_stops_where_its_ceiling_says_so(monkeypatch):
    """4 clients after 4,000 tokens (the 4-row call 0.40 s, the 8-row 0.50, a draft step 0.048: a
    round at K = 1 pays from acceptance 0.37), drafting at K = 1 from their runtime's 0.55, each
    answer's opening keeping 1 of its first 5 drafts (estimates 0.31): the batch drafts on, its
    drafts judged together (18, decayed, 0.18 kept) leaving 0.11 above each estimate plausible.
    Once each kept 2 of 9 (30 together, 0.20: 0.08 above estimates of 0.27), it stops. Control:
    stopped at the estimates, the batch stops at once, where a summary's opening (0.25 kept)
    gave way to 0.5-0.6 and, stopped, it waited ~37 rounds for its next look-back (4 clients
    after 4,000 tokens, 0.88-0.91x fixed K = 1)."""
    costs = StepCosts(draft={1: 0.023, 4: 0.048, 8: 0.059}, verify={4: 0.40, 8: 0.50})

    def k(kept: list[int]) -> int:
        pool = PooledAcceptance()
        pool.observe("model", 55, 45, pool.member())  # the runtime's earlier drafts
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        for accepted in kept:
            for policy in batch:
                policy.observe(1, accepted)
        contexts = [RoundContext(8, 4100, 100, lag=2, can_look=True)] * 4
        (k,) = {d.k for d in decide_together(batch, contexts, costs)}
        return k

    assert k([1, 0, 0, 0, 0]) == 1
    assert k([1, 0, 0, 0, 1, 0, 0, 0, 0]) == 0
    bounds = joint._bounds

    def at_estimates(policies, sources, alphas, price):
        return bounds(policies, sources, alphas, price)[0], functools.partial(price, alphas=alphas)

    monkeypatch.setattr(joint, "_bounds", at_estimates)
    assert k([1, 0, 0, 0, 0]) == 0


def _served_answers(costs: StepCosts, pool: PooledAcceptance) -> None:
    """A first batch of 4 after 4,000 tokens, drafting one token a round: its answers keep 1
    draft in 4 in their openings (their first OPENING tokens) and 3 in 5 after them."""
    for policy in [Adaptive(costs=costs, pool=pool) for _ in range(4)]:
        for emitted in range(0, 128, 2):
            policy.locate(_after_4000(emitted)[0], 4)
            kept = emitted % 8 == 0 if emitted < OPENING else emitted % 10 < 6
            policy.observe(1, int(kept))


def _after_4000(emitted: int) -> list[RoundContext]:
    return [RoundContext(8, 4100 + emitted, 100, lag=2, can_look=True, emitted=emitted)] * 4


def test_a_warm_batch_prices_an_answers_opening_from_what_openings_kept():
    """The costs of the case above (drafting pays from acceptance 0.37), after a first batch
    whose openings kept 0.25 of their drafts and whose bodies kept 0.6 (`_served_answers`): a
    second batch waits at K = 0 through its answers' openings, priced from what openings kept,
    and drafts once past them, priced from what bodies kept. Control: priced from the runtime's
    drafts over every part (0.53), it drafts from its first round on, into openings that keep
    0.25 (4 clients after 4,000 tokens of a summary drafted there, stopped 17 rounds in and
    drafted again ~30 rounds later: 0.96x and 0.90x fixed K = 1)."""
    costs = StepCosts(draft={1: 0.023, 4: 0.048, 8: 0.059}, verify={4: 0.40, 8: 0.50})
    pool = PooledAcceptance()
    _served_answers(costs, pool)

    def k(emitted: int) -> int:
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        (k,) = {d.k for d in decide_together(batch, _after_4000(emitted), costs)}
        return k

    assert k(0) == 0 and k(OPENING - 1) == 0
    assert k(OPENING) == 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Adaptive, "_pool_key", lambda self, source: source)
        assert k(0) == 1


def test_past_its_opening_a_request_is_priced_without_its_openings_drafts(monkeypatch):
    """The same runtime; a batch that drafted through its answers' openings (1 draft in 4
    kept) and stopped: once past them, its own drafts, all of the opening, no longer price it
    (its part's pool does, 0.6), and it drafts again. Control: its whole answer one part (the
    rule before), it stays at K = 0 (traced there, a warm turn stopped in the opening and
    drafted again ~30 rounds into bodies that kept 0.5-0.6)."""
    costs = StepCosts(draft={1: 0.023, 4: 0.048, 8: 0.059}, verify={4: 0.40, 8: 0.50})
    pool = PooledAcceptance()
    _served_answers(costs, pool)

    def k(opening: int) -> int:
        monkeypatch.setattr(controller, "OPENING", opening)
        batch = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        for emitted in range(0, OPENING - 4, 2):  # its openings' drafts...
            for policy in batch:
                policy.locate(_after_4000(emitted)[0], 4)
                policy.observe(1, int(emitted % 8 == 0))
        for policy in batch:  # ...then a round at K = 0
            policy.observe(0, 0)
        (k,) = {d.k for d in decide_together(batch, _after_4000(OPENING), costs)}
        return k

    assert k(OPENING) == 1
    assert k(10**9) == 0


def _guesses(kept: int, judged: int) -> list[bool]:
    """A look-back's guesses: `kept` of `judged` kept, the kept ones first."""
    return [True] * kept + [False] * (judged - kept)
