"""Acceptance that a runtime's requests share, per draft source: where each request's own
estimate starts and what it is shrunk toward (the controller's `Adaptive.alpha`), as the
costs they share are the machine's (costs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

POOL_WARM = 8.0  # drafts of a source a runtime judges (decayed) before it prices that source


@dataclass
class PooledAcceptance:
    """Acceptance per draft source over every request of a runtime, decayed per drafted token:
    what each request's own estimate is shrunk toward. Acceptance belongs to the request, but a
    pair's typical acceptance is known before a request drafts its first token. Started from a
    fixed prior instead, a new request in a busy batch priced drafting below the target alone,
    and a probe there widens every request's call, so it never drafted to learn better
    (measured at 2 clients on the gguf target: K = 0 throughout, 0.80x fixed K = 1)."""

    decay: float = 0.99  # the last ~100 drafted tokens of any request
    counts: dict[str, list[float]] = field(default_factory=dict)  # source: [accepted, rejected]

    def alpha(self, source: str) -> float | None:
        """The pooled acceptance of this source, or None before any of its drafts was judged."""
        if source not in self.counts:
            return None
        accepted, rejected = self.counts[source]
        return accepted / (accepted + rejected)

    def warm(self, source: str) -> bool:
        """Whether the runtime has judged enough of this source's drafts (POOL_WARM) to price
        them in a batch. Before that, a batch drafts to learn: priced from a fixed prior
        instead, a server that starts under load never drafted (at 2 clients on the gguf
        target, K = 0 throughout where fixed K = 1 ran 1.03x faster), since in a batch no probe
        widens the call."""
        return sum(self.counts.get(source, ())) >= POOL_WARM

    def observe(self, source: str, accepted: int, rejected: int) -> None:
        fade_in(self.counts.setdefault(source, [0.0, 0.0]), self.decay, accepted, rejected)


def fade_in(counts: list[float], decay: float, accepted: int, rejected: int) -> None:
    """Add a round's judged drafts to [accepted, rejected] counts, older ones decayed per token."""
    fade = decay ** (accepted + rejected)
    counts[0] = fade * counts[0] + accepted
    counts[1] = fade * counts[1] + rejected
