"""How many tokens to draft each round: `fixed:K`, `heuristic`, or `adaptive` (the default).

A controller sees what the loop measured (accepted counts, draft and verify seconds) and the
caller's signals (remaining budget, context position, server load), and answers with K and a
reason, so every choice is explainable in the stats.

The adaptive policy maximises expected tokens per second. With per-token acceptance α, a round
of K drafts emits E = (1 - α^(K+1)) / (1 - α) tokens and costs K·c_draft + c_verify(K); α decays
toward recent rounds of this request, while c_draft and the c_verify curve come from `StepCosts`,
which the runtime measures at load and shares across requests (costs belong to the machine, the
acceptance to the request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.costs import StepCosts


@dataclass(frozen=True)
class RoundContext:
    k_max: int  # the bundle's K_max, further capped by budget and context room
    position: int  # tokens in the sequence so far (prompt + emitted)
    load: int = 0  # queue depth / concurrent requests the caller reports
    source: str = "model"  # who drafts this round: "model", "ngram", ... (see drafters)


@dataclass(frozen=True)
class Decision:
    k: int
    reason: str


class Fixed:
    """Always K (capped by what the round has room for)."""

    confidence_threshold = 0.0

    def __init__(self, k: int):
        self.k = k

    def decide(self, ctx: RoundContext) -> Decision:
        k = min(self.k, ctx.k_max)
        return Decision(k, "fixed" if k == self.k else f"fixed, capped to room {ctx.k_max}")

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


class Heuristic:
    """transformers' rule: +2 after a round where every draft was accepted, -1 otherwise."""

    confidence_threshold = 0.0

    def __init__(self, k_min: int = 1, k_max: int = 8, start: int = 4):
        self.k_min, self.k_max, self.k = k_min, k_max, start

    def decide(self, ctx: RoundContext) -> Decision:
        k = min(self.k, ctx.k_max)
        return Decision(k, f"heuristic K={self.k}" + ("" if k == self.k else f", room {k}"))

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if k == 0:
            return
        step = 2 if accepted == k else -1
        self.k = int(np.clip(self.k + step, self.k_min, self.k_max))


@dataclass
class Adaptive:
    """Pick K maximising expected tokens per second from measured acceptance and costs.

    Acceptance is kept per draft source (the draft model, a lookup), since one request may be
    served by both and they accept very differently; a source's draft cost is K model steps,
    or one lookup whatever K (see `StepCosts`).
    """

    k_min: int = 1
    k_max: int = 8
    decay: float = 0.9  # per observed token: the estimate follows the last ~10 drafts
    prior_alpha: float = 0.7
    prior_weight: float = 2.0  # pseudo-tokens behind the prior; they decay like real ones
    confidence_threshold: float = 0.4  # stop drafting when the draft's top probability is below
    long_context: int = 1024  # past this many tokens, K is halved (attention starts to cost)
    costs: StepCosts = field(default_factory=StepCosts)  # shared by the runtime's requests
    counts: dict[str, list[float]] = field(init=False, default_factory=dict)  # [acc., rej.]
    source: str = field(init=False, default="model")  # of the round being decided

    def alpha(self, source: str = "model") -> float:
        """Acceptance per drafted token: the geometric MLE over recent, decayed observations."""
        accepted, rejected = self._counts(source)
        return accepted / (accepted + rejected)

    def _counts(self, source: str) -> list[float]:
        prior = [self.prior_alpha * self.prior_weight, (1 - self.prior_alpha) * self.prior_weight]
        return self.counts.setdefault(source, prior)

    def decide(self, ctx: RoundContext) -> Decision:
        self.source = source = ctx.source
        cap, why = min(self.k_max, ctx.k_max), []
        if ctx.load > 0:
            cap = min(cap, max(self.k_min, self.k_max // (1 + ctx.load)))
            why.append(f"load {ctx.load} caps K at {cap}")
        if ctx.position > self.long_context:
            cap = min(cap, max(self.k_min, self.k_max // 2))
            why.append(f"long context caps K at {cap}")
        if cap <= self.k_min:
            return Decision(cap, "; ".join(why + [f"room for {cap} only"]))
        if not self.costs.ready_for(source):
            k = min(cap, max(self.k_min, 4))
            why.append(f"warming up ({source} alpha={self.alpha(source):.2f})")
            return Decision(k, "; ".join(why))
        alpha = min(self.alpha(source), 0.999)
        candidates = range(self.k_min, cap + 1)
        rates = [self._rate(k, alpha) for k in candidates]
        k = candidates[int(np.argmax(rates))]
        draft_share = self._draft(k) / self._verify(0)
        why.append(
            f"{source} alpha={alpha:.2f} c_draft(K)/c_verify={draft_share:.2f} "
            f"c_verify(K)/c_verify(0)={self._verify(k) / self._verify(0):.2f} "
            f"-> {max(rates):.1f} tok/s"
        )
        return Decision(k, "; ".join(why))

    def _verify(self, k: int) -> float:
        return self.costs.verify_cost(k + 1)  # K drafts are verified with K+1 new tokens

    def _draft(self, k: int) -> float:
        return self.costs.draft_cost(self.source, k)

    def _rate(self, k: int, alpha: float) -> float:
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens / (self._draft(k) + self._verify(k))

    def observe(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if k > 0:
            counts = self._counts(self.source)
            rejected = 1 if accepted < k else 0  # drafts after a rejection are never judged
            fade = self.decay ** (accepted + rejected)
            counts[0] = fade * counts[0] + accepted
            counts[1] = fade * counts[1] + rejected
            self.costs.observe_draft(self.source, draft_s, k)
        self.costs.observe_verify(k + 1, verify_s)


def make_controller(
    spec, k_max: int, costs: StepCosts | None = None, *, bounds: tuple[int, int] | None = None
):
    """`fixed:K`, `heuristic` or `adaptive`; K must fit the bundle's K_max. `adaptive` reads and
    refines `costs` when given (the runtime's shared, calibrated ones), else learns its own.

    bounds = (lowest, highest) K the caller allows (llama.cpp's `speculative.n_min/n_max`):
    the highest is capped at K_max, the lowest must fit under it, and a fixed K must lie inside.

    Anything else with `decide`, `observe` and `confidence_threshold` is a policy already and is
    used as given (one instance per request, since policies keep per-request state).
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
    low = max(low, 1)
    if name == "heuristic":
        return Heuristic(k_min=low, k_max=high, start=int(np.clip(4, low, high)))
    return Adaptive(k_min=low, k_max=high, costs=costs or StepCosts())


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
