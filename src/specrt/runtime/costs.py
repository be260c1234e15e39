"""What a draft step and a verify call cost on this machine, as a function of new tokens.

Costs belong to the engines and the machine, not to one request, so one `StepCosts` lives on the
runtime and every request's adaptive policy reads and refines it. The verify curve is measured,
not modelled: weight-streaming float32 kernels make a 9-token call cost ~1.5x a 1-token call,
while int4 kernels that are compute-bound for more than one row make it 3x or more, and no single
formula fits both. `measure_costs` measures every count the runtime can use once at load time; each
round then refines the count it used (EWMA). Counts never measured are interpolated linearly
between measured neighbours, or extrapolated from the last two. A call with more tokens never
costs less than one with fewer (it could be padded), so a count is never priced above a larger
count's measurement: on a shared machine one noisy sample would otherwise price a K out of
reach for good, since only the K the policy picks get measured again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specrt.engines.base import Engine

SMOOTHING = 0.3  # weight of a new observation: follows load changes within a few rounds
PREFIX = 48  # tokens of context behind a calibration call, a typical short prompt


@dataclass
class StepCosts:
    """Seconds per draft-model step, per lookup (by drafter, whatever K), and per verify call
    by its number of new tokens."""

    draft_step: float | None = None
    verify: dict[int, float] = field(default_factory=dict)
    lookup: dict[str, float] = field(default_factory=dict)

    def ready_for(self, source: str) -> bool:
        """Whether a round drafted by source can be priced yet (a lookup costs ~0 until seen)."""
        return bool(self.verify) and (source != "model" or self.draft_step is not None)

    def draft_cost(self, source: str, k: int) -> float:
        """Seconds to draft k tokens: k model steps, or one lookup."""
        if source == "model":
            return k * self.draft_step
        return self.lookup.get(source, 0.0)

    def observe_draft(self, source: str, seconds: float, steps: int) -> None:
        if source == "model":
            self.draft_step = _blend(self.draft_step, seconds / steps)
        else:
            self.lookup[source] = _blend(self.lookup.get(source), seconds)

    def observe_verify(self, new_tokens: int, seconds: float) -> None:
        self.verify[new_tokens] = _blend(self.verify.get(new_tokens), seconds)

    def verify_cost(self, new_tokens: int) -> float:
        """c_verify for a call with new_tokens tokens, from the measured curve."""
        larger = [t for n, t in self.verify.items() if n > new_tokens]
        return min([self._raw_cost(new_tokens), *larger])

    def _raw_cost(self, new_tokens: int) -> float:
        if new_tokens in self.verify:
            return self.verify[new_tokens]
        known = sorted(self.verify)
        if len(known) == 1:
            return self.verify[known[0]]
        below = [n for n in known if n < new_tokens][-2:]
        above = [n for n in known if n > new_tokens][:2]
        if below and above:
            a, b = below[-1], above[0]
        else:
            a, b = below if below else above
        slope = (self.verify[b] - self.verify[a]) / (b - a)
        return max(self.verify[a] + slope * (new_tokens - a), 1e-9)

    def curve(self) -> dict[int, float]:
        return dict(sorted(self.verify.items()))


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def measure_verify_curve(
    engine: Engine, max_new_tokens: int, repeats: int = 2, prefix: int = PREFIX
) -> dict[int, float]:
    """Seconds of one call with 1..max_new_tokens new tokens after a `prefix`-token context
    (the fastest of `repeats`: the machine is shared, and noise only ever adds time)."""
    prefix = min(prefix, engine.capacity - max_new_tokens)
    engine.reset()
    engine.forward([1] * prefix, last=1)
    curve = {}
    for count in range(1, max_new_tokens + 1):
        times = []
        for _ in range(repeats):
            engine.rollback(prefix)
            start = time.perf_counter()
            engine.forward([1] * count)
            times.append(time.perf_counter() - start)
        curve[count] = min(times)
    engine.reset()
    return curve


def measure_costs(draft: Engine | None, target: Engine, k_max: int, repeats: int = 2) -> StepCosts:
    """Measure the target's verify curve for K = 0..k_max and the draft's step cost (a bundle
    without a draft model speculates by lookup only: there is no step to measure)."""
    costs = StepCosts(verify=measure_verify_curve(target, k_max + 1, repeats))
    if draft is not None:
        costs.draft_step = measure_verify_curve(draft, 1, repeats)[1]
    return costs
