"""What a draft step and a verify call cost on this machine: one model of the verify call,
measured once, its two parts scaled by how far the machine moved since.

Costs belong to the engines and the machine, not to one request, so one `StepCosts` lives on the
runtime and every round reads and refines it. A verify call of B requests with K drafts each
carries B·(K+1) rows (padding included), a draft step one row per drafting request. Its price:

    reads      = curve(1) + context x per_request x B      (the weights, each request's cache)
    arithmetic = curve(rows) - curve(1) + B x attention(context, rows / B)
    price      = drift[0] x reads + drift[1] x arithmetic

- `curve` is measured at load, by rows, after a PREFIX-token context (`measure_costs`):
  weight-streaming float32 kernels make a 9-row call cost ~1.5x a 1-row call, int4 kernels
  that are compute-bound past one row 3x or more, and no single formula fits both. Counts never
  measured are interpolated between measured neighbours (or extrapolated from the last two), and
  no count is priced above a larger count's price (it could be padded). A one-row call is taken
  as all reads; what more rows add, as arithmetic.
- The context term is measured at load too, once the curve is: each request's cache is read
  once a call whatever its width, and each row attends over it. On a 2-core AVX-512 EPYC (gguf
  1.5B target), 8,000 tokens of context added ~43 ms a request to a call of one token a
  request and ~4.5 ms more a row: a 4-row call after 4,000 tokens took 1.3x the 1-row one where
  calibration at 48 tokens said 1.55x, and that ratio is what decides whether drafting pays.
  `attention` is `per_row` a row and a token, except for a lone request's narrow calls (1-3
  tokens), which are timed at knots of context up to 8,192 tokens (`measure_narrow`) and
  priced as timed there: after a long prompt a lone request chooses between them, and the
  line through the rows priced them 0.05 wrong (RMS) on the ratio that decides it. A batch's
  are priced by the line: B requests' narrow gap is not B times one request's (see
  `_attention`).
- `drift` is how far the machine's reads and arithmetic moved since calibration: each call
  timed moves them a SMOOTHING share of the way to its time (never more than SPIKE times the
  price), by the least change that explains it, so a narrow call moves mostly the reads and a
  compute-bound one mostly the arithmetic. Two, not one: on the EPYC a slow spell slowed the
  reads and left the arithmetic alone. Turn by turn after 4,000 tokens at 4 clients, a round
  without drafts took 0.18-0.43 s while a round at K = 1 cost 0.10-0.16 s more in each (its
  ratio to the round without drafts fell from 1.58x to 1.27x as the round slowed); one drift
  scaling both priced drafting out in the slow turns, where fixed K = 1 won. At 8 short-prompt
  clients, where a slowdown did scale the compute-bound wide calls, a shift learnt on the narrow
  calls underpriced them (0.86x the target alone): there the least change moves both.

Why a model and not a time per count: a shared machine swings by a third within a minute, in
spells of seconds (the same 16-row call at 4,000 tokens took 0.29 s one minute and 0.48-0.59 s,
five times in a row, the next). A table of each count's own last time compares counts timed in
different spells. At 4 clients after 4,000 tokens, the drafting call priced so was 1.28-1.58x
the call without drafts where its rounds took 1.07-1.55x the target alone's, the batch stopped
drafting where fixed K = 1 won, and keeping such a table honest took re-timing rounds off the
course, staleness rules, and guesses for counts not timed at a new context. Priced by the
model, two options of one round differ by what the kernels put between them, whatever spell
each was last timed in. What it gives up: a count that calibration itself timed in a slow
spell keeps that error, so calibration takes the fastest of its repeats, each repeat a pass
over the whole grid (a spell of seconds falls on one pass, not on every repeat of one count).

A lookup (n-gram, prediction) costs nothing next to a call (about 0.05 ms at 2,048 tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specrt.engines.base import Engine

SMOOTHING = 0.3  # weight of a new observation: follows load changes within a few rounds
SPIKE = 1.5  # an observation counts at most this many times the estimate it refines
DRIFT_FLOOR = 0.1  # no drift goes under this: a run of fast calls never prices a part as free
PREFIX = 48  # tokens of context behind a calibration call, a typical short prompt
LONG = 4096  # tokens of context behind the calls that measure the context term
# Draft calls of this many new tokens in one row: the curve a catch-up (the prompt, rounds served
# by a lookup or at K = 0) is priced on, extrapolated past 33 until the rounds measure catch-ups
# of their own sizes (draft_together reports them). With draft steps alone a one-slot runtime
# knew one point of the draft curve, and priced every catch-up at nothing.
CATCH_UP_WIDTHS = [16, 33]
# The narrow calls (K = 0-2, what a request after a long prompt chooses between) are timed near
# the contexts requests bring, not modelled from 48 tokens: see `measure_narrow`.
NARROW = (1, 2, 3)
KNOTS = (1024, 2048, 4096, 8192)  # the contexts they are timed after (those the engine holds)
ROTATIONS = 16  # calls of each width at each knot, rotated back to back; their medians count


@dataclass
class StepCosts:
    """Seconds per draft-model step by its rows, and the model of a verify call (see the module
    docstring): its curve by rows after PREFIX tokens, seconds per token of context a request
    (`per_request`) and a row (`per_row`), and how far the machine's reads and arithmetic
    moved since calibration (`drift`)."""

    draft: dict[int, float] = field(default_factory=dict)
    verify: dict[int, float] = field(default_factory=dict)  # by rows, after PREFIX tokens
    per_request: float = 0.0  # seconds a call spends per request per token of its context
    per_row: float = 0.0  # ...and per row per token of its context
    # by knot (tokens of context): each NARROW width's call over the 1-token call, in seconds
    narrow: dict[int, dict[int, float]] = field(default_factory=dict)
    drift: tuple[float, float] = (1.0, 1.0)  # factors on a call's (reads, arithmetic)
    rounds: int = 0  # verify calls timed since calibration
    context: float = PREFIX  # tokens of context behind the rows of the last call timed
    learning: bool = field(init=False)  # no curve given: each count priced at its own times

    def __post_init__(self) -> None:
        self.learning = not self.verify

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

    def verify_cost(self, rows: int, requests: int = 1) -> float:
        """c_verify for a call of `rows` rows over `requests` requests' caches, at the context
        of the last call timed (a batch's next round reads about the same)."""
        reads, arithmetic = self._parts(rows, requests)
        return self.drift[0] * reads + self.drift[1] * arithmetic

    def observe_draft(self, rows: int, seconds: float) -> None:
        """One batched draft step of `rows` rows (its padding included)."""
        self.draft[rows] = _blend(self.draft.get(rows), seconds)

    def observe_verify(
        self, rows: int, seconds: float, context: float | None = None, requests: int = 1
    ) -> None:
        """One verify call, its rows' mean context given where known: moves the drifts a
        SMOOTHING share of the way to what it took, by the least change that explains it (the
        gap shared between reads and arithmetic as the call's own parts are: a narrow call's
        mostly to the reads, a compute-bound one's to the arithmetic). One call at most SPIKE
        times its price (a stall, or a first call of a new shape that allocates: after 8,000
        tokens at 4 clients, each turn's first 8-row call took 2.3-2.5x the next ones) moves
        every price 15 % at most for a round or two, where as a count's own time it priced
        drafting out for 64 rounds. A runtime not calibrated (`learning`) has no model: it
        prices each count at its own times, as they come."""
        if context is not None:
            self.context = context
        self.rounds += 1
        if self.learning:
            self.verify[rows] = _blend(self.verify.get(rows), seconds)
            return
        (reads, arithmetic), (on_reads, on_arithmetic) = self._parts(rows, requests), self.drift
        price = on_reads * reads + on_arithmetic * arithmetic
        gap = min(seconds, SPIKE * price) - price
        step = SMOOTHING * gap / max(reads * reads + arithmetic * arithmetic, 1e-12)
        self.drift = (
            max(on_reads + step * reads, DRIFT_FLOOR),
            max(on_arithmetic + step * arithmetic, DRIFT_FLOOR),
        )

    def curve(self, requests: int = 1) -> dict[int, float]:
        """Each calibrated count's price now, for a call over `requests` requests' caches."""
        return {rows: self.verify_cost(rows, requests) for rows in sorted(self.verify)}

    def _parts(self, rows: int, requests: int) -> tuple[float, float]:
        """A call's seconds at calibration's speeds, as (reads, arithmetic): the weights read
        once a call (the one-row call's time) and each request's cache, then what its rows add
        (the curve above one row) and their attention over the context."""
        longer = max(self.context - PREFIX, 0.0)
        weights = _price(self.verify, 1)
        reads = weights + longer * self.per_request * requests
        attention = requests * self._attention(rows / requests, requests == 1)
        arithmetic = max(max(_price(self.verify, rows) - weights, 0.0) + attention, 0.0)
        return reads, arithmetic

    def _attention(self, width: float, lone: bool) -> float:
        """Seconds a request's `width` rows spend on its context past PREFIX tokens, beyond the
        reads: `per_row` a row and a token, or, for a lone request's NARROW width timed at the
        knots (`narrow`), what makes its call there cost what it was timed to cost over the
        1-token call, interpolated between the knots (from nothing at PREFIX tokens) and
        carried on at `per_row` past the last. A wider call adds `per_row` for each row past
        the widest narrow one: the wide counts decide short prompts' rounds, and are rarely
        chosen after long ones.
        Not for a batch: priced as B times one request's gap at the knots, its error was B
        times that gap's (timed as the difference of two calls' medians) and its rows take
        the batch's path through attention, not the lone row's (exporter/attention.py). On a
        2-core AVX-512 EPYC after 1,040 tokens, seven loads at 4 clients priced the 8-row call
        1.27-1.74x the 4-row call where it took 1.27-1.47x (RMS error 0.27; by the line,
        `per_row` fitted on a gap 8 rows wide, 0.11), three at 2 clients 0.17 (the line 0.03;
        benchmarks/calibration_error.py --clients). After 4,040 and 8,040 tokens both err
        0.1-0.2 dear: there a batch's calls swing with the machine's memory traffic."""
        longer = max(self.context - PREFIX, 0.0)
        timed = [w for w in NARROW if w <= width and all(w in t for t in self.narrow.values())]
        if not self.narrow or not timed or not lone:
            return longer * self.per_row * width
        widest = timed[-1]
        extra = max(_price(self.verify, widest) - _price(self.verify, 1), 0.0)
        points = [(PREFIX, 0.0)] + [
            (knot, self.per_row * (knot - PREFIX) + gaps[widest] - extra)
            for knot, gaps in sorted(self.narrow.items())
        ]
        return _along(points, self.context, self.per_row * widest) + (
            longer * self.per_row * (width - widest)
        )

    @property
    def draft_step(self) -> float | None:
        """One draft step of one row, as reported beside the verify curve."""
        return _price(self.draft, 1) if self.draft else None


def _along(points: list[tuple[float, float]], x: float, slope: float) -> float:
    """The line through `points` (sorted by x) at x, and `slope` past the last of them."""
    last_x, last_y = points[-1]
    if x >= last_x:
        return last_y + slope * (x - last_x)
    return float(np.interp(x, *zip(*points, strict=True)))


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
    a `PREFIX`-token context in every row, keyed by rows B·S (the fastest of `repeats` passes
    over the grid: the machine is shared, and noise only ever adds time; on a tie of rows the
    cheaper shape)."""
    shapes = [(batch, width) for batch in batches for width in widths]
    short = min(PREFIX, engine.capacity - max(widths))
    curve: dict[int, float] = {}
    for (_, batch, width), seconds in _time_shapes(engine, shapes, [short], repeats).items():
        rows = batch * width
        curve[rows] = min(curve.get(rows, float("inf")), seconds)
    return curve


def measure_context(engine: Engine, widths: list[int], repeats: int = 2) -> tuple[float, float]:
    """Seconds a call spends per token of context a request and a row (`StepCosts.per_request`,
    `per_row`): the narrowest and the widest call of one request, timed after PREFIX and after
    LONG tokens in each pass, the gaps fitted (`fit_context`). One request, not a batch: a
    batch's caches are read as one request's are, once each (after 4,096 tokens on a 2-core
    EPYC, 4 requests' gap was 4.0x one request's at one token each), and a batch of long
    caches is what a neighbour's memory traffic slows: in three calibrations of five, the
    4-request calls after 4,096 tokens took 2.2x their usual time while one request's did not,
    and the term fitted on them was 4x too dear. (0, 0) where the engine holds no more than a
    short context."""
    long = min(LONG, engine.capacity - max(widths))
    if long <= 2 * PREFIX:
        return 0.0, 0.0
    shapes = [(1, min(widths)), (1, max(widths))]
    times = _time_shapes(engine, shapes, [long, PREFIX], repeats)
    gaps = {(b, w): times[long, b, w] - times[PREFIX, b, w] for b, w in shapes}
    return fit_context(gaps, long - PREFIX)


def fit_context(gaps: dict[tuple[int, int], float], tokens: int) -> tuple[float, float]:
    """(per_request, per_row) whose context term best gives these gaps, each the seconds that
    `tokens` more tokens of context added to a call of (requests, width): least squares,
    neither term below 0 (a negative one is noise: the other term is fitted alone)."""
    terms = tokens * np.array([[b, b * w] for b, w in gaps], dtype=float)
    seconds = np.array(list(gaps.values()))
    fit = np.linalg.lstsq(terms, seconds, rcond=None)[0]
    if fit.min() < 0:
        alone = [np.linalg.lstsq(terms[:, [i]], seconds, rcond=None)[0][0] for i in (0, 1)]
        i = int(np.argmax(alone))
        fit = np.zeros(2)
        fit[i] = max(alone[i], 0.0)
    return float(fit[0]), float(fit[1])


def measure_narrow(
    engine: Engine, widths: list[int], knots: list[int], rotations: int = ROTATIONS
) -> dict[int, dict[int, float]]:
    """Seconds each width's call of one request takes over the 1-token call after each knot's
    context (`StepCosts.narrow`), never below a narrower width's. Why timed there and not
    modelled: whether a lone request drafts after a long prompt turns on that ratio, and on a
    2-core EPYC after 4,040 tokens the model (the curve after 48 tokens, the fastest of two
    passes, plus a context term linear in the rows) priced the 2-token call 1.04-1.22x the
    1-token call over 18 loads where each load's calls took 1.10-1.17x (RMS error 0.054);
    4,048 more tokens added 0.2-5.8 ms to the 2nd token where the line said 3-4 ms. Timed at
    4,096 tokens alone, the error there was 0.032 over 13 loads but 0.075 at 8,040 tokens,
    extrapolated: hence knots up to the contexts requests bring. At these four, eight loads
    erred 0.040 over five contexts where the model alone erred 0.055
    (benchmarks/calibration_error.py). Nothing to time where no width but one is asked."""
    if not knots or len(widths) < 2:
        return {}
    fill_slots(engine, 1, max(knots))
    narrow = {}
    for knot in sorted(knots, reverse=True):  # each call rolls the slot back
        medians = time_rotated(engine, knot, widths, rotations)
        gaps = np.maximum.accumulate([max(medians[w] - medians[1], 0.0) for w in widths])
        narrow[knot] = {w: float(g) for w, g in zip(widths, gaps, strict=True)}
    engine.release(0)
    return narrow


def time_rotated(
    engine: Engine, context: int, widths: list[int], rotations: int, batch: int = 1
) -> dict:
    """Each width's median call of `batch` requests after `context` tokens each (the first
    slots, filled by `fill_slots`): the widths timed back to back, `rotations` times, each
    first in turn, so a spell of the shared machine falls on a rotation's calls alike."""
    times: dict[int, list[float]] = {w: [] for w in widths}
    for i in range(rotations):
        k = i % len(widths)
        for width in widths[k:] + widths[:k]:
            times[width].append(time_call(engine, context, batch, width))
    return {w: float(np.median(t)) for w, t in times.items()}


