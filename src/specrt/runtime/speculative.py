"""The speculative round for a batch: draft K per request, verify every request in one target
call, accept per request, roll each back to its own length.

Invariant between rounds, per request (a `Sequence`): `tokens` holds the prompt and every
emitted token; the target's slot holds all of them but the last (which the next verify call
feeds first); a drafter with a cache (the draft model) holds a prefix of them and catches up on
the rest before drafting. After n of a request's K drafts survive, its target slot keeps exactly
its tokens + those n, and no drafter keeps a token that was not emitted. Requests in one round
share nothing but the calls: each has its own K (within what the policies decide together),
sampling parameters, random stream and drafter, and its rows never see another's (per-row cache
positions), so its output is what it would be alone. Timing stays here only as far as the cost
model needs it; stopping, text and statistics belong to the caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specrt.engines.base import Engine
from specrt.runtime.acceptance import verify_greedy, verify_sampled
from specrt.runtime.costs import StepCosts
from specrt.runtime.drafters import Offer, Proposal, resume_length
from specrt.runtime.drafting import DraftJob, Steps, draft_together
from specrt.runtime.joint import decide_round
from specrt.runtime.logprobs import TokenLogprob, token_logprobs
from specrt.runtime.policy import Decision, RoundContext
from specrt.runtime.prompt_cache import take_slot
from specrt.runtime.sampling import draw
from specrt.runtime.sequence import Sequence

NONE = Offer("none", 0)  # a request without a drafter: the target alone


@dataclass
class Round:
    """What one round did, per request (in the order given) and for the batch."""

    decisions: list[Decision]
    sources: list[str]  # who drafted: model, ngram, ... or none
    drafted: list[int]
    accepted: list[int]
    emitted: list[list[int]]
    draft_seconds: float
    verify_seconds: float
    logprobs: list[list[TokenLogprob]]  # per request that asked: one per emitted token

    def origins(self, i: int) -> list[str]:
        """Who made each token request i emitted: its accepted drafts (the draft model or a
        lookup: draft; the client's prediction), then the target's own token."""
        made = "prediction" if self.sources[i] == "prediction" else "draft"
        return [made] * self.accepted[i] + ["target"]


def start(req: Sequence, target: Engine) -> int:
    """Give a request its slot, keeping what a slot already holds of its prompt (see
    prompt_cache.py; `prefill` feeds the rest), and its drafter the same slot. Returns how
    many prompt tokens were kept."""
    cached = take_slot(target, req.slot, req.prompt, req.prompt_cache)
    if req.drafter is not None:
        req.drafter.start(req.prompt, req.slot, req.prompt_cache)
    return cached


def prefill(
    req: Sequence, target: Engine, chunk: int | None = None
) -> tuple[int, list[TokenLogprob]] | None:
    """Feed the next `chunk` tokens of a started request's prompt (default: all that are left)
    in a call of its own. Once the last is in, draw the first token from its logits and return
    it (and its log-probability where the request asked); None while the prompt goes on."""
    fed = target.lengths[req.slot]
    end = len(req.prompt) if chunk is None else min(len(req.prompt), fed + chunk)
    logits = target.forward_rows([(req.slot, req.prompt[fed:end])], last=1)[0]
    if end < len(req.prompt):
        return None
    if req.constraints is not None:
        logits = req.constraints.apply_rows(logits, [])
    first, _, _ = draw(logits[0], req.params, req.rng, threshold=0.0)
    if req.constraints is not None:
        req.constraints.close_round([first])
    req.tokens.append(first)
    return first, _logprobs(req, logits, [first])


def speculate(reqs: list[Sequence], target: Engine, costs: StepCosts) -> Round:
    """One round for every request given (each must have room >= 0)."""
    t0 = time.perf_counter()
    rooms = [r.room(target.capacity) for r in reqs]
    _set_resume(reqs, costs)
    offers = [
        r.drafter.offer(r.tokens, room) if r.drafter else NONE
        for r, room in zip(reqs, rooms, strict=True)
    ]
    contexts = [
        RoundContext(
            o.available,
            len(r.tokens),
            max(1, room + 1 - o.free_ahead),
            o.source,
            o.lag,
            o.unjudged,
            o.source == "model" and r.params.greedy and r.constraints is None,
            r.produced,
        )
        for r, o, room in zip(reqs, offers, rooms, strict=True)
    ]
    decisions = decide_round([r.policy for r in reqs], contexts, costs)
    proposals, steps, looks = _propose(reqs, offers, decisions, rooms)
    t1 = time.perf_counter()
    logits = target.forward_rows(
        [(r.slot, [r.tokens[-1], *p.tokens]) for r, p in _pairs(reqs, proposals)]
    )
    t2 = time.perf_counter()
    accepted, emitted, logprobs = [], [], []
    for r, p, o, scores in zip(reqs, proposals, offers, logits, strict=True):
        n, kept, entries = _accept(r, p, scores, target)
        if p.guessed is not None and hasattr(r.policy, "bonus"):
            r.policy.bonus(p.guessed, o.source)  # the guess before this round's, in order
        r.policy.observe(p.counted, min(n, p.counted), o.source)
        accepted.append(n)
        emitted.append(kept)
        logprobs.append(entries)
    for i, guesses in looks.items():
        reqs[i].policy.looked_back(guesses, offers[i].source)
    drafted = [len(p.tokens) for p in proposals]
    context = sum(c.position for c in contexts) / len(contexts)
    _observe_costs(costs, drafted, steps, t2 - t1, context)
    sources = [o.source if n else "none" for o, n in _pairs(offers, drafted)]
    return Round(decisions, sources, drafted, accepted, emitted, t1 - t0, t2 - t1, logprobs)


def _set_resume(reqs: list[Sequence], costs: StepCosts) -> None:
    """Tell each request's draft model how far back it reads on from where it fell behind:
    alone, its call and the draft's reads price it; in a batch, the last RESUME
    (`drafters.resume_length`)."""
    if not costs.ready_for("model"):
        return
    resume = resume_length(costs, len(reqs))
    for r in reqs:
        if r.drafter is not None and r.drafter.model is not None:
            r.drafter.model.resume = resume


def _accept(r: Sequence, p: Proposal, scores, target: Engine) -> tuple:
    """Verify one request's drafts against its rows (processed at their positions where it is
    constrained), keep the accepted ones and the target's token, and roll the target's slot
    and the drafter back to them: how many drafts were kept, the tokens emitted, and their
    log-probabilities where asked."""
    if r.constraints is not None:
        scores = r.constraints.apply_rows(scores, p.tokens)
    if r.params.greedy:
        n, extra = verify_greedy(p.tokens, scores)
    else:
        n, extra = verify_sampled(p.tokens, p.probs, scores, r.params, r.rng)
    target.rollback(len(r.tokens) + n, r.slot)
    if r.drafter is not None:
        r.drafter.rollback(len(r.tokens) + n)
    kept = [*p.tokens[:n], extra]
    if r.constraints is not None:
        r.constraints.close_round(kept)
    r.tokens.extend(kept)
    return n, kept, _logprobs(r, scores, kept)


def _logprobs(req: Sequence, rows, tokens: list[int]) -> list[TokenLogprob]:
    """The emitted tokens' log-probabilities from the target's (processed) rows, if asked."""
    if req.logprobs is None:
        return []
    return token_logprobs(rows[: len(tokens)], tokens, req.logprobs)


def _pairs(first: list, second: list):
    return zip(first, second, strict=True)


def _draft_job(r: Sequence, k: int, room: int, offer: Offer) -> DraftJob:
    threshold = r.policy.confidence_threshold
    model = r.drafter.model
    return DraftJob(
        model, r.tokens, k, r.params, r.rng, threshold, r.constraints, room, offer.prefix
    )


def _propose(reqs: list[Sequence], offers: list[Offer], decisions: list[Decision], rooms):
    """Each request's drafts (lookups alone, model drafts for all requests together), what
    the draft model's calls took (see `draft_together`), and by request, what its look-back
    judged (whether each guess was kept, in order)."""
    proposals = [Proposal() for _ in reqs]
    together, steps, looks = [], [], {}
    for i, (r, offer, decision) in enumerate(zip(reqs, offers, decisions, strict=True)):
        if offer.source == "model" and (decision.k or offer.prefix):
            together.append(i)
        elif decision.look_back and offer.source == "model":
            looks[i] = r.drafter.model.look_back(r.tokens)
        elif decision.k:
            threshold = r.policy.confidence_threshold
            proposals[i] = r.drafter.propose(r.tokens, decision.k, r.params, r.rng, threshold)
    if together:
        jobs = [_draft_job(reqs[i], decisions[i].k, rooms[i], offers[i]) for i in together]
        drafted, steps = draft_together(jobs)
        for i, proposal in zip(together, drafted, strict=True):
            proposals[i] = proposal
    return proposals, steps, looks


def _observe_costs(costs, drafted, steps: Steps, verify_s: float, context: float) -> None:
    """Refine the cost curves with what this round's calls took: the verify call, at its
    rows' mean context, and each call of the draft model (catch-ups and batched steps) by its
    rows (forced tokens and lookups cost it nothing)."""
    costs.observe_verify(len(drafted) * (max(drafted) + 1), verify_s, context, len(drafted))
    for rows, seconds in steps:
        costs.observe_draft(rows, seconds)
