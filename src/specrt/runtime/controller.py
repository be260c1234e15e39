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
price is pricing.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.costs import STALE_AFTER, StepCosts
from specrt.runtime.pool import PooledAcceptance, fade_in
from specrt.runtime.pricing import ROUND_LAG, price_round, verify_rows

PROBE_AFTER = 16  # rounds at K = 0 after which an adaptive request drafts one token again...
PROBE_COST = 1.1  # ...in a batch, if the wider call costs at most this much more than its round
PROBE_SHARE = 0.03  # alone, if its extra cost is at most this share of the rounds it waited
DOUBT_Z, DOUBT_AFTER = 1.0, 4.0  # own drafts bound acceptance (84 %, Wilson) once 4 are judged
SWITCH_GAIN = 1.05  # a batch starts or stops the model's drafts only for this much more tok/s
K_MARGIN = 0.03  # options priced within this share of the best are equal: the fewest drafts win
REFRESH_MARGIN = 1.15  # a stale call (costs.STALE_AFTER) is re-timed if it prices this close
WARM_UP_K = 4  # drafts a round takes while a source cannot be priced yet


@dataclass(frozen=True)
class RoundContext:
    room: int  # the most drafts this request can take this round: its offer, budget, context
    position: int  # tokens in the sequence so far (prompt + emitted)
    remaining: int  # tokens its drafter may still serve: the budget or context room, less
    # what a free source (a prediction) expects to serve, for free, after this round
    source: str = "model"  # who drafts this round: "model", "ngram", ... (see drafters)
    lag: int = 0  # tokens the draft model must catch up on before it drafts (model rounds)


@dataclass(frozen=True)
class Decision:
    k: int
    reason: str


class Policy(Protocol):
    """What picks one request's K: a decision a round, then what that round accepted (of the
    drafts of `source`, the offer the round was decided for).

    `together`: in a batch, its K is chosen with the batch's other such policies, priced as one
    round (`decide_together`); otherwise it decides alone, before them, and they know its K."""

    together: bool
    confidence_threshold: float  # its draft stops where the draft's top probability is below

    def decide(self, ctx: RoundContext) -> Decision: ...
    def observe(self, k: int, accepted: int, source: str) -> None: ...


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
    last_k: int | None = field(init=False, default=None)  # drafts of its last round
    probing: bool = field(init=False, default=False)  # its last decision was a probe
    refreshing: bool = field(init=False, default=False)  # ...or re-timed the call without drafts
    member: int | None = field(init=False, default=None)  # its key in the pool

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
        accepted, rejected = self.counts.get(source, (0.0, 0.0))
        weight = self.pool_weight
        shrunk = (accepted + weight * self._base(source)) / (accepted + rejected + weight)
        return min(shrunk, self.ceiling(source))

    def ceiling(self, source: str = "model") -> float:
        """The highest acceptance this request's own (decayed) drafts make plausible: their
        one-sided 84 % Wilson bound, once DOUBT_AFTER were judged (1 before). Five drafts
        rejected in a row bound it near 0.2; a lucky streak never raises the estimate (the
        pool's share holds it down)."""
        accepted, rejected = self.counts.get(source, (0.0, 0.0))
        n = accepted + rejected
        if n < DOUBT_AFTER:
            return 1.0
        p, z2 = accepted / n, DOUBT_Z**2
        spread = DOUBT_Z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
        return float(min(1.0, (p + z2 / (2 * n) + spread) / (1 + z2 / n)))

    def _base(self, source: str) -> float:
        """What the recent drafts are shrunk toward: the request's own long run (its last ~100
        drafts, `record`) shrunk toward its runtime's pool (the fixed prior until the pool is
        warm). Shrunk toward the pool alone, a request's estimate sat between its own drafts
        and other prompts' acceptance for good: after a question on 4,000 tokens, kept at
        0.45, it was priced at 0.55-0.64 and drafted K = 2 (its rounds 6.7 tok/s where K = 1's
        ran 8.3), 0.94x fixed K = 1."""
        pooled = self.prior_alpha
        if self.pool is not None and self.pool.warm(source, self.member):
            pooled = self.pool.alpha(source, self.member)
        accepted, rejected = self.record.get(source, (0.0, 0.0))
        return (accepted + self.pool_weight * pooled) / (accepted + rejected + self.pool_weight)

    def learning(self, source: str) -> bool:
        """Whether its runtime's pool has yet to learn this source's acceptance."""
        return self.pool is not None and not self.pool.warm(source, self.member)

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

    def observe(self, k: int, accepted: int, source: str = "model") -> None:
        if self.refreshing:  # a round that only re-timed a call: the course goes on
            self.refreshing = False
            return
        self.idle = 0 if k else self.idle + 1
        self.last_k = k
        if self.probing:
            self.probing = False
            if accepted:  # the text has moved on (a code block, a quote): its old drafts with it
                self.counts.pop(source, None)
                self.record.pop(source, None)
        if k > 0:
            rejected = 1 if accepted < k else 0  # drafts after a rejection are never judged
            fade_in(self.counts.setdefault(source, [0.0, 0.0]), self.decay, accepted, rejected)
            fade_in(self.record.setdefault(source, [0.0, 0.0]), self.history, accepted, rejected)
            if self.pool is not None:
                self.pool.observe(source, accepted, rejected, self.member)


