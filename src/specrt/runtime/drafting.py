"""The draft model's batched call: every request that drafts with the model this round, in one
call of the draft engine per step (`draft_together`), and the same calls priced on the cost
curve instead of a clock (`draft_seconds`, the replay's round). Which source proposes, and where
a draft model reads from, is drafters.py's; this module only runs the model rows it is given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrt.runtime.constraints import Constraints
from specrt.runtime.costs import StepCosts
from specrt.runtime.drafters import ModelDrafter, Proposal
from specrt.runtime.sampling import SamplingParams, draw

CATCH_UP = 4  # a draft cache further behind catches up in a call of its own


@dataclass
class DraftJob:
    """One request's part in a batched draft."""

    drafter: ModelDrafter
    seq: Sequence[int]  # the sequence to draft after
    k: int  # draft model steps at most
    params: SamplingParams
    rng: np.random.Generator
    threshold: float = 0.0  # stop once the draft's top probability falls below
    # The draft samples within them, and the tokens a grammar forces after a drafted token
    # join the proposal for free, up to room tokens in all (default k).
    constraints: Constraints | None = None
    room: int | None = None
    prefix: Sequence[int] = ()  # free tokens the proposal starts with, before any model step

    @property
    def limit(self) -> int:
        """The most tokens its proposal may hold."""
        return len(self.prefix) + self.k if self.room is None else self.room


Steps = list[tuple[int, float]]  # per draft call: its rows (padding included), seconds


def draft_together(jobs: Sequence[DraftJob]) -> tuple[list[Proposal], Steps]:
    """Up to k tokens after each job's sequence, one batched call of the draft model per step.
    A request whose draft is done (k steps, its room) sits out the remaining steps, and the
    drafts end where every row of a step is unsure (its top probability under its threshold:
    verifying now beats drafting on). An unsure row drafts on beside a sure one: the batch
    pays for that step and for a verify call as wide as its widest row anyway, and its policy
    counts only the drafts it was sure of (`Proposal.counted`): priced on every draft, 2
    clients replayed on short prompts lowered their estimate on the extra ones and stopped
    (0.93x the best fixed K, 0.96x before). Where each unsure row stopped alone, adaptive's
    rounds at K = 2 after 8,000 tokens at 4 clients kept a second draft after a kept first
    0.51 of the time, fixed K = 2's (no threshold) 0.61: 1.94 tokens a request a round
    against 1.99.

    Its first step feeds each request what the draft model has not read yet (a request far
    behind catches up first, in a call of its own, which is not a step); where it feeds two
    tokens or more, that step also judges the draft's guess at the last (`Proposal.guessed`:
    after a round that kept every draft, the target's bonus token, whose guess no draft
    judged), from logits the call computes anyway wherever its rows differ in width.
    Constraints end where they began: drafting walks them ahead and steps them back. Also
    returns each call's rows and seconds (the catch-ups', then each step's), which refine the
    draft model's cost curve: a catch-up is priced on that curve (`StepCosts.catch_up_cost`),
    and calibration measures it only up to 33 tokens, from which a window's 512 were priced
    25 % dear on the default draft. A step's seconds include drawing its tokens (a softmax
    over the vocabulary per row, for the confidence): timed around the call alone, the curve
    left out host work that drafting pays every step."""
    engine, ids = jobs[0].drafter.engine, jobs[0].drafter.ids
    last = engine.vocab_size - 1
    proposals = [Proposal(list(job.prefix), [None] * len(job.prefix)) for job in jobs]
    bases = [job.constraints.position if job.constraints else 0 for job in jobs]
    for job in jobs:
        if job.constraints is not None:
            job.constraints.advance(job.prefix)
    feeds = {
        i: [min(token, last) for token in [*job.drafter.feed(job.seq), *job.prefix]]
        for i, job in enumerate(jobs)
        if job.k
    }
    steps: Steps = []
    for i, feed in feeds.items():
        if ahead := catch_up_tokens(len(feed), len(feeds)):
            start = time.perf_counter()
            engine.forward_rows([(jobs[i].drafter.slot, feed[:ahead])], last=1)
            steps.append((ahead, time.perf_counter() - start))
            feeds[i] = feed[ahead:]
    judging = {i for i, feed in feeds.items() if 1 < len(feed) <= CATCH_UP and _judges(jobs[i])}
    while feeds:
        calls = [(jobs[i].drafter.slot, feed) for i, feed in feeds.items()]
        width = max(len(feed) for feed in feeds.values())
        start = time.perf_counter()
        rows = engine.forward_rows(calls, last=None if judging else 1)
        drawn = {
            i: _draw(jobs[i], proposals[i], logits, ids, i in judging)
            for i, logits in zip(list(feeds), rows, strict=True)
        }
        _take(jobs, proposals, feeds, drawn)
        steps.append((len(calls) * width, time.perf_counter() - start))  # draws included
        judging = set()
    for job, base in zip(jobs, bases, strict=True):
        if job.constraints is not None:
            job.constraints.rollback_to(base)
    return proposals, steps