def _time_shapes(engine: Engine, shapes, contexts: list[int], repeats: int) -> dict:
    """The fastest of `repeats` passes at each (batch, width) shape, after each of `contexts`
    tokens (descending: a pass fills the rows once and rolls them back), keyed by (context,
    batch, width)."""
    slots = max(batch for batch, _ in shapes)
    fastest: dict = {}
    for _ in range(repeats):
        fill_slots(engine, slots, max(contexts))
        for context in contexts:
            for batch, width in shapes:
                seconds = time_call(engine, context, batch, width)
                key = (context, batch, width)
                fastest[key] = min(fastest.get(key, float("inf")), seconds)
    for slot in range(slots):
        engine.release(slot)
    return fastest


def time_call(engine: Engine, context: int, batch: int, width: int) -> float:
    """Seconds of one call of `width` tokens in each of the first `batch` slots, each rolled
    back to `context` positions first (filled by `fill_slots`)."""
    for slot in range(batch):
        engine.rollback(context, slot)
    start = time.perf_counter()
    engine.forward_rows([(slot, [1] * width) for slot in range(batch)])
    return time.perf_counter() - start


def fill_slots(engine: Engine, slots: int, context: int) -> None:
    """`context` positions in each of the first `slots` slots, cheaply: what they hold is
    never read back, only how many they are. One slot reads PREFIX tokens, its keys and values
    are written again up to `context` and copied to the others where the backend keeps a host
    cache; elsewhere each slot reads the tokens."""
    engine.reset(0)
    engine.forward_rows([(0, [1] * min(PREFIX, context))], last=1)
    chunk = engine.read_positions(0, 0, engine.lengths[0]) if context > PREFIX else None
    for slot in range(slots):
        if slot and engine.copy_prefix(0, slot, context):
            continue
        if slot:
            engine.reset(slot)
        while (have := engine.lengths[slot]) < context:
            n = min(context - have, PREFIX if chunk is not None else 512)
            if chunk is not None:
                engine.write_positions(slot, [1] * n, chunk[:, :n])
            else:
                engine.forward_rows([(slot, [1] * n)], last=1)


