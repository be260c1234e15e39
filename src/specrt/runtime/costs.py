"""What a draft step and a verify call cost on this machine, by the rows they carry.

Costs belong to the engines and the machine, not to one request, so one `StepCosts` lives on the
runtime and every round reads and refines it. A call's cost is priced by its rows: a verify call
of B requests with K drafts each carries B·(K+1) rows (padding included), a draft step one row
per drafting request. Both curves are measured, not modelled: weight-streaming float32 kernels
make a 9-row call cost ~1.5x a 1-row call, int4 kernels that are compute-bound past one row 3x or
more, and no single formula fits both. `measure_costs` measures a grid of batch shapes once at
load. Counts never measured are interpolated linearly between measured neighbours, or
extrapolated from the last two. A call with more rows never costs less than one with fewer (it
could be padded), so a count is never priced above a larger count's price.

Each round refines the count it used (EWMA), and only the counts the policy picks are timed
again, while the machine's load drifts (by tens of percent within minutes) and a long prompt
slows every call (after 4,000 tokens of context the gguf target's calls took ~50 ms more than at
the 48 of calibration). So the counts in use carry the others: `drift` is how far they have
moved since calibration (every fresh count's refinement multiplies it), and a count is priced
at its own last time scaled by the drift since it was taken. Refined one by one alone, the
counts in use rose with the context while unused larger ones kept their calibration, and since
no count is priced above a larger one, every smaller count took the 3-row call's price: K = 0
and K = 2 cost the same. Each count keeps its own time: priced as the calibrated curve's shape
at the scale of the counts in use, 8 short-prompt clients kept going back to drafting (K 1.37,
0.91x the target alone; its own times had held it at K 0.0-0.4). A scale, not a shift: a drift
scales every call, and a shift learnt on a batch's narrow calls underpriced its compute-bound
wide ones (K 1.35 there, 0.86x).
A count untimed for STALE_AFTER rounds is stale: the policy times it again where it is a close
alternative (see joint.py's `_refresh`), a faster time replaces its price (noise only ever adds
time), a slower one counts STALE_WEIGHT, and neither moves the drift (the gap is the count's own
error). On a shared machine a sample counts at most `SPIKE` times the estimate it refines (one
stall moves it 15 %; a lasting slowdown still shows within a few rounds), and calibration keeps
the fastest of its repeats at every batch size.

A long prompt is not a drift: it slows every call of the requests behind it, by the context
they carry, not by a share of every call. Carried by the drift, after 8,000 tokens at 4 clients
the K = 0 call's rise scaled the 8-row call's calibration with it, 1.61x its price where it took
1.3-1.45x (and a sample counts at most SPIKE times the estimate, so the drift took ten rounds
to climb there): a round at K = 1 was priced 1.79x one at K = 0 where it took 1.46x, and the
batch stopped drafting where fixed K = 1 ran 1.04-1.08x the target alone. So each count keeps
the context it was timed at (`Timing`), a count timed far from it (`far`: a long prompt, or a
short one after long ones) takes its time as is without moving the drift, and the counts not
timed at this context yet are priced as the nearest narrower and the nearest wider counts that
were, with what calibration put between them added or taken away, and at least their own
calibration (scaled by the drift): each request's cache is read once a call whatever its
width, so a long context adds about as much to a wider call as to a narrower one (at 8,000
tokens the 4-row call took 0.486 s, the 8-row 0.57, 0.114 and 0.166 at calibration, on an AMX
Xeon). Such a price is a guess, and one too high is never tried: scaled as a share of the
4-row call's rise, the 8-row call was priced 0.71 s, and a batch that already knew its
acceptance stayed at K = 0 until a probe timed it (23 rounds of a 95-round turn, 0.94x fixed
K = 1). One too low is tried once and then timed (a slope of seconds per token would depend
on how many requests a call carries, and a count's history mixes them). The first few timings
after such a jump refine the count's own time alone (SETTLE): one sample fixed the ratio
between counts that only the drift moves after it.

A lookup (n-gram, prediction) costs nothing next to a call (about 0.05 ms at 2,048 tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specrt.engines.base import Engine

SMOOTHING = 0.3  # weight of a new observation: follows load changes within a few rounds
SPIKE = 1.5  # an observation counts at most this many times the estimate it refines
STALE_AFTER, STALE_WEIGHT = 16, 0.5  # rounds untimed after which a verify count is stale
PREFIX = 48  # tokens of context behind a calibration call, a typical short prompt
FAR, FAR_BY = 2.0, 512  # a context this many times another, and this many tokens more, is far
SETTLE = 4  # timings after a far jump that refine the count's own time alone
# Draft calls of this many new tokens in one row: the curve a catch-up (the prompt, rounds served
# by a lookup or at K = 0) is priced on, extrapolated past 33 until the rounds measure catch-ups
# of their own sizes (draft_together reports them). With draft steps alone a one-slot runtime
# knew one point of the draft curve, and priced every catch-up at nothing.
CATCH_UP_WIDTHS = [16, 33]


@dataclass
class Timing:
    """When and where a verify count's own time (`StepCosts.verify`) was last taken. A count
    never timed since calibration has the defaults: round 0, the calibration's drift and
    context."""

    drift: float = 1.0  # the drift then
    round: int = 0  # the verify calls timed by then (`StepCosts.rounds`)
    context: float = PREFIX  # tokens of context behind its rows then
    settling: int = 0  # timings left that refine its own time alone (after a far jump)
    floor: float | None = None  # its time at PREFIX: calibration's, or its first near PREFIX
    once: bool = False  # timed once at this context: a first call's one-time costs may hold it


UNTIMED = Timing()


@dataclass
class StepCosts:
    """Seconds per draft-model step by its rows, and per verify call by its rows."""

    draft: dict[int, float] = field(default_factory=dict)
    verify: dict[int, float] = field(default_factory=dict)  # by rows: its own time, lately
    drift: float = 1.0  # how far the counts in use moved since calibration (a product)
    rounds: int = 0  # verify calls timed since calibration: the clock of `verify_age`
    context: float = PREFIX  # tokens of context behind the rows of the last call timed
    timings: dict[int, Timing] = field(default_factory=dict)  # verify rows: when last timed

    def __post_init__(self) -> None:
        for rows, seconds in self.verify.items():  # the calibrated curve, measured at PREFIX
            self.timings.setdefault(rows, Timing(floor=seconds))

    def ready_for(self, source: str) -> bool:
        """Whether a round drafted by source can be priced yet."""
        return bool(self.verify) and (source != "model" or bool(self.draft))

    def draft_cost(self, source: str, k: int, rows: int = 1, first: float | None = None) -> float:
        """Seconds to draft k tokens for `rows` requests at once: k model steps, or a lookup.
        The first step carries `first` rows (default `rows`): what the draft model has not read
        yet, one token a request or two after a round that kept every draft (see the
        controller's `price_round`)."""
        if source != "model" or not k:
            return 0.0
        return _price(self.draft, first or rows) + (k - 1) * _price(self.draft, rows)

    def catch_up_cost(self, lag: int) -> float:
        """Seconds the draft model spends catching up on `lag` tokens before drafting (the
        prompt on a first draft, or the rounds a lookup or K = 0 served), beyond a plain step:
        its first step carries `lag` tokens instead of one (or a call of its own does), priced
        as a draft step of that many rows, which does the same work, less a step of one row."""
        if lag <= 1 or not self.draft:
            return 0.0
        return max(_price(self.draft, lag) - _price(self.draft, 1), 0.0)

    def verify_cost(self, rows: int) -> float:
        """c_verify for a call of `rows` rows, from the measured curve carried by the drift."""
        return _price(self.curve(), rows)

    def observe_draft(self, rows: int, seconds: float) -> None:
        """One batched draft step of `rows` rows (its padding included)."""
        self.draft[rows] = _blend(self.draft.get(rows), seconds)

    def observe_verify(self, rows: int, seconds: float, context: float | None = None) -> None:
        """One verify call, its rows' mean context given where known: refines its count, and
        where that count is fresh, the drift (see the module docstring). A stale count's price
        is from another spell of the machine's load: a faster time replaces it (noise only ever
        adds time), a slower one counts STALE_WEIGHT. Blended like a fresh count's, a price 15 %
        dear took five re-timings, 84 rounds, to give way to the faster call
        (tests/test_controller.py's case). Taking a slower time as is, one slow call priced the
        target alone out of `_refresh`'s reach for good: 8 clients drafted at K 1.9 where K = 0
        was best (0.83x the target alone). A count timed far from its last context takes its
        time as is, and its second there the faster of the two (`curve`); its next SETTLE
        timings refine it alone."""
        if context is not None:
            self.context = context
        old = self.verify.get(rows)
        timing = self.timings.setdefault(rows, Timing())
        if old is None or far(timing.context, self.context):
            new, timing.once = seconds, True
            if old is None and not far(PREFIX, self.context):
                timing.floor = seconds
            elif old is not None:
                timing.settling = SETTLE
        elif timing.once:  # the second time here: the faster of the two, as is
            new, timing.once = min(seconds, self.verify[rows] * self._drifted(rows)), False
        else:
            old = self.verify[rows] * self._drifted(rows)
            if self.verify_age(rows) >= STALE_AFTER:
                new = seconds if seconds < old else _blend(old, seconds, STALE_WEIGHT)
            else:
                new = _blend(old, seconds)
                if timing.settling:
                    timing.settling -= 1
                else:
                    self.drift *= new / old
        self.verify[rows] = new
        self.rounds += 1
        timing.drift, timing.round, timing.context = self.drift, self.rounds, self.context

    def verify_age(self, rows: int) -> int:
        """Rounds since a verify call of `rows` rows was last timed (calibration is round 0,
        and so is a count never timed: it is as old as the runtime)."""
        return self.rounds - self.timings.get(rows, UNTIMED).round

    def curve(self) -> dict[int, float]:
        """Each measured count's price now: its own time, scaled by the drift since. A count
        not timed near this context is priced from those that were (`_guess`; see the module
        docstring), and one timed there once at most as the counts timed there more often and
        those guesses price it: the first call of a shape after a long prompt can take twice
        what the next ones do (after 8,000 tokens at 4 clients on a 2-core EPYC, the first
        8-row call of each turn took 2.3-2.5x the 4-row call, the next ones 1.07x), and priced
        at that one time, a batch that learns by looking back stopped drafting for 64 rounds
        where fixed K = 1 ran 1.15x the target alone. A price too low is tried once more and
        then timed: its second time there is the faster of the two (`observe_verify`)."""
        here, away, once = {}, {}, {}
        for n, seconds in self.verify.items():
            own, timing = seconds * self._drifted(n), self.timings.get(n, UNTIMED)
            part = away if far(timing.context, self.context) else once if timing.once else here
            part[n] = own
        if once:
            around = {**here, **{n: self._guess(n, own, here) for n, own in away.items()}}
            here |= {n: min(own, _price(around, n)) if around else own for n, own in once.items()}
        return dict(
            sorted({**here, **{n: self._guess(n, own, here) for n, own in away.items()}}.items())
        )

    def _guess(self, rows: int, own: float, here: dict[int, float]) -> float:
        """The price of a count not timed near this context: at least its calibration scaled
        by the drift (its own time where it has none), at least the dearest narrower count
        timed here, and at least the nearest narrower and the nearest wider counts timed here
        with what calibration put between them and it added or taken away. Each request's
        cache is read once a call whatever its width, so a long context adds about as much to
        either. Priced at its calibration instead, the call without drafts after a 1,000-token
        prompt cost 80 ms where it took 93, while the 2-row call's first timing there (135 ms,
        105 after) priced K = 1 at 1.96x K = 0: the request stopped drafting after its first
        round and sat at K = 0 for 15 rounds (AMX Xeon). Priced as the 4-row call without the
        difference, the 8-row call after 1,000 tokens (1.34x it) looked free, and 4 clients
        drafted three rounds on that guess where the target alone was best."""
        floors = {n: self.timings.get(n, UNTIMED).floor for n in [rows, *here]}
        prices = [own if floors[rows] is None else floors[rows] * self.drift]
        prices += [seconds for n, seconds in here.items() if n < rows]
        if floors[rows] is None:
            return max(prices)
        timed = [n for n in here if floors[n] is not None]
        if narrower := [n for n in timed if n < rows]:
            m = max(narrower)
            prices.append(here[m] + max(0.0, floors[rows] - floors[m]) * self.drift)
        if wider := [n for n in timed if n > rows]:
            m = min(wider)
            prices.append(here[m] - max(0.0, floors[m] - floors[rows]) * self.drift)
        return max(prices)

    def _drifted(self, rows: int) -> float:
        return self.drift / self.timings.get(rows, UNTIMED).drift

    @property
    def draft_step(self) -> float | None:
        """One draft step of one row, as reported beside the verify curve."""
        return _price(self.draft, 1) if self.draft else None


def far(context: float, other: float) -> bool:
    """Whether two contexts are far apart (FAR times and FAR_BY tokens): a prompt's length
    shows in every call's time, a long answer's growth does not need to be told."""
    low, high = sorted((context, other))
    return high > FAR * low + FAR_BY


def _price(curve: dict[int, float], rows: float) -> float:
    larger = [t for n, t in curve.items() if n > rows]
    return min([_interpolate(curve, rows), *larger])


def _interpolate(curve: dict[int, float], rows: float) -> float:
    if rows in curve:
        return curve[rows]
    known = sorted(curve)
    if len(known) == 1:
        return curve[known[0]]
    below = [n for n in known if n < rows][-2:]
    above = [n for n in known if n > rows][:2]
    if below and above:
        a, b = below[-1], above[0]
    else:
        a, b = below if below else above
    slope = (curve[b] - curve[a]) / (b - a)
    return max(curve[a] + slope * (rows - a), 1e-9)


def _blend(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else (1 - weight) * old + weight * min(new, SPIKE * old)


def batch_sizes(slots: int) -> list[int]:
    """The batch sizes calibrated: 1, then powers of two up to the engine's slots, and all."""
    sizes = {1, slots}
    size = 2
    while size < slots:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def measure_call_costs(
    engine: Engine, widths: list[int], batches: list[int], repeats: int = 2
) -> dict[int, float]:
    """Seconds of one call of B rows x S new tokens for each B in batches and S in widths, after
    a `PREFIX`-token context in every row, keyed by rows B·S (the fastest of `repeats`: the
    machine is shared, and noise only ever adds time; on a tie of rows the cheaper shape)."""
    prefix = min(PREFIX, engine.capacity - max(widths))
    for slot in range(max(batches)):
        engine.reset(slot)
        engine.forward_rows([(slot, [1] * prefix)], last=1)
    curve: dict[int, float] = {}
    for batch in batches:
        for width in widths:
            times = []
            for _ in range(repeats):
                for slot in range(batch):
                    engine.rollback(prefix, slot)
                start = time.perf_counter()
                engine.forward_rows([(slot, [1] * width) for slot in range(batch)])
                times.append(time.perf_counter() - start)
            rows = batch * width
            curve[rows] = min(curve.get(rows, float("inf")), *times)
    for slot in range(max(batches)):
        engine.reset(slot)
    return curve


def measure_costs(
    draft: Engine | None,
    target: Engine,
    k_max: int,
    repeats: int = 2,
    slots: int = 1,
    k_lookup: int = 0,
) -> StepCosts:
    """Measure the verify curve (K = 0..k_max at batch 1, then a few longer windows up to
    k_lookup; a few widths at each larger batch size up to `slots`) and the draft step by batch
    size (a bundle without a draft model speculates by lookup only: no step to measure)."""
    batches = batch_sizes(slots)
    longer = {w for w in (16, 24, 32, 48) if w < k_lookup} | {k_lookup + 1}
    widths = sorted(set(range(1, k_max + 2)) | {w for w in longer if w > k_max + 1})
    verify = measure_call_costs(target, widths, [1], repeats)
    if slots > 1:
        widths = sorted({1, 2, k_max // 2 + 1, k_max + 1})
        _keep_cheaper(verify, measure_call_costs(target, widths, batches[1:], repeats))
    costs = StepCosts(verify=verify)
    if draft is not None:
        costs.draft = measure_call_costs(draft, [1], batches, repeats)
        _keep_cheaper(costs.draft, measure_call_costs(draft, CATCH_UP_WIDTHS, [1], repeats))
    return costs


def _keep_cheaper(curve: dict[int, float], measured: dict[int, float]) -> None:
    """Add a second grid's counts to a curve; on a tie of rows the cheaper shape is the price."""
    for rows, seconds in measured.items():
        curve[rows] = min(seconds, curve.get(rows, seconds))
