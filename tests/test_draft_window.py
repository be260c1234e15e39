"""A windowed draft: after a long prompt the draft model reads only its first SINKS tokens and
its last ones, so drafting costs what it costs after a short prompt. Only the proposals may
change, never the output: greedy equals the target alone (and the sampled distribution is
checked in test_lossless_sampling.py). The agreeing pair is the control that the window is
really in effect: its draft agrees with the target only where it reads the whole context."""

from __future__ import annotations

import numpy as np
import pytest
from fixed_costs import flat_costs

from specrt.errors import SpecrtError
from specrt.runtime import SpeculativeRuntime, drafters
from specrt.runtime.costs import StepCosts
from specrt.runtime.drafters import (
    LOOK_BACK,
    RESUME,
    SINKS,
    ModelDrafter,
    make_drafter,
    resume_length,
)
from specrt.runtime.drafting import DraftJob, draft_together
from specrt.runtime.sampling import SamplingParams
from specrt.serve import ServeSettings

LONG = "def add(a, b):\n    return a + b\n\n" * 2 + "class Point:\n    def __init__(self, x, y):"


@pytest.fixture(scope="module")
def runtimes(bundles):
    return {arch: SpeculativeRuntime.load(path, threads=1) for arch, path in bundles.items()}


def test_the_draft_reads_the_sinks_then_the_prompt_end(runtimes):
    rt = runtimes["llama"]
    prompt = [5 + i % 50 for i in range(40)]
    drafter = ModelDrafter(rt.draft, window=12)
    drafter.start(prompt, 0, None)
    assert drafter.offer(prompt, 3).lag == 12  # the window, not the prompt
    job = DraftJob(drafter, prompt, 3, SamplingParams(), np.random.default_rng(0))
    (proposal,), _ = draft_together([job])
    view = prompt[:SINKS] + prompt[-(12 - SINKS) :]
    held = list(rt.draft.held(0))
    assert held[:12] == view and held[12:] == proposal.tokens[:-1]
    drafter.rollback(len(prompt) + 1)  # one draft kept: the cache keeps the window and it
    assert list(rt.draft.held(0)) == [*view, proposal.tokens[0]]
    seq = [*prompt, proposal.tokens[0], 7]
    assert drafter.offer(seq, 3).lag == 1 and list(drafter.unread(seq)) == [7]
    # A prompt that fits the window is read whole, as without one.
    drafter.start(prompt[:10], 0, None)
    assert drafter.skip == 0 and drafter.offer(prompt[:10], 3).lag == 10


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", ["model", "hybrid"])
def test_greedy_output_is_the_target_alone_at_any_window(runtimes, arch, name):
    rt = runtimes[arch]
    ids = rt.encode(LONG)
    assert 40 < len(ids) < 70, len(ids)
    alone = rt.generate(ids, max_new_tokens=30, speculate=False, ignore_eos=True)
    for window in (SINKS + 1, 16, None):
        for controller in ("fixed:3", "adaptive"):
            drafter = make_drafter(name, rt.draft, window=window)
            spec = rt.generate(
                ids, max_new_tokens=30, drafter=drafter, controller=controller, ignore_eos=True
            )
            assert spec.token_ids == alone.token_ids, (window, controller)
    # The conversation's next turn: the draft reads its new window, the output is the same.
    turn = [*ids, *alone.token_ids, *rt.encode(" and then")]
    again = rt.generate(turn, max_new_tokens=20, speculate=False, ignore_eos=True)
    spec = rt.generate(turn, max_new_tokens=20, controller="fixed:2", ignore_eos=True)
    assert spec.token_ids == again.token_ids and spec.stats.drafted > 0


def test_the_window_is_in_effect_on_the_agreeing_pair(agree_bundle):
    """The agreeing draft proposes the target's own tokens where it reads what the target
    reads (every draft accepted); with a small window it reads less and is rejected at times,
    and the output is the target's all the same."""
    rt = SpeculativeRuntime.load(agree_bundle, threads=1, calibrate=False, draft_window=None)
    ids = [3 + (7 * i) % 90 for i in range(80)]
    alone = rt.generate(ids, max_new_tokens=24, speculate=False, ignore_eos=True)
    rates = {}
    for window in (None, 8):
        drafter = make_drafter("model", rt.draft, window=window)
        spec = rt.generate(
            ids, max_new_tokens=24, drafter=drafter, controller="fixed:3", ignore_eos=True
        )
        assert spec.token_ids == alone.token_ids
        rates[window] = spec.stats.accepted / spec.stats.drafted
    assert rates[None] == 1.0 and rates[8] < 1.0


