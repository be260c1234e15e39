"""Who proposes the drafts: the bundle's draft model, a lookup in the context, or both.

Every drafter answers two questions a round: `offer` (which source would propose now, and at
most how many tokens: a lookup has as many as its match continues, a model as many as asked),
so the controller can price the round before anything runs, then `propose` (up to k tokens,
each with the distribution it was drawn from). A distribution of None is a point mass: the
token was chosen deterministically (greedy drafting, or a lookup), and rejection sampling treats
it as q = one-hot(x), which keeps the target's distribution exactly. `rollback` says how many
tokens of the sequence survived the round. The loop knows no more than this, and one rule: an
offer whose source is "model" is drafted by the drafter's `model` together with every other
request's model draft, one batched draft call per step (`draft_together`, drafting.py); a
lookup proposes alone, for free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from specrt.engines.base import Engine
from specrt.errors import SpecrtError
from specrt.runtime.constraints import Constraints
from specrt.runtime.costs import StepCosts
from specrt.runtime.lookup import lookup
from specrt.runtime.prompt_cache import PromptCache, take_slot
from specrt.runtime.sampling import SamplingParams

DRAFTERS = ("model", "ngram", "hybrid")
SINKS = 4  # a windowed draft keeps the prompt's first tokens (see ModelDrafter.start)
# The most prompt tokens the draft model reads. Measured on the default pair continuing a file
# (docs/generating.md): after 4,000 and 8,000 tokens, a draft reading its last 512 had 78 % and
# 72 % of its drafts accepted, where reading the whole prompt was priced out (K = 0).
DRAFT_WINDOW = 512
# Past SCOUT_FROM tokens the draft reads a prompt's last SCOUT (sinks included) until SCOUT_KEPT
# of its drafts were kept, then its window while the answer left is WIDEN_LEFT times its lag.
SCOUT, SCOUT_FROM, SCOUT_KEPT, WIDEN_LEFT = 32, 256, 8, 1.0
RESUME = 8  # ...and, fallen further behind, what it read and the sequence's last RESUME
LOOK_BACK = 32  # the most tokens a look-back reads (`ModelDrafter.look_back`), and a resume alone
RESUME_READ = 0.75  # ...where reading them costs at most this share of a call (`resume_length`)


@dataclass(frozen=True)
class Offer:
    source: str  # "model", "ngram", ...: what the controller prices this round by
    available: int  # the most tokens it can propose now (0: none this round)
    lag: int = 0  # tokens the draft model's cache must catch up on before it drafts
    unjudged: int = 0  # emitted tokens a look-back would judge (`ModelDrafter.look_back`)
    free_ahead: int = 0  # tokens a free source (a prediction) expects to serve after this one
    prefix: tuple[int, ...] = ()  # free tokens a model proposal starts with (a grammar's forced)


@dataclass(frozen=True)
class View:  # where a draft model reads from this round (see `ModelDrafter._view`)
    skip: int  # the request's tokens after the sinks it does not read
    keep: int  # the draft positions its cache keeps before reading on
    window: bool  # whether that is the window (see `ModelDrafter.start`)


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    probs: list[np.ndarray | None] = field(default_factory=list)  # None: a point mass
    steps: int = 0  # draft model calls it took (a request stops at its K of them)
    guessed: bool | None = None  # its first step's guess at the sequence's last token, judged
    sure: int | None = None  # tokens before its draft was first unsure, drafting on (None: all)

    @property
    def counted(self) -> int:
        """The drafts its policy counts: those it would have drafted alone (see drafting.py's
        `draft_together`: an unsure row drafts on beside a sure one, for free)."""
        return len(self.tokens) if self.sure is None else self.sure


class Drafter(Protocol):
    name: str  # reported in the stats: model, ngram, hybrid, ...
    model: ModelDrafter | None  # the draft model behind "model" offers (None: lookups only)

    def start(self, prompt: Sequence[int], slot: int, cache: PromptCache | None) -> None:
        """A new sequence begins with this prompt, in this slot of the engines (from what the
        prompt cache holds of it for the draft model, see prompt_cache.py; None: empty)."""

    def offer(self, seq: Sequence[int], limit: int) -> Offer:
        """What this drafter can propose after seq, at most limit tokens."""

    def propose(
        self,
        seq: Sequence[int],
        k: int,
        params: SamplingParams,
        rng: np.random.Generator,
        threshold: float,
    ) -> Proposal:
        """Up to k tokens after seq (the last offer's source proposes them). Never asked of a
        "model" offer: the round drafts those by `draft_together`, all requests at once, so
        `ModelDrafter` has no `propose`."""

    def rollback(self, length: int) -> None:
        """Only the first `length` tokens of the sequence survived the round."""


class ModelDrafter:
    """The bundle's draft model, in its own slot of the draft engine. Its cache holds a prefix of
    its own sequence (the request's, or a long prompt's sinks and window and what follows, see
    `start`) and catches up on the rest before drafting, so rounds that another drafter served
    cost it nothing until then."""

    name = "model"

    def __init__(
        self, engine: Engine, ids: int | None = None, window: int | None = None, scout=True
    ):
        """ids: how many token ids the target has logits for, where the two models' logits are
        padded differently past their tokenizer's ids (Qwen2.5 0.5B: 151,936; 7B: 152,064).
        The draft proposes among the ids both have, and is fed a placeholder of its own for a
        token past its logits (a target's padding id: it only moves the next proposals).
        window: the most prompt tokens the draft model reads (None: all); scout: whether a long
        prompt is first read as its last SCOUT tokens (see `start`)."""
        if window is not None and window <= SINKS:
            raise SpecrtError(
                f"a draft window must hold more than the {SINKS} first tokens it keeps, got "
                f"{window}",
                param="draft_window",
            )
        self.engine, self.slot = engine, 0
        self.ids = min(engine.vocab_size, ids or engine.vocab_size)
        self.window, self.scout = window, scout
        self.skip = 0  # tokens after the first SINKS it did not read (all before what it reads on)
        self.wide_skip = 0  # ...once it reads its whole window
        self.kept = 0  # drafts of this request the target kept
        self.drafted_after: int | None = None  # the round's sequence length, if it drafted
        self.offered: View | None = None  # where this round's offer would read from
        self.prompt = 0  # tokens of its request's prompt (the rest were emitted)
        self.resume = RESUME  # the last tokens it reads on from, fallen behind (`resume_length`)
        self.model = self

    def start(self, prompt: Sequence[int], slot: int, cache: PromptCache | None) -> None:
        """Only take the slot, with what a slot already holds of the prompt: the rest is fed
        when a draft is first asked for, so a request that never drafts (K = 0 in a busy batch)
        never pays for the draft model's prefill.

        A prompt longer than the window is read as its first SINKS tokens and its last ones
        (StreamingLLM's attention sinks and recent window, as MagicDec drafts long contexts):
        the draft's catch-up and its steps then cost the same after 8,000 tokens as after 500,
        and its cache holds the window, not the prompt. Only the proposals change; the target
        verifies every one, so no output does. The draft model's positions are its own
        sequence's: the window follows the sinks at once, as StreamingLLM numbers positions
        within its cache.

        A long prompt is first scouted: read as its last SCOUT tokens (sinks included). The
        window's catch-up (1.4-2.2 s on the default pair), paid at the first draft before any
        was judged, was lost where the target mostly rejects them (a summary of a 4,000-token
        file: 0.89-0.94x). The window is offered (`_view`) once SCOUT_KEPT of the scout's drafts
        were kept, while the answer left is WIDEN_LEFT times its lag: its gain (kept: a question
        0.40 against 0.59, completion 0.66 against 0.63) is one no price sees, and offered on
        any answer it was taken on noise (a 1,000-token summary: 2.0-2.3 s of 128 tokens,
        0.75-0.83x). A policy that does not draft at that offer declines it for good."""
        self.slot, self.kept, self.drafted_after, self.offered = slot, 0, None, None
        self.prompt = len(prompt)
        self.wide_skip, self.skip = prompt_skips(len(prompt), self.window, self.scout)
        take_slot(self.engine, slot, self.unread(prompt, 0), cache)

    def unread(self, seq: Sequence[int], held: int | None = None, skip: int | None = None):
        """The draft model's own sequence (seq without the `skip` tokens after the sinks,
        default its own) from its position `held` on (default: what its cache holds)."""
        held = self.engine.lengths[self.slot] if held is None else held
        skip = self.skip if skip is None else skip
        if not skip or held >= SINKS:
            return seq[held + skip :]
        return [*seq[held:SINKS], *seq[SINKS + skip :]]

    def offer(self, seq: Sequence[int], limit: int) -> Offer:
        held = self.engine.lengths[self.slot]
        self.offered = self._view(seq, limit, held)
        view = self.offered or View(self.skip, held, False)
        judged = self._judged(seq, held, self._looking(seq, held))
        return Offer("model", limit, len(seq) - view.skip - view.keep, unjudged=judged)

    def look_back(self, seq: Sequence[int]) -> list[bool]:
        """Read what the draft model has not read (its last LOOK_BACK tokens where a scouted
        long prompt lets it skip the rest), and judge its guess at each emitted token there
        against that token: whether each was kept, in order. With greedy decoding
        a draft is kept exactly where the draft model's greedy guess, after the tokens the
        target emitted, is the token the target emits next, so these are the drafts that
        drafting would have had judged, at the price of the catch-up drafting would pay anyway
        and no wider verify call (a probe widens every row of a batch's call for one draft).
        The round's offer is dropped: a window it offered is neither read nor declined."""
        held = self.engine.lengths[self.slot]
        self.skip = self._looking(seq, held)
        self.offered = None
        feed, judged = self.unread(seq), self._judged(seq, held, self.skip)
        if not judged:
            return []
        last = self.engine.vocab_size - 1
        tokens = [min(token, last) for token in feed]
        logits = self.engine.forward_rows([(self.slot, tokens)], last=judged + 1)[0]
        guesses = logits[:judged, : self.ids].argmax(axis=-1)
        return (guesses == np.asarray(seq[len(seq) - judged :])).tolist()

    def _looking(self, seq: Sequence[int], held: int) -> int:
        """The skip a look-back reads with: its own, or where a scouted long prompt's draft
        model is more than LOOK_BACK tokens behind (past the sinks), one that leaves it the
        last LOOK_BACK. A first look-back at 16 tokens read the scout too, 52 tokens at ~2.4
        ms each for the default draft on an AMX Xeon, 2.5 % of a turn at 4 clients."""
        read = max(held, SINKS)
        if self.scout and self.skip and len(seq) - self.skip - read > LOOK_BACK:
            return len(seq) - LOOK_BACK - read
        return self.skip

    def _judged(self, seq: Sequence[int], held: int, skip: int) -> int:
        """Emitted tokens a look-back reading with `skip` judges: each one read after a token
        it reads in the same run of the request's sequence (past the sinks' seam). Counted,
        not read: every offer asks, and `unread` copies the sequence while the sinks are."""
        run = len(seq) - skip - (max(held, SINKS) if skip else held)
        return max(0, min(run - 1, len(seq) - self.prompt))

    def _view(self, seq: Sequence[int], limit: int, held: int) -> View | None:
        """Where a draft this round would read from (None: it reads on): the window, or, where a
        long prompt's draft model is more than `resume` tokens behind, what it read (sinks,
        scout or window, the answer up to its stop) and the sequence's last `resume`. A new
        scout of the last 16 cost more than a round on an AVX2 EPYC after 4,000 tokens
        (docs/batching.md)."""
        wide = len(seq) - self.wide_skip - min(held, SINKS)  # the sinks, window and what followed
        if self.skip > self.wide_skip and self.kept >= SCOUT_KEPT and limit >= WIDEN_LEFT * wide:
            return View(self.wide_skip, min(held, SINKS), True)
        if self.scout and self.skip and held >= SINKS and len(seq) - self.skip - held > self.resume:
            return View(len(seq) - self.resume - held, held, False)
        return None

    def feed(self, seq: Sequence[int]) -> Sequence[int]:
        """What the draft model reads before this round's first step: where its offer was to
        read the window or to resume, it starts reading that here."""
        if self.offered is not None:
            self.skip = self.offered.skip
            self.engine.rollback(self.offered.keep, self.slot)
        self.drafted_after = len(seq)
        return self.unread(seq)

    def rollback(self, length: int) -> None:
        """Keep the draft's cache to the request's first `length` tokens, count the drafts
        kept, and where the window was offered and not drafted, stay a scout."""
        if self.drafted_after is not None:
            self.kept += max(0, length - self.drafted_after)
            self.drafted_after = None
        elif self.offered is not None and self.offered.window:
            self.wide_skip = self.skip
        self.offered = None
        self.engine.rollback(min(self.engine.lengths[self.slot], length - self.skip), self.slot)


class NgramDrafter:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the last
    n tokens, trying n from max_n down to min_n, in the last `window` tokens of the sequence
    (prompt and output alike). Free to run (about 0.05 ms at 2,048 tokens, measured), and right
    where the output copies its input: edits, refactors, answers quoting a given text."""

    name = "ngram"
    model = None

    def __init__(self, min_n: int = 2, max_n: int = 4, window: int = 4096):
        if not 1 <= min_n <= max_n:
            raise SpecrtError(
                f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}"
            )
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._found: list[int] = []

    def start(self, prompt: Sequence[int], slot: int, cache: PromptCache | None) -> None:
        self._found = []

    def offer(self, seq: Sequence[int], limit: int) -> Offer:
        self._found = lookup(seq[-self.window :], self.min_n, self.max_n, limit)
        return Offer("ngram", len(self._found))

    def propose(self, seq, k, params, rng, threshold) -> Proposal:
        tokens = self._found[:k]
        return Proposal(tokens, [None] * len(tokens))

    def rollback(self, length: int) -> None:
        pass


class HybridDrafter:
    """The lookup when it finds a match (free), the draft model otherwise."""

    name = "hybrid"

    def __init__(self, model: ModelDrafter, ngram: NgramDrafter):
        self.model, self.ngram = model, ngram
        self._current: ModelDrafter | NgramDrafter = model

    def start(self, prompt: Sequence[int], slot: int, cache: PromptCache | None) -> None:
        self.model.start(prompt, slot, cache)
        self.ngram.start(prompt, slot, cache)

    def offer(self, seq: Sequence[int], limit: int) -> Offer:
        offer = self.ngram.offer(seq, limit)
        self._current = self.ngram if offer.available else self.model
        return offer if offer.available else self.model.offer(seq, limit)

    def propose(self, seq, k, params, rng, threshold) -> Proposal:
        return self._current.propose(seq, k, params, rng, threshold)

    def rollback(self, length: int) -> None:
        self.model.rollback(length)


class ConstrainedDrafter:
    """A constrained request's drafter. Where its grammar forces the next tokens (keys, quotes,
    braces, a fixed value), they are drafted for free (SGLang's jump-forward, kept lossless:
    they are verified like any draft): ahead of the draft model's proposal in the same round
    where the model would draft now (`Offer.prefix`), alone otherwise. Elsewhere its own
    drafter proposes: the draft model within the grammar (`DraftJob.constraints`, which also
    appends the tokens forced after each drafted one), a lookup cut where the grammar refuses
    its tokens (a refused token could never be accepted: its constrained probability is 0)."""

    def __init__(self, inner: Drafter | None, constraints: Constraints):
        self.inner, self.constraints = inner, constraints
        self.name = inner.name if inner is not None else "forced"
        self.model = inner.model if inner is not None else None
        self._forced: list[int] = []

    def start(self, prompt: Sequence[int], slot: int, cache: PromptCache | None) -> None:
        if self.inner is not None:
            self.inner.start(prompt, slot, cache)

    def offer(self, seq: Sequence[int], limit: int) -> Offer:
        """The forced tokens, if any: alone, or ahead of the draft model's proposal where the
        model would draft now (one verify call for both); else the drafter's own offer."""
        forced = self.constraints.forced()[: max(0, limit)]
        offer = self.inner.offer(seq, limit) if self.inner is not None else Offer("none", 0)
        self._forced = []
        if forced and offer.source == "model":
            return replace(offer, available=max(0, limit - len(forced)), prefix=tuple(forced))
        if forced:
            self._forced = forced
            return Offer("forced", len(forced))
        return offer

    def propose(self, seq, k, params, rng, threshold) -> Proposal:
        if self._forced:
            tokens = self._forced[:k]
            return Proposal(tokens, [None] * len(tokens))
        proposal = self.inner.propose(seq, k, params, rng, threshold)
        kept = self.constraints.allows(proposal.tokens)
        return Proposal(proposal.tokens[:kept], proposal.probs[:kept])

    def rollback(self, length: int) -> None:
        if self.inner is not None:
            self.inner.rollback(length)


def resume_length(costs: StepCosts, batch: int) -> int:
    """How many of the sequence's last tokens a long prompt's draft model that fell behind reads
    on from (`ModelDrafter.resume`) in a batch of `batch`. Alone, where a probe's draft decides
    whether a request drafts again: LOOK_BACK where reading them, not RESUME, costs at most
    RESUME_READ of a call without drafts, else RESUME. Their gain: measured offline after
    1,000 tokens (4 summaries, 4 questions, a stop at the answer's 10th token and a resume at
    its 20th to 80th), the draft's next 16 guesses were kept 0.48 of the time reading on from
    the last 8, 0.55 from the last 32: ~1.1 tokens more. Their cost is twofold: the reads,
    and the wait they add to every probe back from a stop, whose price they are part of and
    which waits until PROBE_SHARE of its rounds covers it (joint.py's `_shares`): at 3 %, each
    read costing 3 % of a call delays the probe a round. Two machines measured alone after
    1,000 tokens of a summary, the better of the target alone and fixed K = 1, fifteen turns
    each: on an AMX Xeon, whose 24 more reads cost ~0.5-0.6 of a call (~60 ms against
    105-115), the last 32 ran 0.976x where the last 8 ran 0.954x; on a 2-core AVX-512 EPYC,
    whose reads cost ~0.9-1.0 of a call (~74 ms against 70-80), the last 8 ran 0.949x where
    the last 32 ran 0.933x, in the same hour (the probe back came ~12 rounds after the stop
    where it came ~40). The bound sits between them. In a batch, RESUME: there a request
    learns by looking back, which reads its last LOOK_BACK however it resumes, and a start is
    priced with every request's catch-up: resuming from the last 32, 4 clients after 4,000
    tokens of a summary ran 0.97x fixed K = 1 where the last 8 ran 0.99x within the hour (one
    run each: no gain seen, its cold turn drafting from round 63 where the other's did from
    37)."""
    if batch > 1:
        return RESUME
    extra = costs.catch_up_cost(LOOK_BACK) - costs.catch_up_cost(RESUME)
    return LOOK_BACK if extra <= RESUME_READ * costs.verify_cost(1) else RESUME


def prompt_skips(prompt: int, window: int | None, scout: bool = True) -> tuple[int, int]:
    """The tokens of a `prompt`-token prompt past its sinks that a draft model reading `window`
    of it skips: for its window, and for its first read (its scout, where it scouts a long
    prompt; see `ModelDrafter.start`)."""
    wide = max(0, prompt - window) if window else 0
    scouted = scout and prompt - wide > SCOUT_FROM
    return wide, (prompt - SCOUT if scouted else wide)


def make_drafter(
    name,
    draft: Engine | None,
    ids: int | None = None,
    window: int | None = DRAFT_WINDOW,
    scout=True,
) -> Drafter:
    """`model`, `ngram` or `hybrid` over the bundle's draft engine (None: target-only); window
    and scout: what the draft model reads of a long prompt (see `ModelDrafter.start`).

    Anything else is taken as a drafter already (with `start`, `offer`, `propose`,
    `rollback`; one per request, since drafters keep per-request state)."""
    if not isinstance(name, str):
        return name
    if name not in DRAFTERS:
        raise SpecrtError(
            f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}", param="drafter"
        )
    if name == "ngram":
        return NgramDrafter()
    if draft is None:
        raise SpecrtError(
            f"drafter {name!r} needs a draft model, and this bundle has none (built without "
            "--draft); use the ngram drafter",
            param="drafter",
        )
    model = ModelDrafter(draft, ids, window, scout)
    return model if name == "model" else HybridDrafter(model, NgramDrafter())
