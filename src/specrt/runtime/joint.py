"""How the adaptive requests of a round choose K together (see controller.py's `Adaptive`):
the policies that decide alone first, then one K for the adaptive requests drafting by the
model and one for those drafting for free, priced as one round (pricing.py), kept on course
where the choice is within noise, and a probe or a look-back where one is cheap; in a batch
whose runtime has not learnt the draft's acceptance yet, one request drafts to learn, and
after a long prompt each request looks back before it drafts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from specrt.runtime.costs import StepCosts
from specrt.runtime.policy import Decision, Policy, RoundContext
from specrt.runtime.pool import wilson
from specrt.runtime.pricing import ROUND_LAG, price_round
from specrt.runtime.runs import PRIOR

if TYPE_CHECKING:
    from specrt.runtime.controller import Adaptive

PROBE_AFTER = 16  # rounds at K = 0 after which an adaptive request in a batch probes again...
PROBE_AFTER_ALONE = 4  # ...alone, after this many (see `_probed`)...
PROBE_SHARE = 0.03  # ...if its extra cost is at most this share of the rounds it waited...
PROBE_BANK = 64  # ...alone, of the rounds it took part in, at most this many (`_allowance`)
PROBE_HOPELESS = 64  # ...or this many, where no probe it could pass would change the course
LOOK_SHARE = 0.01  # a look-back's share instead: it judges a guess a token waited, not one
SWITCH_GAIN = 1.05  # a batch starts or stops the model's drafts only for this much more tok/s
K_MARGIN = 0.03  # options priced within this share of the best are equal: the fewest drafts win
#   (less the more rejections the runs behind their prices hold, see `_margin`)
WARM_UP_K = 4  # drafts a round takes while a source cannot be priced yet
LOOK_BACK_AT = 12  # emitted tokens a look-back waits for (an opening misleads, `_first_looks`)
ALPHA_TOP = 0.999  # acceptance is priced at most this (expected_tokens divides by 1 - alpha)


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
    and emit at least one token each. Each request first learns where in its answer the
    round is (`Adaptive.locate`); those whose source cannot be priced yet warm up first
    (`_warm_ups`); the rest are priced knowing their K."""
    batch = len(policies) + len(others)
    for policy, ctx in zip(policies, contexts, strict=True):
        policy.locate(ctx, batch)
    capped = [p.cap(c) for p, c in zip(policies, contexts, strict=True)]
    decisions = _first_looks(policies, contexts, batch)
    decisions.update(_warm_ups(policies, contexts, capped, costs, others, decisions))
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


def _first_looks(policies, contexts, batch: int) -> dict[int, Decision]:
    """The requests that look back before they draft, by index (`Adaptive.looks_first`: in a
    batch after a long prompt, their own drafts unknown): at K = 0 until LOOK_BACK_AT emitted
    tokens can be judged, then looking back. Learnt by drafting, a batch of 4 after 1,000
    tokens paid ~10 rounds of a call twice as wide for one request's drafts (~1.5 s of a 20 s
    turn where the target alone was best, 0.92x it). An answer's opening misleads: in 40
    recorded answers after long prompts (tests/data/acceptance-long-prompts.json), the
    draft's guesses at their first 32 tokens were kept 0.52 of the time and after them 0.62;
    a system prompt's first 16 flatter (0.73, the next 16 0.54), a summary's or a question's
    discourage (0.49, the next 16 0.46). Chosen at 24 on the policy of 9e6f6b5 (replayed,
    first turns under 0.97x the best fixed K: 15 of 22 at 16, 12 at 24), the wait cost most
    where drafting paid at once; since each K is priced by its runs (runs.py), 12 does
    better: first turns 0.970x (11 under) -> 0.968x (9) on the 22 batches, 0.964x (7) ->
    0.975x (5) at an AMX Xeon's curves, and after 8,000 tokens of a summary, 4 clients,
    that Xeon's cold turn ran 1.01x fixed K = 2 where at 24 it ran 0.93-0.94x. A system
    prompt's flattering opening costs its cold turn after 1,000 tokens instead (0.94x the
    target alone, 14 rounds at K = 1 before its stop; 0.97x the cell)."""
    decisions = {}
    for i, (policy, ctx) in enumerate(zip(policies, contexts, strict=True)):
        if policy.looks_first(ctx, batch):
            ready = ctx.unjudged >= LOOK_BACK_AT
            why = f"looking back at {ctx.unjudged} tokens" if ready else "waiting to look back"
            decisions[i] = Decision(0, f"long context, own drafts unknown: {why}", ready)
    return decisions


