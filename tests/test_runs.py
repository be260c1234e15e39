"""Pricing K by the order in which the draft's guesses were kept (runtime/runs.py): a fixed K's
yield on judged runs, a bonus token judged by the next draft step, and a batch after a long
prompt that takes K = 2 where its guesses come in runs. Arithmetic, and one real tiny engine:
no CPU, speed or load decides these verdicts."""

from __future__ import annotations

import numpy as np
import pytest
from fixed_costs import FixedCosts
from test_replay import DRAFT, LONG

from specrt.runtime import SpeculativeRuntime, joint
from specrt.runtime.controller import Adaptive
from specrt.runtime.drafters import ModelDrafter
from specrt.runtime.drafting import DraftJob, draft_together
from specrt.runtime.joint import decide_together
from specrt.runtime.policy import RoundContext
from specrt.runtime.pool import PooledAcceptance
from specrt.runtime.runs import JudgedRuns, _rounds
from specrt.runtime.sampling import SamplingParams
from specrt.tools import replay


def _drafted_at(runs: JudgedRuns, guesses, k: int, who: int = 0) -> None:
    """Feed `runs` the rounds a fixed K drafts over these judged guesses, as the loop reports
    them: each round's kept drafts, then the bonus token's guess where it kept them all."""
    i = 0
    while i + k < len(guesses):
        kept = 0
        while kept < k and guesses[i + kept]:
            kept += 1
        runs.drafted(who, ["model"], k, kept)
        if kept == k:
            runs.bonus(who, ["model"], bool(guesses[i + k]))
        i += kept + 1
    runs.drafted(who, ["model"], 0, 0)  # the answer ends: a gap


def test_a_fixed_k_yields_on_runs_what_its_rounds_keep():
    """Runs of (kept, ended by a rejection): 3 then a rejection, a rejection, 4 then a gap.
    K = 1: rounds keep 1 + bonus, 1 + bonus (the bonus on the rejected guess), then 0; the
    gap's run keeps its two full rounds: 4 + 1 + 4 tokens in 2 + 1 + 2 rounds, 4 drafts kept
    and 1 rejected. K = 2: a full round, then one rejected at once, then 0, then the gap's
    run's one full round: 4 + 1 + 3 tokens in 2 + 1 + 1 rounds, 4 kept and 2 rejected."""
    kept, ended = np.array([3, 0, 4]), np.array([True, True, False])
    assert _rounds(kept, ended, 1) == (5, 9, pytest.approx(4 / 5))
    assert _rounds(kept, ended, 2) == (4, 8, pytest.approx(4 / 6))


def test_independent_guesses_price_every_k_as_before():
    """Guesses kept independently (at 0.55, as after long prompts) give a factor of 1 at every
    K, within noise; drawn in runs, as the draft model's are, K = 2 is priced higher."""
    rng = np.random.default_rng(0)
    runs = JudgedRuns()
    _drafted_at(runs, rng.random(1200) < 0.55, 1)
    assert runs.shape("model", 1, 4) == pytest.approx([1.0] * 5, abs=0.02)
    correlated = JudgedRuns()
    for who, trace in enumerate(replay.load(LONG)[12:16]):  # 4 answers after 8,000 tokens
        _drafted_at(correlated, trace.agrees[1:], 1, who)
    shape = correlated.shape("model", 1, 4)
    assert shape[:2] == [1.0, 1.0] and shape[2] > 1.02