def test_a_window_too_small_is_refused(bundles, runtimes):
    with pytest.raises(SpecrtError, match="more than the 4 first tokens"):
        ModelDrafter(runtimes["llama"].draft, window=SINKS)
    with pytest.raises(SpecrtError, match="--draft-window must be 0"):
        ServeSettings(bundle=bundles["llama"], draft_window=3).check()
    assert runtimes["llama"].draft_window == 512  # the default


def _scouted(rt, prompt: list[int]) -> tuple[ModelDrafter, list[int]]:
    """A drafter over a 40-token prompt (window 24) after two rounds of one kept draft each."""
    drafter = ModelDrafter(rt.draft, window=24)
    drafter.start(prompt, 0, None)
    assert drafter.offer(prompt, 3).lag == 8  # the scout, not the window
    seq = list(prompt)
    for _ in range(2):
        job = DraftJob(drafter, seq, 3, SamplingParams(), np.random.default_rng(0))
        (proposal,), _ = draft_together([job])
        assert list(rt.draft.held(0))[:8] == prompt[:SINKS] + prompt[-(8 - SINKS) :]
        drafter.rollback(len(seq) + 1)
        seq = [*seq, proposal.tokens[0], 7]
    return drafter, seq


def test_a_long_prompt_is_scouted_then_its_window_offered(runtimes, small_scout):
    rt = runtimes["llama"]
    prompt = [5 + i % 50 for i in range(40)]
    drafter, seq = _scouted(rt, prompt)
    # Two drafts kept: the offer is to read the window (its catch-up priced as a lag), where
    # the answer left is at least a quarter of that lag; nearer the end, it drafts on scouting.
    assert drafter.kept == 2
    lag = 24 - SINKS + len(seq) - len(prompt)
    assert drafter.offer(seq, lag // 4 - 1).lag == 1 and drafter.offered is None
    assert drafter.offer(seq, lag // 4).lag == lag
    job = DraftJob(drafter, seq, 3, SamplingParams(), np.random.default_rng(0))
    draft_together([job])
    window = prompt[:SINKS] + prompt[-(24 - SINKS) :]
    assert list(rt.draft.held(0))[: len(seq) - len(prompt) + 24] == window + seq[len(prompt) :]
    assert drafter.skip == len(prompt) - 24
    # Declined (a round without drafts at that offer): it stays a scout, and drafts cheaply.
    drafter, seq = _scouted(rt, prompt)
    assert drafter.offer(seq, 8).lag > 20
    drafter.rollback(len(seq))
    seq = [*seq, 9]
    assert drafter.offer(seq, 3).lag == 2 and drafter.skip == len(prompt) - 8


def test_a_draft_far_behind_keeps_what_it_read_and_resumes_at_the_end(runtimes, small_scout):
    """After rounds without drafts, a long prompt's draft model more than RESUME tokens behind
    keeps what it read and reads on from the sequence's last RESUME tokens, skipping the rest;
    declined, it stays as it was. Control: a short prompt's draft catches up on everything."""
    rt = runtimes["llama"]
    for prompt, scouted in (([5 + i % 50 for i in range(40)], True), ([5, 6, 7, 8, 9, 10], False)):
        drafter = ModelDrafter(rt.draft, window=24)
        drafter.start(prompt, 0, None)
        seq = list(prompt)
        draft_together([DraftJob(drafter, seq, 1, SamplingParams(), np.random.default_rng(0))])
        drafter.rollback(len(seq))
        read = list(rt.draft.held(0))
        for token in range(12):  # rounds at K = 0
            drafter.offer(seq, 30)
            seq.append(20 + token)
            drafter.rollback(len(seq))
        behind = len(seq) - drafter.skip - rt.draft.lengths[0]
        assert behind == 12
        assert drafter.offer(seq, 30).lag == (4 if scouted else behind)
        if scouted:
            drafter.rollback(len(seq))  # declined: nothing moves
            assert drafter.offer(seq, 30).lag == 4
        draft_together([DraftJob(drafter, seq, 1, SamplingParams(), np.random.default_rng(0))])
        held = list(rt.draft.held(0))
        assert held[: len(read)] == read  # what it had read stays
        assert held[len(read) : len(read) + (4 if scouted else 12)] == seq[-4 if scouted else -12 :]
        drafter.rollback(len(seq) + 1)  # its draft kept, and the target's token after it
        assert drafter.offer([*seq, 1, 2], 30).lag == 2  # it reads on from where it resumed


def _reading(per_token: float, call: float) -> StepCosts:
    """A machine whose draft model reads `per_token` seconds a token and whose target's call
    without drafts takes `call` alone, twice that for 4 requests."""
    return StepCosts(draft={1: 0.01, 33: 0.01 + 32 * per_token}, verify={1: call, 4: 2 * call})


def test_a_draft_back_from_a_stop_reads_more_where_its_reads_are_cheap():
    """Fallen behind alone, a long prompt's draft model reads on from the sequence's last
    LOOK_BACK tokens where reading them rather than the last RESUME costs at most RESUME_READ
    of a call without drafts (an AMX Xeon's shape: 2.5 ms a token beside a 105 ms call, the
    24 more reads 0.57 of it); where its reads are dear beside the call, from the last RESUME
    (a 2-core AVX-512 EPYC's: 3 ms beside 75 ms, 0.96 of it, where the longer read held the
    probe back from a stop ~40 rounds; an AVX2 EPYC's: 8 ms beside 100 ms). In a batch, where
    requests learn by looking back, from the last RESUME."""
    assert resume_length(_reading(0.0025, 0.105), 1) == LOOK_BACK
    assert resume_length(_reading(0.003, 0.075), 1) == RESUME  # the control
    assert resume_length(_reading(0.008, 0.100), 1) == RESUME
    assert resume_length(_reading(0.0025, 0.105), 4) == RESUME


def test_each_round_tells_the_draft_model_how_far_back_it_resumes(runtimes):
    """The runtime prices the resume from its own costs every round (`resume_length`), so the
    same request reads on from the last LOOK_BACK on one machine and the last RESUME on
    another."""
    rt = runtimes["llama"]
    saved = rt.costs
    try:
        machines = ((_reading(0.0025, 0.105), LOOK_BACK), (_reading(0.003, 0.075), RESUME))
        for costs, resume in machines:
            rt.costs = costs
            drafter = make_drafter("model", rt.draft)
            # one round (prefill draws the first token), priced before its own timings refine it
            rt.generate([5, 6, 7, 8], max_new_tokens=2, drafter=drafter, controller="fixed:1")
            assert drafter.model.resume == resume
    finally:
        rt.costs = saved


def test_drafts_that_are_rejected_never_pay_for_the_window(
    disagree_bundle, small_scout, monkeypatch
):
    """The draft that never agrees, after a prompt of 96 tokens: scouting, the draft model
    never reads more than the scout and what was emitted; control: reading the prompt whole
    from the first draft (no scout) reads all of it. Greedy output is the target's either way."""
    rt = SpeculativeRuntime.load(disagree_bundle, threads=1, calibrate=False, draft_window=None)
    prompt = [3 + (7 * i) % 90 for i in range(96)]
    alone = rt.generate(prompt, max_new_tokens=24, speculate=False, ignore_eos=True)
    for scout_from, most in ((16, 8 + 24), (1000, 96 + 24)):
        monkeypatch.setattr(drafters, "SCOUT_FROM", scout_from)
        drafter = make_drafter("model", rt.draft, window=None)
        spec = rt.generate(
            prompt, max_new_tokens=24, drafter=drafter, controller="fixed:2", ignore_eos=True
        )
        assert spec.token_ids == alone.token_ids and spec.stats.accepted == 0
        assert (drafter.skip > 0) == (scout_from == 16)
        assert most - 24 < rt.draft.lengths[drafter.slot] <= most, scout_from


def test_greedy_output_is_the_target_alone_through_the_scout(
    agree_bundle, small_scout, monkeypatch
):
    """The agreeing draft after an 80-token prompt, widening at its first kept draft however
    short the answer left (it agrees only where it reads what the target reads, so its scout
    is mostly rejected): the output is the target's before and after, and once widened its
    drafts are all kept."""
    monkeypatch.setattr(drafters, "SCOUT_KEPT", 1)
    monkeypatch.setattr(drafters, "WIDEN_LEFT", 0.0)
    rt = SpeculativeRuntime.load(agree_bundle, threads=1, calibrate=False, draft_window=None)
    rt.costs = flat_costs()
    ids = [3 + (7 * i) % 90 for i in range(80)]
    alone = rt.generate(ids, max_new_tokens=30, speculate=False, ignore_eos=True)
    for controller in ("fixed:3", "adaptive"):
        drafter = make_drafter("model", rt.draft, window=None)
        spec = rt.generate(
            ids, max_new_tokens=30, drafter=drafter, controller=controller, ignore_eos=True
        )
        assert spec.token_ids == alone.token_ids, controller
        if controller == "fixed:3":
            assert drafter.skip == 0  # widened: it reads it all, and then agrees
            assert spec.stats.ks[-4:-1] == [3, 3, 3] and spec.stats.accepted > 10