def measure_costs(
    draft: Engine | None,
    target: Engine,
    k_max: int,
    repeats: int = 2,
    slots: int = 1,
    k_lookup: int = 0,
    longest: int | None = None,
    knots: tuple[int, ...] = KNOTS,
) -> StepCosts:
    """Measure the verify curve (K = 0..k_max at batch 1, then a few longer windows up to
    k_lookup; a few widths at each larger batch size up to `slots`), its context term, the
    narrow calls at each knot up to `longest` tokens of context (the engine's capacity when
    not given), and the draft step by batch size (a bundle without a draft model speculates
    by lookup only: no step to measure)."""
    batches = batch_sizes(slots)
    longer = {w for w in (16, 24, 32, 48) if w < k_lookup} | {k_lookup + 1}
    widths = sorted(set(range(1, k_max + 2)) | {w for w in longer if w > k_max + 1})
    verify = measure_call_costs(target, widths, [1], repeats)
    widths = sorted({1, 2, k_max // 2 + 1, k_max + 1})  # at each batch size
    if slots > 1:
        _keep_cheaper(verify, measure_call_costs(target, widths, batches[1:], repeats))
    per_request, per_row = measure_context(target, widths, repeats)
    costs = StepCosts(verify=verify, per_request=per_request, per_row=per_row)
    narrow = [w for w in NARROW if w <= k_max + 1]
    reach = min(longest or target.capacity, target.capacity - max(narrow))
    costs.narrow = measure_narrow(target, narrow, [k for k in knots if k <= reach])
    if draft is not None:
        costs.draft = measure_call_costs(draft, [1], batches, repeats)
        _keep_cheaper(costs.draft, measure_call_costs(draft, CATCH_UP_WIDTHS, [1], repeats))
    return costs


def _keep_cheaper(curve: dict[int, float], measured: dict[int, float]) -> None:
    """Add a second grid's counts to a curve; on a tie of rows the cheaper shape is the price."""
    for rows, seconds in measured.items():
        curve[rows] = min(seconds, curve.get(rows, seconds))