def test_a_bonus_token_is_judged_by_the_next_draft_step(bundles):
    """After a round that kept its drafts, the draft model's first step reads the last draft
    (never read: it was the last proposal) and the target's bonus token, and judges its own
    guess at the bonus: kept where the bonus is the token it would have drafted next, rejected
    where not. A step that reads one token judges none."""
    rt = SpeculativeRuntime.load(bundles["llama"], threads=1, calibrate=False)
    seq = [5, 6, 7, 8, 9, 10]
    drafter = ModelDrafter(rt.draft)
    drafter.start(seq, 0, None)

    def draft(tokens, k):
        job = DraftJob(drafter, tokens, k, SamplingParams(), np.random.default_rng(0))
        (proposal,), _ = draft_together([job])
        drafter.rollback(len(seq) + 1)  # as after a round at K = 2 that kept both drafts
        return proposal

    first = draft(seq, 3)
    assert first.guessed is None  # the prompt's catch-up reads all but its last apart
    d1, d2, d3 = first.tokens
    for bonus, kept in ((d3, True), ((d3 + 1) % rt.draft.vocab_size, False)):
        assert draft([*seq, d1, d2, bonus], 1).guessed is kept
    assert draft([*seq, d1, d2], 1).guessed is None


def test_after_a_long_prompt_a_batch_takes_k2_where_its_guesses_come_in_runs(monkeypatch):
    """4 recorded answers after 8,000 tokens (their first 128 guesses, drafted at K = 1, their
    bonus tokens judged), on curves where a round at K = 2 prices within the tie margin of
    one at K = 1 from their acceptance: priced by their runs, the batch drafts K = 2, where a
    fixed K = 2 yields 1.93 tokens a round on the same guesses and the independent price
    from K = 1's acceptance (0.54) 1.83. Control: priced as independent drafts, K = 1. Both at
    the full tie margin (its shrinking by the runs' evidence is test_replay's)."""
    monkeypatch.setattr(joint, "_margin", lambda policies, sources: joint.K_MARGIN)
    verify = {1: 0.628, 2: 0.646, 4: 0.66, 8: 0.70, 12: 0.80, 16: 0.998, 36: 1.355}
    costs = FixedCosts(draft=DRAFT, verify=verify)

    def decide() -> list[int]:
        pool = PooledAcceptance()
        policies = [Adaptive(costs=costs, pool=pool) for _ in range(4)]
        for policy, trace in zip(policies, replay.load(LONG)[12:16], strict=True):
            guesses, i = trace.agrees[1:128], 0
            while i + 1 < len(guesses):
                kept = int(guesses[i])
                policy.observe(1, kept, "model")
                if kept:
                    policy.bonus(guesses[i + 1])
                i += 1 + kept
        ctx = RoundContext(8, 9000, 60, "model", 2, 0, True, 70)
        return [d.k for d in decide_together(policies, [ctx] * 4, costs)]

    assert decide() == [2, 2, 2, 2]
    monkeypatch.setattr(Adaptive, "shape", lambda self, source="model": None)
    assert decide() == [1, 1, 1, 1]


def test_a_look_back_adds_its_guesses_to_the_runs_in_order():
    """A recorded answer's first 40 guesses judged by one look-back, the token its round added
    judged by the next draft step (as a bonus token), then drafting one token a round: the
    runs are those of drafting one token a round from the start, every guess judged once in
    order. An adaptive request after a long prompt, in a batch, adds its look-back's guesses
    to its answer's part too (the opening's, which a batch waiting at K = 0 judges by
    look-backs alone)."""
    guesses = replay.load(LONG)[12].agrees[1:]
    looked, drafted = JudgedRuns(), JudgedRuns()
    looked.looked(0, ["model"], guesses[:40])
    looked.bonus(0, ["model"], guesses[40])
    _drafted_at(looked, guesses[41:], 1)
    _drafted_at(drafted, guesses, 1)
    assert looked.runs["model"] == drafted.runs["model"] and looked.judged("model") > 100
    policy = Adaptive(pool=PooledAcceptance())
    policy.locate(RoundContext(8, 9000, 100, "model", 30, 29, True, 24), batch=4)
    policy.looked_back(guesses[:24])
    rejected = 24 - sum(guesses[:24])
    assert policy.pool.runs.judged("model opening") == policy.pool.runs.judged("model") > 0
    assert sum(ended for _, ended in policy.pool.runs.runs["model opening"]) == rejected - 1