def _warm_ups(policies, contexts, capped, costs: StepCosts, others, decided) -> dict[int, Decision]:
    """The requests that draft to learn, by index: those whose source has no cost curve yet
    (WARM_UP_K), and in a batch, while its runtime has not learnt a source's acceptance, those
    drafting by it: every request of a free source (WARM_UP_K: a lookup costs no step), and
    of the draft model one request for the batch (`_learner`), the others waiting at K = 0.
    (Alone, a request learns by its probes; in a batch, no probe runs to learn.) The requests
    `decided` already (looking back) are theirs to leave."""
    batch = len(policies) + len(others)
    decisions, learning = {}, []
    for i, (p, c, (cap, note)) in enumerate(zip(policies, contexts, capped, strict=True)):
        if i in decided:
            continue
        cold = batch > 1 and cap and p.learning(c.source)
        if cold and c.source == "model" and costs.ready_for(c.source):
            learning.append(i)
        elif cold or not costs.ready_for(c.source):
            k = min(cap, max(min(p.k_min, cap), WARM_UP_K))
            why = f"{note}warming up ({c.source} alpha={p.alpha(c.source):.2f})"
            decisions[i] = Decision(k, why)
    if learning:
        learner = min(learning, key=lambda i: contexts[i].lag)
        for i in [i for i in learning if i != learner]:
            cap, note = capped[i]
            why = f"{note}batch {batch}: waiting, another request learns the draft's acceptance"
            decisions[i] = Decision(min(policies[i].k_min, cap), why)
        rows = [decisions[i].k if i in decisions else 0 for i in range(len(policies))]
        del rows[learner]  # the batch's other rows, those priced after it at K = 0 at least
        decisions[learner] = _learner(
            policies[learner], contexts[learner], capped[learner], costs, [*others, *rows]
        )
    return decisions


def _learner(policy, ctx: RoundContext, capped, costs: StepCosts, others) -> Decision:
    """The K of the request that learns the draft model's acceptance for its batch: the best
    priced from its own estimate, at least one. One request learns for all: in a batch of 4
    after 1,000 tokens, every request drafting to learn paid its draft model's first read of
    the prompt's end (~0.2 s each on an AVX2 EPYC) and three rounds of drafts, ~2.2 s of a
    30-second turn where the target alone was best (the first turn 0.90x). The learner is the
    request whose draft model has the least to read (`RoundContext.lag`): once it drafted, the
    same request again. Where its drafts pay, its K grows with them, and the pool it warms
    (POOL_WARM judged drafts) starts the others from its acceptance."""
    cap, note = capped
    alpha = min(policy.alpha(ctx.source), ALPHA_TOP)
    lag = [(ctx.lag, ctx.remaining)]
    options = [
        (*price_round([k], [alpha], [ctx.source], lag, others, costs), [k])
        for k in range(max(1, min(policy.k_min, cap)), cap + 1)
    ]
    rate, _, _, (k,) = _best(options)
    batch = len(others) + 1
    why = f"{note}batch {batch}: learning the draft's acceptance, alpha={alpha:.2f}"
    return Decision(k, f"{why} -> {rate:.1f} tok/s")


