"""Acceptance that a runtime's requests share, per draft source: where each request's own
estimate starts and what it is shrunk toward (the controller's `Adaptive.alpha`), as the
costs they share are the machine's (costs.py). After a long prompt, each part of an answer
(its opening, its body) is counted apart too, under its own key (`Adaptive.locate`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from specrt.runtime.runs import JudgedRuns

POOL_WARM = 8.0  # drafts of a source a runtime judges (decayed) before it prices that source
GONE = 0.01  # a request's share of the counts, faded below this, is forgotten
DOUBT_Z, DOUBT_AFTER = 1.0, 4.0  # judged drafts bound acceptance (84 %, Wilson) once 4 are judged


@dataclass
class PooledAcceptance:
    """Acceptance per draft source over every request of a runtime, decayed per drafted token:
    what each request's own estimate is shrunk toward. Acceptance belongs to the request, but a
    pair's typical acceptance is known before a request drafts its first token. Started from a
    fixed prior instead, a new request in a busy batch priced drafting below the target alone,
    and a probe there widens every request's call, so it never drafted to learn better
    (measured at 2 clients on the gguf target: K = 0 throughout, 0.80x fixed K = 1).

    A request reads the pool without its own share (`without`): its own drafts already make
    its estimate, and counted twice they made the pool of a runtime serving one request that
    request's first rounds. After a summary of a 1,000-token file, whose opening the draft
    guesses badly, the estimate stayed at those rounds' 0.15 for the rest of the answer (a
    probe restarts a request's estimate from the pool: there, the same rounds), while its
    drafts at K = 1 were kept at 0.51 (0.95x fixed K = 1)."""

    decay: float = 0.99  # the last ~100 drafted tokens of any request
    counts: dict[str, list[float]] = field(default_factory=dict)  # source: [accepted, rejected]
    shares: dict[tuple[int, str], list[float]] = field(default_factory=dict)  # whose counts
    runs: JudgedRuns = field(default_factory=JudgedRuns)  # the same guesses, in order: a shape
    _keys: itertools.count = field(default_factory=itertools.count, repr=False)

    def member(self) -> int:
        """A key for a request whose drafts the pool counts, to read it without them."""
        return next(self._keys)

    def alpha(self, source: str, without: int | None = None) -> float | None:
        """The pooled acceptance of this source (less request `without`'s share), or None before
        any such draft was judged."""
        accepted, rejected = self._counts(source, without)
        if accepted + rejected <= 0:
            return None
        return accepted / (accepted + rejected)

    def warm(self, source: str, without: int | None = None) -> bool:
        """Whether the runtime has judged enough of this source's drafts (POOL_WARM), those of
        request `without` aside, to price them in a batch. Before that, a batch drafts to
        learn (one request of it, joint.py's `_learner`): priced from a fixed prior instead, a
        server that starts under load never drafted (at 2 clients on the gguf target, K = 0
        throughout where fixed K = 1 ran 1.03x faster), since in a batch no probe widens the
        call."""
        return sum(self._counts(source, without)) >= POOL_WARM

    def observe(self, source: str, accepted: int, rejected: int, who: int | None = None) -> None:
        """Count a round's judged drafts, as request `who`'s share where given; every share
        fades with the counts, and one faded to nothing is forgotten."""
        fade = self.decay ** (accepted + rejected)
        for key in [key for key in self.shares if key[1] == source]:
            share = self.shares[key]
            share[0], share[1] = fade * share[0], fade * share[1]
            if sum(share) < GONE:
                del self.shares[key]
        fade_in(self.counts.setdefault(source, [0.0, 0.0]), self.decay, accepted, rejected)
        if who is not None:
            share = self.shares.setdefault((who, source), [0.0, 0.0])
            share[0], share[1] = share[0] + accepted, share[1] + rejected

    def _counts(self, source: str, without: int | None) -> tuple[float, float]:
        accepted, rejected = self.counts.get(source, (0.0, 0.0))
        mine = self.shares.get((without, source), (0.0, 0.0))
        return max(0.0, accepted - mine[0]), max(0.0, rejected - mine[1])


def fade_in(counts: list[float], decay: float, accepted: int, rejected: int) -> None:
    """Add a round's judged drafts to [accepted, rejected] counts, older ones decayed per token."""
    fade = decay ** (accepted + rejected)
    counts[0] = fade * counts[0] + accepted
    counts[1] = fade * counts[1] + rejected


def wilson(counts, side: float) -> float:
    """The one-sided DOUBT_Z Wilson bound of [accepted, rejected] counts' acceptance, upper
    (side 1) or lower (-1); before DOUBT_AFTER were judged, 1 or 0."""
    accepted, rejected = counts
    n = accepted + rejected
    if n < DOUBT_AFTER:
        return max(side, 0.0)
    p, z2 = accepted / n, DOUBT_Z**2
    spread = DOUBT_Z * np.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return float(np.clip((p + z2 / (2 * n) + side * spread) / (1 + z2 / n), 0.0, 1.0))