def decide_round(policies: Sequence[Policy], contexts: Sequence[RoundContext], costs: StepCosts):
    """Each request's K for one round of a batch: the policies that decide alone (fixed,
    heuristic, a caller's own) first, then those that decide together, knowing the others' K."""
    pairs = list(zip(policies, contexts, strict=True))
    decisions = {i: p.decide(c) for i, (p, c) in enumerate(pairs) if not p.together}
    joint = [i for i in range(len(pairs)) if i not in decisions]
    if joint:
        others = [d.k for d in decisions.values()]
        together = decide_together(
            [policies[i] for i in joint], [contexts[i] for i in joint], costs, others
        )
        decisions.update(zip(joint, together, strict=True))
    return [decisions[i] for i in range(len(pairs))]


def decide_together(
    policies: Sequence[Adaptive],
    contexts: Sequence[RoundContext],
    costs: StepCosts,
    others: Sequence[int] = (),
) -> list[Decision]:
    """One K for the adaptive requests of a batch that draft by the model and one for those
    that draft for free (each capped by its own room), maximising the batch's expected tokens
    per second; `others` are the K of the batch's other requests, which pad the verify call
    and emit at least one token each. Requests whose source cannot be priced yet warm up
    first (`_warm_ups`); the rest are priced knowing their K."""
    capped = [p.cap(c) for p, c in zip(policies, contexts, strict=True)]
    batch = len(policies) + len(others)
    decisions = _warm_ups(policies, contexts, capped, costs, batch)
    rest = [i for i in range(len(policies)) if i not in decisions]
    if rest:
        priced = _priced(
            [policies[i] for i in rest],
            [contexts[i] for i in rest],
            [capped[i] for i in rest],
            costs,
            [*others, *(d.k for d in decisions.values())],
        )
        decisions.update(zip(rest, priced, strict=True))
    return [decisions[i] for i in range(len(policies))]


def _warm_ups(policies, contexts, capped, costs: StepCosts, batch: int) -> dict[int, Decision]:
    """The requests that draft WARM_UP_K to learn, by index: those whose source has no cost
    curve yet, and in a batch those whose runtime has not learnt the source's acceptance
    (alone, a request learns by its probes; in a batch, no probe runs to learn)."""
    decisions = {}
    for i, (p, c, (cap, note)) in enumerate(zip(policies, contexts, capped, strict=True)):
        if not costs.ready_for(c.source) or (batch > 1 and cap and p.learning(c.source)):
            k = min(cap, max(min(p.k_min, cap), WARM_UP_K))
            why = f"{note}warming up ({c.source} alpha={p.alpha(c.source):.2f})"
            decisions[i] = Decision(k, why)
    return decisions


def _priced(policies, contexts, capped, costs: StepCosts, others) -> list[Decision]:
    """The best-priced pair of K (model drafts, free drafts) for these requests, kept on course
    (`_keep_course`), and a probe where one is cheap (`_probed`)."""
    caps = [cap for cap, _ in capped]
    lows = [min(p.k_min, cap) for p, cap in zip(policies, caps, strict=True)]
    sources = [c.source for c in contexts]
    alphas = [min(p.alpha(s), 0.999) for p, s in zip(policies, sources, strict=True)]
    lags = [(c.lag, c.remaining) for c in contexts]
    options = []
    for k_model, k_free in _pairs_of_k(caps, sources):
        ks = [
            min(max(k_model if s == "model" else k_free, low), cap)
            for s, low, cap in zip(sources, lows, caps, strict=True)
        ]
        options.append((*price_round(ks, alphas, sources, lags, others, costs), ks))
    drafting = any(
        p.last_k and c.lag <= ROUND_LAG + 1  # + 1: a round that re-timed the call (_refresh)
        for p, c in zip(policies, contexts, strict=True)
        if c.source == "model"
    )
    chosen = _keep_course(options, sources, drafting)
    refresh = _refresh(options, chosen, sources, others, costs)
    rate, draft, verify, ks = refresh or chosen
    batch = len(policies) + len(others)
    base = costs.verify_cost(batch)  # the batch's call at K = 0
    shares = f"c_draft(K)/c_verify={draft / base:.2f} c_verify(K)/c_verify(0)={verify / base:.2f}"
    size = f"batch {batch}: " if batch > 1 else ""
    reasons = [
        f"{size}{note}{c.source} alpha={alpha:.2f} {shares} -> {rate:.1f} tok/s"
        for (_, note), c, alpha in zip(capped, contexts, alphas, strict=True)
    ]
    if refresh:
        age = costs.verify_age(verify_rows(ks, others))
        reasons = [f"{why}; re-timing the call without drafts, {age} rounds old" for why in reasons]
        for policy, source in zip(policies, sources, strict=True):
            policy.refreshing = source == "model"
    return _probed(policies, contexts, caps, ks, reasons, costs, batch, draft + verify)