def _take(jobs, proposals: list[Proposal], feeds: dict, drawn: dict) -> None:
    """Add a step's drawn tokens to their proposals and what each row reads next to `feeds`
    (a row whose draft is done leaves them); where every row is unsure, every row leaves."""
    if all(_unsure(jobs[i], proposals[i], confidence) for i, (_, _, confidence) in drawn.items()):
        feeds.clear()
        return
    for i, (token, probs, confidence) in drawn.items():
        job, proposal = jobs[i], proposals[i]
        if _unsure(job, proposal, confidence) and proposal.sure is None:
            proposal.sure = len(proposal.tokens)
        proposal.tokens.append(token)
        proposal.probs.append(probs)
        proposal.steps += 1
        feeds[i] = [token, *_follow(job, proposal, token)]
        ended = job.constraints is not None and token in job.constraints.eos
        if ended or proposal.steps == job.k or len(proposal.tokens) >= job.limit:
            del feeds[i]


def _unsure(job: DraftJob, proposal: Proposal, confidence: float) -> bool:
    """Whether a row's drawn token is unsure: under its threshold, after its first."""
    return bool(proposal.tokens) and confidence < job.threshold


def _draw(job: DraftJob, proposal: Proposal, logits, ids: int, judging: bool):
    """A job's token from its rows of a step (token, distribution, confidence), within its
    constraints, and where the step judges (`_judges`), its guess at its last token before."""
    if judging:
        proposal.guessed = bool(logits[-2, :ids].argmax() == job.seq[-1])
    row = logits[-1, :ids]
    if job.constraints is not None:
        row = job.constraints.apply(row)
    return draw(row, job.params, job.rng, job.threshold)


def _judges(job: DraftJob) -> bool:
    """Whether the first step judges the draft's guess at the job's last token (the one it
    reads after the token before, both in its first feed): greedy and unconstrained, where a
    guess is kept exactly where it is the target's token (`Proposal.guessed`)."""
    return job.params.greedy and job.constraints is None and not job.prefix


def catch_up_tokens(feed: int, rows: int) -> int:
    """Tokens of a request's first feed the draft model reads in a call of its own before the
    first step (all but the last, where it is longer than CATCH_UP and the step has other
    rows), so that no other row of the batched step is padded to a long feed. A step of one
    row reads it all: a call of its own would buy nothing and cost a call. Alone after a stop,
    the 8 tokens a resume reads took the default draft 44 ms in two calls on a 2-core AVX-512
    EPYC (300 tokens in its cache), 30 ms in one: a probe's price, paid for every ~15 rounds
    of waiting, and already priced as one call (`StepCosts.catch_up_cost`)."""
    return feed - 1 if feed > CATCH_UP and rows > 1 else 0


def draft_seconds(drafts: Sequence[tuple[int, int]], costs: StepCosts) -> float:
    """The seconds of the calls `draft_together` makes, priced on the cost curve instead of a
    clock (the replay's round): per drafting request (its first feed, the steps it takes), the
    catch-ups in calls of their own, then one batched call a step, the first padded to its
    widest feed. Kept beside draft_together so that the two cannot drift apart."""
    if not drafts:
        return 0.0

    def call(rows: int) -> float:
        return costs.draft_cost("model", 1, rows)

    rows = len(drafts)
    seconds = sum(call(ahead) for feed, _ in drafts if (ahead := catch_up_tokens(feed, rows)))
    seconds += call(rows * max(feed - catch_up_tokens(feed, rows) for feed, _ in drafts))
    for s in range(1, max(steps for _, steps in drafts)):
        seconds += call(sum(1 for _, steps in drafts if steps > s))
    return seconds


def _follow(job: DraftJob, proposal: Proposal, token: int) -> list[int]:
    """Walk a job's constraints over its drafted token, then over the tokens its grammar forces
    next, which join the proposal as point masses (free drafts, verified like any other)."""
    constraints = job.constraints
    if constraints is None or token in constraints.eos:
        return []
    constraints.advance([token])
    forced = constraints.forced()[: max(0, job.limit - len(proposal.tokens))]
    constraints.advance(forced)
    proposal.tokens.extend(forced)
    proposal.probs.extend([None] * len(forced))
    return forced
