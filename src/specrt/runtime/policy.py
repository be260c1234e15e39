"""What a policy sees of a round and answers, and the protocol a policy follows: the seam
between the loop and the controllers (fixed, heuristic, adaptive, or a caller's own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RoundContext:
    room: int  # the most drafts this request can take this round: its offer, budget, context
    position: int  # tokens in the sequence so far (prompt + emitted)
    remaining: int  # tokens its drafter may still serve: the budget or context room, less
    # what a free source (a prediction) expects to serve, for free, after this round
    source: str = "model"  # who drafts this round: "model", "ngram", ... (see drafters)
    lag: int = 0  # tokens the draft model must catch up on before it drafts (model rounds)
    unjudged: int = 0  # emitted tokens a look-back would judge now...
    can_look: bool = False  # ...where it can look back at all (greedy, unconstrained, a model)
    emitted: int = 0  # tokens of its answer so far


@dataclass(frozen=True)
class Decision:
    k: int
    reason: str
    look_back: bool = False  # at K = 0: the draft model reads and is judged (see `Policy`)


class Policy(Protocol):
    """What picks one request's K: a decision a round, then what that round accepted (of the
    drafts of `source`, the offer the round was decided for).

    `together`: in a batch, its K is chosen with the batch's other such policies, priced as
    one round (joint.py's `decide_together`); otherwise it decides alone, before them, and
    they know its K.

    A decision may ask a request at K = 0 to look back (`RoundContext.can_look`): its draft
    model then reads what it has not, and its guesses at the emitted tokens there are judged,
    as drafting would have had them judged (drafters.py's `ModelDrafter.look_back`). A policy
    that asks is told what was judged by `looked_back(guesses, source)`: whether each guess
    was kept, in order. A policy with a `bonus(kept, source)` method is told, before a
    round's `observe`, whether the draft model's guess at the token the target added after its
    last round's drafts, all kept, was that token (greedy, unconstrained; runs.py prices each
    K by such guesses in order).
    `observe` counts the drafts its request would have drafted alone: in a batch an unsure
    draft drafts on beside a sure one, uncounted (drafting.py's `draft_together`)."""

    together: bool
    confidence_threshold: float  # its draft stops where the draft's top probability is below

    def decide(self, ctx: RoundContext) -> Decision: ...
    def observe(self, k: int, accepted: int, source: str) -> None: ...