def _probed(policies, contexts, caps, ks, reasons, costs: StepCosts, batch, price) -> list:
    """The decisions, one request probing acceptance (K = 1) after PROBE_AFTER rounds without
    drafts where that is cheap; an accepted probe lets the request price its drafts afresh
    (`Adaptive.observe`). A probe widens the whole call to 2 tokens a row and may first catch
    the draft model up on every token since it last drafted. In a batch everyone waits for
    both, so a probe goes ahead only where the round stays within PROBE_COST of its price, one
    request per round; alone, a request delays only itself: its probe's extra cost, spread
    over the rounds it waited, must stay under PROBE_SHARE of a round. (Held to PROBE_COST
    alone too, a request on a verify curve 12 % wider at 2 tokens never probed, and never
    drafted again once it had stopped.)"""
    wider = costs.verify_cost(batch * max(2, max(ks) + 1))
    probed = False
    decisions = []
    for policy, k, cap, why, ctx in zip(policies, ks, caps, reasons, contexts, strict=True):
        catch_up = costs.catch_up_cost(ctx.lag) if ctx.source == "model" else 0.0
        if batch > 1:
            cheap_probe = wider + catch_up <= PROBE_COST * price
        else:
            extra = wider - price + costs.draft_cost(ctx.source, 1) + catch_up
            cheap_probe = extra <= PROBE_SHARE * price * policy.idle
        if k == 0 and cap > 0 and policy.idle >= PROBE_AFTER and cheap_probe and not probed:
            k, why = 1, f"{why}; probing acceptance after {policy.idle} rounds without drafts"
            probed = policy.probing = True
        decisions.append(Decision(k, why))
    return decisions


def _keep_course(options: list[tuple], sources: Sequence[str], drafting: bool) -> tuple:
    """The best priced option (rate, draft, verify, ks; see `_best`), unless it starts
    or stops the model's drafts for less than SWITCH_GAIN over the best option that does not.
    Where drafting and the target alone price within noise of each other, the choice flipped
    round by round, and every return to drafting first fed the draft model all it had missed:
    adaptive drafted a mean K of 0.47 at 4 clients and ran at 0.81x the target alone, which
    either course alone matched."""

    chosen = _best(options)
    same = [option for option in options if _model_drafts(option, sources) == drafting]
    if _model_drafts(chosen, sources) == drafting or not same:
        return chosen
    stay = _best(same)
    return chosen if chosen[0] > SWITCH_GAIN * stay[0] else stay


def _refresh(options: list[tuple], chosen: tuple, sources: Sequence[str], others, costs):
    """The best option without the model's drafts, for one round, where the chosen one drafts
    by the model, prices within REFRESH_MARGIN of it, and its verify call was last timed
    STALE_AFTER rounds ago or more; else None. Only the calls in use are timed again, and a
    shared machine's speed drifts by tens of percent within minutes: at 4 clients the target
    alone's call kept the price of a slow spell (187 ms where its rounds took 167) while the
    drafting rounds were timed afresh, and adaptive drafted at 0.93x the target alone. One
    round in STALE_AFTER costs at most a sixth of a round."""
    if not _model_drafts(chosen, sources):
        return None
    alone = [option for option in options if not _model_drafts(option, sources)]
    if not alone:
        return None
    best = _best(alone)
    stale = costs.verify_age(verify_rows(best[3], others)) >= STALE_AFTER
    return best if stale and REFRESH_MARGIN * best[0] >= chosen[0] else None


def _best(options: list[tuple]) -> tuple:
    """The option with the fewest drafts of those priced within K_MARGIN of the best. A price
    errs more the more a round drafts (each step's seconds; an acceptance's error compounds in
    alpha^K), so the best of near-equal prices is mostly the most flattered: at 2 clients the
    policy took K = 3 on a 3 % edge where it realised 55-59 ms a token against K = 1's 53.5
    (0.93-0.96x the best fixed K)."""
    top = max(option[0] for option in options)
    near = [option for option in options if (1 + K_MARGIN) * option[0] >= top]
    return min(near, key=lambda option: (sum(option[3]), -option[0]))


def _model_drafts(option: tuple, sources: Sequence[str]) -> bool:
    return any(k and s == "model" for k, s in zip(option[3], sources, strict=True))


def _pairs_of_k(caps, sources) -> list[tuple[int, int]]:
    """The (K of model drafts, K of free drafts) to price: requests drafting by the model pay
    for every step, those drafting by lookup or prediction do not, so each kind gets its own
    K (one K for both would hold a 30-token prediction back to what the model's drafts earn)."""
    model = max((c for c, s in zip(caps, sources, strict=True) if s == "model"), default=0)
    free = max((c for c, s in zip(caps, sources, strict=True) if s != "model"), default=0)
    return [(k_model, k_free) for k_model in range(model + 1) for k_free in range(free + 1)]


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
