"""The speculative decoding loop: draft K, verify K+1 in one target call, accept, roll back.

Invariant between rounds: `seq` holds the prompt and every emitted token; the target's cache
holds all of seq but the last token (which the next verify call feeds first); the draft's cache
holds a prefix of seq and catches up on the rest before drafting. After n of K drafts survive,
the target keeps exactly seq + those n tokens and the draft never keeps a token that was not
emitted. The loop yields the tokens each round emits; the caller decides when to stop (EOS,
stop strings, budget) and simply stops iterating.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from specrt.engines.base import Engine
from specrt.runtime.acceptance import verify_greedy, verify_sampled
from specrt.runtime.controller import RoundContext
from specrt.runtime.sampling import SamplingParams, probabilities, sample


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
    drafted_counts: list[int] = field(default_factory=list)  # per round (< K if the draft stopped)
    accepted_counts: list[int] = field(default_factory=list)  # per round


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    max_new_tokens: int
    rng: np.random.Generator
    load: int = 0


def _propose(logits: np.ndarray, req: Request, threshold: float):
    """The draft's token, the distribution it was drawn from (None when greedy), and the
    draft's confidence: the top probability of that distribution (1.0 when not asked for)."""
    if req.params.greedy:
        confidence = 1.0
        if threshold > 0:
            shifted = np.exp(logits - logits.max())
            confidence = float(1.0 / shifted.sum())
        return int(logits.argmax()), None, confidence
    probs = probabilities(logits, req.params)
    return sample(probs, req.rng), probs, float(probs.max())


def speculate(
    draft: Engine | None, target: Engine, req: Request, controller, stats: LoopStats
) -> Iterator[list[int]]:
    """Yield each round's emitted tokens. With draft=None the target decodes alone."""
    target.reset()
    start = time.perf_counter()
    logits = target.forward(req.prompt, last=1)
    stats.target_calls += 1
    first, _, _ = _propose(logits[0], req, threshold=0.0)
    stats.prefill_seconds = time.perf_counter() - start
    seq = [*req.prompt, first]
    yield [first]
    if draft is not None:  # here, so that round timings measure draft steps, not a prefill
        start = time.perf_counter()
        draft.reset()
        draft.forward(req.prompt, last=1)
        stats.prefill_seconds += time.perf_counter() - start
    produced = 1
    while produced < req.max_new_tokens:
        # K + 1 tokens go to the target, whose cache holds len(seq) - 1 already.
        room = min(req.max_new_tokens - produced - 1, target.capacity - len(seq))
        if room < 0:
            return  # the context is full: the caller reports it
        k_max = 0 if draft is None else room
        decision = controller.decide(RoundContext(k_max=k_max, position=len(seq), load=req.load))
        stats.ks.append(decision.k)
        stats.reasons.append(decision.reason)

        t0 = time.perf_counter()
        drafts, draft_probs = [], []
        if decision.k > 0:
            logits = draft.forward(seq[draft.length :], last=1)[0]
            while True:
                token, probs, confidence = _propose(logits, req, controller.confidence_threshold)
                if drafts and confidence < controller.confidence_threshold:
                    break  # the draft is unsure: verifying now beats drafting on
                drafts.append(token)
                draft_probs.append(probs)
                if len(drafts) == decision.k:
                    break
                logits = draft.forward([token])[0]
        t1 = time.perf_counter()
        logits = target.forward([seq[-1], *drafts])
        if req.params.greedy:
            accepted, extra = verify_greedy(drafts, logits)
        else:
            accepted, extra = verify_sampled(drafts, draft_probs, logits, req.params, req.rng)
        t2 = time.perf_counter()

        emitted = [*drafts[:accepted], extra]
        target.rollback(len(seq) + accepted)
        if draft is not None:
            draft.rollback(min(draft.length, len(seq) + accepted))
        seq.extend(emitted)
        produced += len(emitted)
        controller.observe(len(drafts), accepted, t1 - t0, t2 - t1)
        stats.rounds += 1
        stats.target_calls += 1
        stats.drafted += len(drafts)
        stats.accepted += accepted
        stats.drafted_counts.append(len(drafts))
        stats.accepted_counts.append(accepted)
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        yield emitted
