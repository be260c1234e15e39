"""The speculative decoding loop: draft K, verify K+1 in one target call, accept, roll back.

Invariant between rounds: `seq` holds the prompt and every emitted token; the target's cache
holds all of seq but the last token (which the next verify call feeds first); a drafter with a
cache (the draft model) holds a prefix of seq and catches up on the rest before drafting. After
n of K drafts survive, the target keeps exactly seq + those n tokens and no drafter keeps a token
that was not emitted. Which drafter proposes (a model, a lookup) is the drafter's business: the
loop asks it for an offer, lets the controller pick K within it, and verifies what it proposes.
The loop yields the tokens each round emits; the caller decides when to stop (EOS, stop strings,
budget) and simply stops iterating.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from specrt.engines.base import Engine
from specrt.runtime.acceptance import verify_greedy, verify_sampled
from specrt.runtime.controller import Decision, RoundContext
from specrt.runtime.drafters import Drafter, Offer, Proposal, draw
from specrt.runtime.sampling import SamplingParams


@dataclass
class LoopStats:
    """What the loop measured; the API adds timing of the whole request around it."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    ks: list[int] = field(default_factory=list)  # per round: the K the controller chose
    reasons: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per round: model, ngram, none
    drafted_counts: list[int] = field(default_factory=list)  # per round (< K if the draft stopped)
    accepted_counts: list[int] = field(default_factory=list)  # per round

    def record(
        self, decision: Decision, source: str, drafted: int, accepted: int, draft_s, verify_s
    ) -> None:
        """One round's counts and times."""
        self.rounds += 1
        self.target_calls += 1
        self.drafted += drafted
        self.accepted += accepted
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        self.ks.append(decision.k)
        self.reasons.append(decision.reason)
        self.sources.append(source if drafted else "none")
        self.drafted_counts.append(drafted)
        self.accepted_counts.append(accepted)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    rng: np.random.Generator
    load: int = 0


def speculate(
    drafter: Drafter | None, target: Engine, req: Request, controller, stats: LoopStats
) -> Iterator[list[int]]:
    """Yield each round's emitted tokens. With drafter=None the target decodes alone."""
    target.reset()
    start = time.perf_counter()
    logits = target.forward(req.prompt, last=1)
    stats.target_calls += 1
    first, _, _ = draw(logits[0], req.params, req.rng, threshold=0.0)
    stats.prefill_seconds = time.perf_counter() - start
    seq = [*req.prompt, first]
    yield [first]
    if drafter is not None:  # here, so that round timings measure draft steps, not a prefill
        start = time.perf_counter()
        drafter.start(req.prompt)
        stats.prefill_seconds += time.perf_counter() - start
    produced = 1
    while produced < req.max_new_tokens:
        # K + 1 tokens go to the target, whose cache holds len(seq) - 1 already.
        room = min(req.max_new_tokens - produced - 1, target.capacity - len(seq))
        if room < 0:
            return  # the context is full: the caller reports it
        t0 = time.perf_counter()
        offer = drafter.offer(seq, room) if drafter is not None else Offer("none", 0)
        context = RoundContext(offer.available, len(seq), req.load, offer.source)
        decision = controller.decide(context)
        proposal = Proposal()
        if decision.k > 0:
            threshold = controller.confidence_threshold
            proposal = drafter.propose(seq, decision.k, req.params, req.rng, threshold)
        drafts = proposal.tokens
        t1 = time.perf_counter()
        logits = target.forward([seq[-1], *drafts])
        if req.params.greedy:
            accepted, extra = verify_greedy(drafts, logits)
        else:
            accepted, extra = verify_sampled(drafts, proposal.probs, logits, req.params, req.rng)
        t2 = time.perf_counter()

        emitted = [*drafts[:accepted], extra]
        target.rollback(len(seq) + accepted)
        if drafter is not None:
            drafter.rollback(len(seq) + accepted)
        seq.extend(emitted)
        produced += len(emitted)
        controller.observe(len(drafts), accepted, t1 - t0, t2 - t1)
        stats.record(decision, offer.source, len(drafts), accepted, t1 - t0, t2 - t1)
        yield emitted