def _priced(policies, contexts, capped, costs: StepCosts, others) -> list[Decision]:
    """The best-priced pair of K (model drafts, free drafts) for these requests, kept on course
    (`_keep_course`), and a probe where one is cheap (`_probed`)."""
    caps = [cap for cap, _ in capped]
    lows = [min(p.k_min, cap) for p, cap in zip(policies, caps, strict=True)]
    sources = [c.source for c in contexts]
    alphas = [min(p.alpha(s), ALPHA_TOP) for p, s in zip(policies, sources, strict=True)]
    lags = [(c.lag, c.remaining) for c in contexts]
    shapes = [p.shape(s) for p, s in zip(policies, sources, strict=True)]
    options = []
    for k_model, k_free in _pairs_of_k(caps, sources):
        ks = [
            min(max(k_model if s == "model" else k_free, low), cap)
            for s, low, cap in zip(sources, lows, caps, strict=True)
        ]
        options.append((*price_round(ks, alphas, sources, lags, others, costs, shapes), ks))
    batch = len(policies) + len(others)
    drafting = any(
        p.last_k
        and c.lag <= ROUND_LAG
        and not (batch > 1 and p.probed)  # one request's probe is no batch's course
        for p, c in zip(policies, contexts, strict=True)
        if c.source == "model"
    )
    bounds = None
    if all(p.can_look_back(c, batch) for p, c in zip(policies, contexts, strict=True)):
        price = functools.partial(
            price_round, sources=sources, lags=lags, others=others, costs=costs, shapes=shapes
        )
        bounds = _bounds(policies, sources, alphas, price)
    margin = _margin(policies, sources)
    rate, draft, verify, ks = _keep_course(options, sources, drafting, bounds, margin)
    base = costs.verify_cost(batch, batch)  # the batch's call at K = 0
    shares = f"c_draft(K)/c_verify={draft / base:.2f} c_verify(K)/c_verify(0)={verify / base:.2f}"
    size = f"batch {batch}: " if batch > 1 else ""
    reasons = [
        f"{size}{note}{c.source} alpha={alpha:.2f} {shares} -> {rate:.1f} tok/s"
        for (_, note), c, alpha in zip(capped, contexts, alphas, strict=True)
    ]
    return _probed(policies, contexts, caps, reasons, costs, others, (rate, draft, verify, ks))


def _could_pay(contexts, caps, ks, others, costs: StepCosts, rate: float, alphas=None) -> bool:
    """Whether drafting could beat this round by SWITCH_GAIN at all: every request with room
    drafting at least one token, each at `alphas` (default: every draft kept). Where not even
    that pays (a compute-bound call at 8 clients: its rows at 2 tokens cost 1.7x), no
    acceptance a probe could find would change the course, and a probe is a tax of up to
    PROBE_SHARE of the batch's time."""
    hopeful = [max(k, 1) if cap else k for k, cap in zip(ks, caps, strict=True)]
    sources = [c.source for c in contexts]
    lags = [(c.lag, c.remaining) for c in contexts]
    top = alphas or [ALPHA_TOP] * len(ks)
    return price_round(hopeful, top, sources, lags, others, costs)[0] > SWITCH_GAIN * rate


