"""How many tokens to draft each round: `fixed:K`, `heuristic`, or `adaptive` (the default).

A controller sees what the loop measured (accepted counts) and the round's signals (what the
drafter offers, budget and context room, the batch), and answers with K and a reason, so every
choice is explainable in the stats.

The adaptive policy maximises expected tokens per second for the whole batch. With per-token
acceptance α, a request drafting K tokens emits E = (1 - α^(K+1)) / (1 - α) tokens a round; a
round of B requests costs the draft steps for the rows that draft plus one verify call of
B·(K+1) rows. α is each request's recent drafts, shrunk toward what its runtime's other
requests accepted (`PooledAcceptance`), while both cost curves come from `StepCosts`, measured
on this machine and shared across requests (costs belong to the machine, acceptance to the
request).
K = 0 (the target alone) is a choice like any other: as the batch grows, the verify call turns
compute-bound and extra rows stop being free (SmartSpec, Liu et al. 2024, picks K from 0 per
round the same way). At batch 1 this is the single-stream policy. The arithmetic of a round's
price is pricing.py's; how a batch's requests choose it together, joint.py's. What a policy
sees and answers, and the protocol it follows, are policy.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.costs import StepCosts
from specrt.runtime.joint import PROBE_BANK, decide_together
from specrt.runtime.policy import Decision, RoundContext
from specrt.runtime.pool import DOUBT_AFTER, PooledAcceptance, fade_in, wilson
from specrt.runtime.runs import PART_AFTER

# After a long prompt, an answer's first OPENING tokens are counted apart in its runtime's pool:
# over 40 recorded answers (tests/data/acceptance-long-prompts.json) the draft's guesses there
# were kept 0.52 of the time, and after them 0.62 (see `Adaptive.locate`).
OPENING = 32


class Fixed:
    """Always K (capped by what the round has room for)."""

    together = False
    confidence_threshold = 0.0

    def __init__(self, k: int):
        self.k = k

    def decide(self, ctx: RoundContext) -> Decision:
        k = min(self.k, ctx.room)
        return Decision(k, "fixed" if k == self.k else f"fixed, capped to room {ctx.room}")

    def observe(self, k: int, accepted: int, source: str = "model") -> None:
        pass


class Heuristic:
    """transformers' rule: +2 after a round where every draft was accepted, -1 otherwise."""

    together = False
    confidence_threshold = 0.0

    def __init__(self, k_min: int = 1, k_max: int = 8, start: int = 4):
        self.k_min, self.k_max, self.k = k_min, k_max, start

    def decide(self, ctx: RoundContext) -> Decision:
        k = min(self.k, ctx.room)
        return Decision(k, f"heuristic K={self.k}" + ("" if k == self.k else f", room {k}"))

    def observe(self, k: int, accepted: int, source: str = "model") -> None:
        if k == 0:
            return
        step = 2 if accepted == k else -1
        self.k = int(np.clip(self.k + step, self.k_min, self.k_max))