def _probed(policies, contexts, caps, reasons, costs: StepCosts, others, chosen) -> list:
    """The decisions, one request probing acceptance (K = 1) after rounds without drafts
    where that is cheap; an accepted probe lets the request price its drafts afresh
    (`Adaptive.observe`). A probe widens the whole call to 2 tokens a row and may first catch
    the draft model up on every token since it last drafted; in a batch everyone waits for
    both. So of the requests waiting at K = 0, the one whose probe costs least goes ahead
    once they all waited PROBE_AFTER rounds in a batch (PROBE_AFTER_ALONE alone), if its
    extra cost, less the draft it expects to keep (a token of the round), spread over the
    rounds they waited (alone, every round it took part in: `_allowance`), stays under
    PROBE_SHARE of a round, and drafting could pay at all (`_could_pay`). Held to one
    round's price instead (within 10 % of it), a batch after 8,000 tokens whose wider call
    cost 1.4x never probed: a summary whose opening the draft guessed badly held 4 clients
    at K = 0 for 3 turns, ~380 rounds, 0.91x fixed K = 1 on an AVX2 EPYC; alone, that rule
    never probed on a verify curve 12 % wider at 2 tokens.
    Counted by each request's own wait, 4 clients probed in 4 rounds in a row, each at the
    share the rounds allowed one. Not crediting the draft it keeps, a probe at acceptance
    0.4 was priced 45 ms dear in 200. A request that can look back (`Adaptive.can_look_back`)
    looks back instead, once LOOK_BACK_AT tokens can be judged, at LOOK_SHARE of the rounds
    waited, and hopes for its own drafts' ceiling, not a kept probe (see `_shares`)."""
    rate, draft, verify, ks = chosen
    price, batch = draft + verify, len(policies) + len(others)
    decisions = [Decision(k, why) for k, why in zip(ks, reasons, strict=True)]
    waiting = [i for i, (k, cap) in enumerate(zip(ks, caps, strict=True)) if not k and cap]
    waited = min((policies[i].idle for i in waiting), default=0)
    soon = waited < (PROBE_AFTER if batch > 1 else PROBE_AFTER_ALONE)
    if soon or not _could_pay(contexts, caps, ks, others, costs, rate):
        return decisions
    looks = [p.can_look_back(c, batch) for p, c in zip(policies, contexts, strict=True)]
    hopes = [
        min(p.ceiling(c.source) if look else p.hopeful(c.source), ALPHA_TOP)
        for p, c, look in zip(policies, contexts, looks, strict=True)
    ]
    if waited < PROBE_HOPELESS and not _could_pay(contexts, caps, ks, others, costs, rate, hopes):
        return decisions
    call = (price, batch, max(ks), price * waited)
    shares = _shares(policies, contexts, waiting, looks, costs, call)
    i = _chosen(policies, shares, looks)
    if i is None:
        return decisions
    if looks[i]:
        why = f"{reasons[i]}; looking back at {contexts[i].unjudged} tokens after {waited} rounds"
        decisions[i] = Decision(0, why, look_back=True)
    else:
        policies[i].probing = True
        if batch == 1:
            policies[i].bank -= shares[i] * policies[i].bank  # rounds whose share it took
        why = f"{reasons[i]}; probing acceptance after {waited} rounds without drafts"
        decisions[i] = Decision(1, why)
    return decisions


def _chosen(policies, shares: dict[int, float], looks) -> int | None:
    """Which waiting request probes or looks back, if its share allows (`_shares`): the
    request whose probe costs least, or, where the batch looks back, the one whose own
    guesses were judged longest ago. A look-back costs more the more tokens it judges, so the
    cheapest was always the request that had looked last: after 4,000 tokens of a question,
    4 clients looked back at one request's answer three times and never again at the other
    three, whose counts still held their answers' openings (0.29-0.38 kept, where the answers
    went on to keep 0.5-0.6), and the batch never started again (0.89x fixed K = 1)."""
    if not shares:
        return None
    i = max(shares, key=lambda i: (looks[i] and policies[i].idle, -shares[i]))
    return i if shares[i] <= 1 else None


def _shares(policies, contexts, waiting, looks, costs: StepCosts, call) -> dict[int, float]:
    """What each waiting request's probe or look-back costs, as a share of what it may spend
    (1: all of it), for a round of `call` = (price, requests, widest K, seconds waited). A
    probe widens the call to 2 tokens a row and first catches the draft model up, net of the
    draft it expects to keep, at PROBE_SHARE of its rounds (`_allowance`); a look-back reads
    its tokens in a draft call of its own and widens nothing, at LOOK_SHARE of the wait: it
    judges a guess a token waited, where a probe judges one draft."""
    price, batch, widest, seconds = call
    wider = costs.verify_cost(batch * max(2, widest + 1), batch)
    shares = {}
    for i in waiting:
        source, lag, unjudged = contexts[i].source, contexts[i].lag, contexts[i].unjudged
        if looks[i]:
            if unjudged >= LOOK_BACK_AT:
                shares[i] = costs.draft_cost(source, 1, unjudged + 1) / (LOOK_SHARE * seconds)
            continue
        catch_up = costs.catch_up_cost(lag) if source == "model" else 0.0
        extra = wider - price + costs.draft_cost(source, 1) + catch_up
        extra -= policies[i].alpha(source) * price / batch  # the draft it keeps
        allowance = _allowance(policies[i], price, seconds, batch)
        shares[i] = extra / allowance if allowance > 0 else float("inf")
    return shares


def _allowance(policy, price: float, seconds: float, batch: int) -> float:
    """What a probe may cost: PROBE_SHARE of the rounds it pays for. In a batch, of the
    `seconds` its requests waited since their last drafts: its price falls on every request,
    and a batch keeps no account of its own (counted by each request's own rounds, 4 clients
    probed 4 rounds in a row). Alone, of every round the request took part in, less what its
    probes were priced at (`Adaptive.bank`, at most PROBE_BANK rounds): the bound holds over
    its answer, not over each wait, so its rounds of drafts before a stop pay for its first
    probe. Counted by the wait, a summary alone after 1,000 tokens (the draft kept 1 guess
    of its first 14, ~0.7 after them) stopped at round 6-11 and drafted again 13-28 rounds
    later: each round waited added a token to the probe's read back, ~4 % of a call, more
    than the 3 % it allowed (0.952x fixed K = 1 over ten turns on a 2-core AVX-512 EPYC;
    now 0.966x over twenty, its probes 4-5 rounds after its stop). Replayed on that
    machine's curves, that answer went from 0.958x the best fixed K to 1.01x, and 40
    answers after long prompts from 0.987x to 0.989x; a request whose drafts are all
    rejected ran 0.945x the target alone over 128 tokens (0.950x counted by the wait),
    0.958x over 300 (0.960x)."""
    if batch > 1:
        return PROBE_SHARE * seconds
    return PROBE_SHARE * price * policy.bank


def _bounds(policies, sources, alphas, price) -> tuple:
    """(start, hold): `price` (a round's, by its K) with each request at its floor
    (`Adaptive.floor`), and with each at its estimate raised by how far its batch's judged
    drafts, counted together, leave their acceptance in doubt (their upper DOUBT_Z Wilson
    bound less their mean; that bound is 1 before DOUBT_AFTER were judged). Together: a batch
    drafts as one, and every request at its own bound at once is far less likely than their
    bound together (4 requests, 10 judged drafts each at 0.3: each 0.18-0.46, together
    0.23-0.38)."""
    floors = [min(p.floor(s), ALPHA_TOP) for p, s in zip(policies, sources, strict=True)]
    judged = [p.counts.get(s, (0.0, 0.0)) for p, s in zip(policies, sources, strict=True)]
    together = (sum(a for a, _ in judged), sum(r for _, r in judged))
    n = sum(together)
    doubt = wilson(together, 1.0) - (together[0] / n if n else 0.0)
    ceilings = [min(alpha + doubt, ALPHA_TOP) for alpha in alphas]
    return functools.partial(price, alphas=floors), functools.partial(price, alphas=ceilings)