@dataclass
class Adaptive:
    """Pick K maximising expected tokens per second from measured acceptance and costs.

    Acceptance is kept per draft source (the draft model, a lookup), since one request may be
    served by both and they accept very differently; a source's draft cost is K model steps,
    or nothing for a lookup (see `StepCosts`). Its K has three ceilings, each named: `k_model`
    for the draft model's drafts, `k_free` for free ones (a lookup, a prediction: bounded by the
    verify curve only), and the round's `RoundContext.room`. In a batch, the adaptive requests
    choose together (`decide_together`): one K for model drafts, one for free ones; alone,
    `decide` is that choice for a batch of one.
    """

    together = True
    k_min: int = 0
    k_model: int = 8  # drafts from the draft model at most (the bundle's K_max)
    k_free: int = 8  # free drafts at most
    decay: float = 0.95  # per observed token: a request's own drafts weigh its last ~20
    history: float = 0.99  # ...and its long run, the base they are shrunk toward, its last ~100
    prior_alpha: float = 0.7  # the base of its estimate until its runtime's pool is warm
    pool_weight: float = 8.0  # drafts' worth of that base behind every estimate (see `alpha`)
    confidence_threshold: float = 0.4  # stop drafting when the draft's top probability is below
    long_context: int = 1024  # past this many tokens, K is halved (attention starts to cost)
    costs: StepCosts = field(default_factory=StepCosts)  # shared by the runtime's requests
    pool: PooledAcceptance | None = None  # shared too: where a source's estimate starts
    counts: dict[str, list[float]] = field(init=False, default_factory=dict)  # [acc., rej.]
    record: dict[str, list[float]] = field(init=False, default_factory=dict)  # its long run
    idle: int = field(init=False, default=0)  # rounds in a row without drafting
    bank: float = field(init=False, default=0.0)  # rounds a probe may spend a share of
    last_k: int | None = field(init=False, default=None)  # drafts of its last round
    probing: bool = field(init=False, default=False)  # its last decision was a probe
    probed: bool = field(init=False, default=False)  # ...and its last round (observed)
    member: int | None = field(init=False, default=None)  # its key in the pool
    part: str | None = field(init=False, default=None)  # of its answer, after a long prompt
    counted_at: int = field(init=False, default=0)  # drafts of its last counted round (0: looked)

    def __post_init__(self) -> None:
        self.member = self.pool.member() if self.pool is not None else None

    def alpha(self, source: str = "model") -> float:
        """Acceptance per drafted token: the geometric MLE over this request's recent (decayed)
        drafts and `pool_weight` drafts at its base (`_base`: its own long run, itself shrunk
        toward its runtime's pool). The base's share never fades: priced from a request's last
        ~20 drafts alone, K followed lucky streaks up and single rejections down to K = 0 (2
        clients, gguf target: 0.91x the best fixed K; shrunk, 1.00x). It never exceeds what the
        request's own drafts allow (`ceiling`): a request whose drafts were all rejected
        drafted 39 rounds at a loss while the pool's share held it up (replayed)."""
        shrunk = self._shrunk(self.counts.get(source, (0.0, 0.0)), self._base(source))
        return min(shrunk, self.ceiling(source))

    def ceiling(self, source: str = "model") -> float:
        """The highest acceptance this request's own (decayed) drafts make plausible: their
        one-sided 84 % Wilson bound, once DOUBT_AFTER were judged (1 before). Five drafts
        rejected in a row bound it near 0.2; a lucky streak never raises the estimate (the
        pool's share holds it down)."""
        return wilson(self.counts.get(source, (0.0, 0.0)), 1.0)

    def floor(self, source: str = "model") -> float:
        """The lowest acceptance its own drafts make plausible: their one-sided 84 % Wilson
        bound (0 before DOUBT_AFTER were judged), at most its estimate. What joint.py's
        `_keep_course` prices a start of drafting at where the batch learns by looking back:
        after a long prompt, an answer's opening is often the part the draft guesses best (a
        first look-back kept 6 of 8 guesses where the answer's next 100 kept 0.5), and started
        on its estimate, 4 clients after 1,000 tokens drafted 20 rounds at 0.55-0.6 where
        drafting paid from 0.62 (0.93x the target alone). Its runtime's pool bounds it too
        (every request's judged drafts, its own among them): bounded by its own 16 judged
        alone (at 0.5, 0.37) and asked 5 % more, 4 clients after 4,000 tokens of a summary
        that kept 0.51, where drafting paid from ~0.40, never drafted (0.91x fixed K = 1)."""
        pooled = self.pool.counts.get(self._pool_key(source)) if self.pool is not None else None
        own = wilson(self.counts.get(source, (0.0, 0.0)), -1.0)
        return min(self.alpha(source), max(own, wilson(pooled or (0.0, 0.0), -1.0)))

    def _base(self, source: str) -> float:
        """What the recent drafts are shrunk toward: the request's own long run (its last ~100
        drafts, `record`) shrunk toward its runtime's pool (the fixed prior until the pool is
        warm). Shrunk toward the pool alone, a request's estimate sat between its own drafts
        and other prompts' acceptance for good: after a question on 4,000 tokens, kept at
        0.45, it was priced at 0.55-0.64 and drafted K = 2 (its rounds 6.7 tok/s where K = 1's
        ran 8.3), 0.94x fixed K = 1."""
        return self._shrunk(self.record.get(source, (0.0, 0.0)), self._pooled(source))

    def _shrunk(self, counts, toward: float) -> float:
        """[accepted, rejected] drafts with `pool_weight` drafts at `toward` beside them."""
        accepted, rejected = counts
        return (accepted + self.pool_weight * toward) / (accepted + rejected + self.pool_weight)

    def _pooled(self, source: str) -> float:
        """Its runtime's pool's acceptance, its own drafts aside (the prior until warm)."""
        if self._pool_knows(source):
            return self.pool.alpha(self._pool_key(source), self.member)
        return self.prior_alpha

    def _pool_knows(self, source: str) -> bool:
        """Whether its runtime's pool has judged enough of this source's drafts, its own aside."""
        return self.pool is not None and self.pool.warm(self._pool_key(source), self.member)

    def hopeful(self, source: str = "model") -> float:
        """What an accepted probe shows of this request, where joint.py's `_probed` asks
        whether any probe could change the batch's course: the kept draft beside its pool's
        acceptance (`observe` forgets its own drafts on one). Its estimate just after such a
        probe counts the kept draft once more, in its long run (0.56 where this says 0.51 at
        a pool of 0.45), so this errs low by that much."""
        return self._shrunk((1.0, 0.0), self._pooled(source))

    def can_look_back(self, ctx: RoundContext, batch: int) -> bool:
        """Whether this request learns by looking back rather than by drafting and probes
        (drafters.py's `ModelDrafter.look_back`): after a long prompt, in a batch (where a
        learner's or a probe's draft widens every request's call), where its draft model's
        guesses can be judged (`RoundContext.can_look`) and it may draft none. Alone, where a
        probe widens one row, a request drafts to learn: looking back alone after 1,000 tokens,
        a summary's first 16 tokens kept 4 of the draft's guesses where its answer kept 0.5,
        and at LOOK_SHARE of its wait it looked back no more, at K = 0 where fixed K = 1 ran
        1.07x the target alone (0.92-0.95x)."""
        return batch > 1 and ctx.can_look and ctx.position > self.long_context and not self.k_min

    def looks_first(self, ctx: RoundContext, batch: int) -> bool:
        """Whether it looks back before it drafts: it can, its own drafts are unknown, and so is
        the draft's acceptance on its runtime (its pool, warm). Where its runtime's pool knows it,
        the request is priced from the pool until its own drafts or look-backs say more (see
        `floor`): looking back first whatever the pool knew, every batch paid its requests'
        first look-backs, ~0.1 s each, where after 1,000 tokens the target alone was best (3 %
        of a turn), and after 4,000 and 8,000 waited at K = 0 for the 16 tokens they judge
        where drafting paid from the first round (22 batches of 4 replayed: their second and
        third turns 0.963x the best fixed K on average, 32 of 44 below 0.97x; now 0.983x, 8)."""
        judged = sum(self.counts.get(ctx.source, ()))
        fresh = judged < DOUBT_AFTER and self.can_look_back(ctx, batch)
        return fresh and not self._pool_knows(ctx.source)

    def learning(self, source: str) -> bool:
        """Whether its runtime's pool has yet to learn this source's acceptance, from any
        request's drafts, its own included: one request learns for a batch (joint.py's
        `_learner`), and stops learning once it has."""
        return self.pool is not None and not self.pool.warm(source)

    def locate(self, ctx: RoundContext, batch: int) -> None:
        """Where in its answer this round is, where it learns by looking back (after a long
        prompt, in a batch: `can_look_back`): its opening (the first OPENING tokens) or its
        body. Each part is priced from its own evidence: its runtime's pool counts each part's
        judged drafts apart too (`_pool_key`), and past its opening a request that stopped
        forgets its own drafts there (one still drafting keeps them: they say drafting pays,
        and forgotten, its estimate jumped to its pool's and took K = 3 for a few rounds of a
        system prompt's answers after 4,000 tokens). An opening is unlike the rest: after
        4,000 tokens of a summary, 4 clients drafting on their pool's 0.59 (bodies') met
        openings that kept ~0.25, stopped 17 rounds in, and, priced on those drafts, drafted
        again only ~30 rounds into bodies that kept 0.5-0.6, where drafting paid from 0.37
        (turns 0.96x and 0.90x fixed K = 1). Now such a batch stops in the opening and drafts
        again as it leaves it, priced from what bodies kept (traced, three turns: 1.01x,
        0.97x, 0.99x). Alone, where a request learns by drafting and probes, its answer is one
        part: made to forget its opening, a summary's request alone re-learnt its body from
        the prior and stopped more often there (replayed, 0.988x the best fixed K, 0.99x
        before)."""
        part = None
        if self.can_look_back(ctx, batch):
            part = "opening" if ctx.emitted < OPENING else "body"
        if self.part == "opening" and part == "body" and not self.last_k:
            self.counts.clear()
            self.record.clear()
        self.part = part

    def _pool_key(self, source: str) -> str:
        """Which of its runtime's counts prices this request: its part's (`locate`), where the
        pool judged enough of them without it, else the source's over every part."""
        part = self._part_key(source)
        if part is None or self.pool is None:
            return source
        return part if self.pool.warm(part, self.member) else source

    def _part_key(self, source: str) -> str | None:
        """The pool's key for this source's drafts in its answer's part (None: one part)."""
        return None if self.part is None else f"{source} {self.part}"

    def cap(self, ctx: RoundContext) -> tuple[int, str]:
        """The most drafts this request takes this round, and why it is lower than its source's
        ceiling. After a long prompt, its model drafts start at one and grow by the drafts kept
        until its own bound its acceptance (`ceiling`): the pool's acceptance, learnt on other
        prompts, says little of a request there (a question about a file 0.40, its completion
        0.66): after a question on 4,000 tokens, adaptive drafted its first five rounds at K = 3
        on that guess, and ran at 0.87x fixed K = 1."""
        bound = self.k_model if ctx.source == "model" else self.k_free
        cap = min(bound, ctx.room)
        if ctx.position <= self.long_context:
            return cap, ""
        cap = min(cap, max(self.k_min, bound // 2))
        accepted, rejected = self.counts.get(ctx.source, (0.0, 0.0))
        if ctx.source == "model" and accepted + rejected < DOUBT_AFTER:
            cap = min(cap, max(self.k_min, 1 + round(accepted)))
            return cap, f"long context, own drafts unknown: K at most {cap}; "
        return cap, f"long context caps K at {cap}; "

    def decide(self, ctx: RoundContext) -> Decision:
        return decide_together([self], [ctx], self.costs)[0]

    def shape(self, source: str = "model") -> list[float] | None:
        """A factor per K (0 to `k_model`) on `expected_tokens` at its estimate, from the order
        in which its runtime's draft model's guesses were kept (runs.py), for its part of the
        answer where its runtime judged PART_AFTER guesses there, else over every part; None for a
        free source (no step judges its bonus tokens) or without a pool."""
        if source != "model" or self.pool is None:
            return None
        runs, part = self.pool.runs, self._part_key(source)
        key = part if part is not None and runs.judged(part) >= PART_AFTER else source
        return runs.shape(key, self.counted_at, self.k_model)

    def evidence(self, source: str = "model") -> int:
        """Rejections its runtime's runs of that draft hold, over every part of the answers
        (runs.py): 0 for a free source or without a pool."""
        if source != "model" or self.pool is None:
            return 0
        return self.pool.runs.rejections(source)

    def bonus(self, kept: bool, source: str = "model") -> None:
        """The draft model's guess at the token the target added after its last round's drafts,
        all kept, judged by the step that read it (drafting.py): the next guess in order."""
        if source == "model" and self.pool is not None:
            self.pool.runs.bonus(self.member, self._run_keys(source), kept)

    def _run_keys(self, source: str) -> list[str]:
        part = self._part_key(source)
        return [source] if part is None else [source, part]

    def observe(self, k: int, accepted: int, source: str = "model") -> None:
        if source == "model" and self.pool is not None:
            self.pool.runs.drafted(self.member, self._run_keys(source), k, accepted)
        self.idle = 0 if k else self.idle + 1
        self.bank = min(self.bank + 1, PROBE_BANK)
        self.last_k, self.probed = k, self.probing
        if self.probing:
            self.probing = False
            if accepted:  # the text has moved on (a code block, a quote): its old drafts with it
                self.counts.pop(source, None)
                self.record.pop(source, None)
        if k > 0:
            rejected = 1 if accepted < k else 0  # drafts after a rejection are never judged
            self._count(source, accepted, rejected)
            self.counted_at = k

    def looked_back(self, guesses: Sequence[bool], source: str = "model") -> None:
        """What its look-back judged, counted as judged drafts (the same trials, see
        `ModelDrafter.look_back`) and, in order, as runs (an opening's runs come from
        look-backs alone where its batch waits at K = 0 there); the wait for the next
        look-back starts again."""
        self.idle = 0
        kept = sum(guesses)
        if source == "model" and self.pool is not None:
            self.pool.runs.looked(self.member, self._run_keys(source), guesses)
        self._count(source, kept, len(guesses) - kept)
        self.counted_at = 0

    def _count(self, source: str, accepted: int, rejected: int) -> None:
        fade_in(self.counts.setdefault(source, [0.0, 0.0]), self.decay, accepted, rejected)
        fade_in(self.record.setdefault(source, [0.0, 0.0]), self.history, accepted, rejected)
        if self.pool is not None:
            self.pool.observe(source, accepted, rejected, self.member)
            if (part := self._part_key(source)) is not None:
                self.pool.observe(part, accepted, rejected, self.member)


def make_controller(
    spec,
    k_max: int,
    costs: StepCosts | None = None,
    *,
    bounds: tuple[int, int] | None = None,
    k_free: int | None = None,
    pool: PooledAcceptance | None = None,
):
    """`fixed:K`, `heuristic` or `adaptive`; K must fit the bundle's K_max. `adaptive` reads and
    refines `costs` when given (the runtime's shared, calibrated ones), else learns its own,
    starts each source's acceptance from `pool` (the runtime's other requests) where it has
    seen that source, and lets free drafts (a lookup, a prediction) run to k_free (default:
    K_max).

    bounds = (lowest, highest) K the caller allows (llama.cpp's `speculative.n_min/n_max`):
    the highest is capped at K_max, the lowest must fit under it, and a fixed K must lie inside.

    Anything else is taken as a policy already (the `Policy` protocol: `together`, `decide`,
    `observe`, `confidence_threshold`) and used as given (one instance per request, since
    policies keep per-request state).
    """
    if not isinstance(spec, str):
        return spec
    low, high = _check_bounds(bounds, k_max)
    name, _, arg = spec.partition(":")
    if name == "fixed":
        try:
            k = int(arg)
        except ValueError:
            raise _bad(f"controller {spec!r}: write fixed:K with a number K") from None
        if not 0 <= k <= k_max:
            raise _bad(f"controller {spec!r}: K must be in 0..{k_max} (the bundle's K_max)")
        if bounds and not low <= k <= high:
            raise _bad(f"controller {spec!r}: K is outside the requested bounds {low}..{high}")
        return Fixed(k)
    if arg:
        raise _bad(f"controller {name!r} takes no argument")
    if name not in ("heuristic", "adaptive"):
        raise _bad(f"unknown controller {spec!r}; use fixed:K, heuristic or adaptive")
    if high == 0:
        return Fixed(0)
    if name == "heuristic":
        low = max(low, 1)
        return Heuristic(k_min=low, k_max=high, start=int(np.clip(4, low, high)))
    lookup = k_free or k_max
    if bounds:
        lookup = min(lookup, bounds[1])  # the caller's highest K bounds free drafts too
    costs = costs or StepCosts()
    return Adaptive(k_min=low, k_model=high, k_free=lookup, costs=costs, pool=pool)


def _check_bounds(bounds: tuple[int, int] | None, k_max: int) -> tuple[int, int]:
    if bounds is None:
        return 0, k_max
    low, high = bounds
    if not 0 <= low <= k_max:
        raise _bad(f"the lowest K must be in 0..{k_max} (the bundle's K_max), got {low}")
    if high < low:
        raise _bad(f"the highest K ({high}) is below the lowest ({low})")
    return low, min(high, k_max)


def _bad(message: str) -> SpecrtError:
    return SpecrtError(message, param="controller")