def _keep_course(options, sources: Sequence[str], drafting: bool, bounds=None, margin=K_MARGIN):
    """The best priced option (rate, draft, verify, ks; see `_best`), unless it starts
    or stops the model's drafts for less than SWITCH_GAIN over the best option that does not.
    Where the batch learns by looking back (`bounds`, see `_bounds`), a start is priced at the
    requests' floors and a stop at their ceilings, with no margin beyond them: a course that
    starts and stops only on evidence does not flip on noise. With the margin, a batch that
    had started on a lucky opening drafted on at 0.55-0.6 where drafting paid from 0.62 (4
    clients after 1,000 tokens, 0.93x the target alone). Stopped at the estimates instead
    (with `_best`'s tie toward fewer drafts on top), 4 clients after 4,000 tokens of a summary
    stopped within rounds of each answer's opening (0.25 kept), and a stopped batch learns
    only by look-backs: the next came ~37 rounds later, where the rest kept 0.5-0.6 and
    drafting paid from 0.37 (0.88-0.91x fixed K = 1 in three runs; traced, 0.99/0.90/0.89 a
    turn, and 1.02/0.99/1.00 with the ceilings).
    Where drafting and the target alone price within noise of each other, the choice flipped
    round by round, and every return to drafting first fed the draft model all it had missed:
    adaptive drafted a mean K of 0.47 at 4 clients and ran at 0.81x the target alone, which
    either course alone matched. In a batch one request's probe sets no course: its draft
    model alone caught up, 4 clients at acceptance 0.3 drafted on after it where K = 0 priced
    5 % better (tests/test_controller.py's case)."""

    chosen = _best(options, margin)
    same = [option for option in options if _model_drafts(option, sources) == drafting]
    if _model_drafts(chosen, sources) == drafting or not same:
        return chosen
    stay = _best(same, margin)
    if bounds is None:
        switch = chosen[0] > SWITCH_GAIN * stay[0]
    elif drafting:
        switch = chosen[0] > bounds[1](stay[3])[0]
    else:
        switch = bounds[0](chosen[3])[0] > stay[0]
    return chosen if switch else stay


def _best(options: list[tuple], margin: float = K_MARGIN) -> tuple:
    """The option with the fewest drafts of those priced within `margin` of the best. A price
    errs more the more a round drafts (each step's seconds; an acceptance's error compounds in
    alpha^K), so the best of near-equal prices is mostly the most flattered: at 2 clients the
    policy took K = 3 on a 3 % edge where it realised 55-59 ms a token against K = 1's 53.5
    (0.93-0.96x the best fixed K)."""
    top = max(option[0] for option in options)
    near = [option for option in options if (1 + margin) * option[0] >= top]
    return min(near, key=lambda option: (sum(option[3]), -option[0]))


def _margin(policies, sources) -> float:
    """K_MARGIN, shrunk as the runs' factors are (runs.py: PRIOR rejections' worth of doubt) by
    the fewest rejections a model-drafting request's runtime judged of its draft: the margin
    stands for how far a price may flatter, and the runs of the draft's guesses, in order, say
    what each K keeps on them. Held at 3 % where the runs held some 470 rejections (1,024
    guesses at 0.54 kept), after 8,000 tokens of a summary at 4 clients a Xeon without AMX
    kept K = 1 where fixed K = 2 ran 2.9 % faster: K = 2's edge, priced exactly, was 2-3 %.
    Replayed on those answers at an AMX Xeon's curves, the warm turns went from 0.953x and
    0.971x the best fixed K to 0.981x and 0.979x (counted in the runs of the request's part of
    its answer alone, 0.971x and 0.975x); short prompts at 1/2/4/8 clients from 0.994/0.973/
    1.00/1.00 to 0.997/0.977/1.00/1.00; 22 batches after long prompts stayed at 0.997x (their
    lowest warm turn 0.969x -> 0.965x, first turns 0.971x -> 0.970x). A request whose
    runtime judged nothing keeps all of it."""
    judged = [p.evidence(s) for p, s in zip(policies, sources, strict=True) if s == "model"]
    return K_MARGIN * PRIOR / (PRIOR + min(judged, default=0))


def _model_drafts(option: tuple, sources: Sequence[str]) -> bool:
    return any(k and s == "model" for k, s in zip(option[3], sources, strict=True))


def _pairs_of_k(caps, sources) -> list[tuple[int, int]]:
    """The (K of model drafts, K of free drafts) to price: requests drafting by the model pay
    for every step, those drafting by lookup or prediction do not, so each kind gets its own
    K (one K for both would hold a 30-token prediction back to what the model's drafts earn)."""
    model = max((c for c, s in zip(caps, sources, strict=True) if s == "model"), default=0)
    free = max((c for c, s in zip(caps, sources, strict=True) if s != "model"), default=0)
    return [(k_model, k_free) for k_model in range(model + 1) for k_free in range(free + 1)]
