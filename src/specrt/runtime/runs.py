"""What each K yields on the draft's guesses as they were judged, in order: the shape of a
round's price beside its acceptance.

pricing.py's `expected_tokens` takes every draft as kept or not on its own, at one acceptance.
The draft model's guesses are not: a guess after a kept one is kept more often, and a round
that kept all its drafts starts the next at an easier place. After 8,000 tokens at 4 clients
(AMX Xeon), fixed K = 2's rounds emitted 1.95 tokens a request where the price from K = 1's
acceptance said 1.83, so K = 2 priced within the tie margin of K = 1 (joint.py's `K_MARGIN`),
the batch took K = 1 and ran 0.94x fixed K = 2.

With greedy decoding a guess is a function of the text before it, so the judged guesses of an
answer, in order, say what any fixed K would have kept there: a round starts after a rejected
guess (or after its bonus token) and keeps the run of kept guesses before the next rejection,
up to K. Every emitted token's guess is judged once while a request drafts: its drafts by the
target, and the token the target added after a round that kept them all (its bonus) by the
draft model's next step, which reads that token after the last draft anyway (drafting.py).
A look-back judges the guesses at the tokens it catches up on, in order (drafters.py), so a
batch that waits at K = 0 through its answers' openings still learns their runs. A stretch
with neither is a gap; a run is counted from its first rejection on.

`JudgedRuns` keeps a runtime's last judged guesses as runs of kept ones, each ended by a
rejection or a gap, and `JudgedRuns.shape` turns them into one factor per K: the tokens a
round at K yields on them, over what `expected_tokens` gives at the acceptance that drafting
at the request's own K counts on the same guesses, relative to that ratio at K = 1 (whether to
draft at all stays the estimate's: unnormalised, look-backs' counts priced K = 1 5 % low and
held a replayed batch after 8,000 tokens at K = 0). Guesses drawn independently give 1 at
every K. A few runs say little, so the factor is shrunk toward 1 by PRIOR rejections' worth:
weighted by guesses instead, the high K's factors on short prompts (long runs, few of them)
moved on noise and took 1 client from 0.992x to 0.972x the best fixed K (replayed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

LIMIT = 1024  # judged guesses a runtime keeps per key, its last
PRIOR = 256.0  # rejections' worth of the independent shape (1 at every K) behind each factor
PART_AFTER = 256  # guesses a part of the answers must hold before its own runs price it
SPREAD = (0.8, 1.25)  # no factor leaves this range, whatever a few hundred guesses say
TOP = 0.999  # acceptance is taken at most this (expected_tokens divides by 1 - alpha)


@dataclass
class _Open:
    """A request's run in progress: its kept guesses since its last rejection, whether one was
    seen (`anchored`: a run counts from a rejection on), and whether the token after its last
    round's drafts (its bonus) awaits its judgement."""

    kept: int = 0
    anchored: bool = False
    pending: bool = False


@dataclass
class JudgedRuns:
    """A runtime's last LIMIT judged guesses per key (a draft source, or an answer's part),
    over every request, as runs: (kept guesses, ended by a rejection)."""

    runs: dict[str, deque[tuple[int, bool]]] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)  # guesses each key's runs hold
    open: dict[tuple[int, str], _Open] = field(default_factory=dict)
    _shapes: dict[tuple, tuple[int, list[float]]] = field(default_factory=dict, repr=False)
    _changes: int = field(default=0, repr=False)  # runs closed so far: when a shape is stale

    def drafted(self, who: int, keys, k: int, kept: int) -> None:
        """A round of `k` drafts by request `who`, `kept` of them kept (k = 0: a gap)."""
        for key in keys:
            run = self.open.setdefault((who, key), _Open())
            if run.pending or not k:  # its bonus went unjudged, or a token without a guess
                self._close(key, run, False)
            if not k:
                continue
            run.kept += kept
            if kept < k:
                self._close(key, run, True)
            run.pending = kept == k

    def bonus(self, who: int, keys, kept: bool) -> None:
        """The draft model's guess at the bonus token of request `who`'s last round, judged."""
        for key in keys:
            run = self.open.get((who, key))
            if run is None or not run.pending:
                continue
            run.pending = False
            self._judge(key, run, kept)

    def looked(self, who: int, keys, guesses) -> None:
        """A look-back's guesses by request `who`, kept or not, in order, after a gap (the
        rounds it caught up on drafted none). The run they end in stays open: the token its
        round's target adds awaits its judgement, as a bonus token does (the next round's
        first draft step reads it after the last looked-back one)."""
        for key in keys:
            run = self.open.setdefault((who, key), _Open())
            self._close(key, run, False)
            for kept in guesses:
                self._judge(key, run, kept)
            run.pending = True

    def _judge(self, key: str, run: _Open, kept: bool) -> None:
        """One more guess of a run in progress: kept, it lengthens the run; not, it ends it."""
        if kept:
            run.kept += 1
        else:
            self._close(key, run, True)

    def _close(self, key: str, run: _Open, rejected: bool) -> None:
        """End a run at a rejection (counted once anchored) or at a gap (its kept guesses
        counted where anchored: a fixed K's full rounds in it happened)."""
        if run.anchored:
            runs = self.runs.setdefault(key, deque())
            runs.append((run.kept, rejected))
            self.totals[key] = self.totals.get(key, 0) + run.kept + rejected
            self._changes += 1
            while self.totals[key] > LIMIT:
                m, r = runs.popleft()
                self.totals[key] -= m + r
        run.kept, run.pending = 0, False
        run.anchored = rejected

    def judged(self, key: str) -> int:
        """Guesses the runs of `key` hold."""
        return self.totals.get(key, 0)

    def rejections(self, key: str) -> int:
        """Rejections the runs of `key` hold: the evidence behind its shape (see `_shape`)."""
        return sum(rejected for _, rejected in self.runs.get(key, ()))

    def shape(self, key: str, counted_at: int, k_max: int) -> list[float]:
        """One factor per K from 0 to k_max (1 at K = 0 and K = 1): what a round at K yields
        on these runs over `expected_tokens` at the acceptance a request drafting `counted_at`
        drafts a round counts on them (0: every guess, as a look-back counts them), over the
        same at K = 1."""
        asked = (key, counted_at, k_max)
        changes, factors = self._shapes.get(asked, (-1, []))
        if changes != self._changes:
            factors = self._shape(key, counted_at, k_max)
            self._shapes[asked] = (self._changes, factors)
        return list(factors)

    def _shape(self, key: str, counted_at: int, k_max: int) -> list[float]:
        runs = self.runs.get(key)
        factors = [1.0] * (k_max + 1)
        if not runs:
            return factors
        kept, ended = (np.array(column, np.int64) for column in zip(*runs, strict=True))
        n = self.judged(key)
        counted = _rounds(kept, ended, counted_at)[2] if counted_at else kept.sum() / max(1, n)
        alpha = min(float(counted), TOP)
        rejected = int(ended.sum())
        weight = rejected / (rejected + PRIOR)
        raw = []
        for k in range(1, k_max + 1):
            rounds, tokens, _ = _rounds(kept, ended, k)
            raw.append(tokens / rounds / ((1 - alpha ** (k + 1)) / (1 - alpha)) if rounds else 1)
        for k in range(2, k_max + 1):  # as K = 1's: whether to draft is the estimate's alone
            factors[k] = float(np.clip(1 + weight * (raw[k - 1] / raw[0] - 1), *SPREAD))
        return factors


def _rounds(kept: np.ndarray, ended: np.ndarray, k: int) -> tuple[int, int, float]:
    """A fixed K's rounds over the runs, the tokens they emit, and the acceptance its rounds
    count (kept drafts over kept and rejected). Each run starts a round; a run of m kept
    guesses ended by a rejection takes m // (k + 1) full rounds, then one that keeps the
    rest (m % (k + 1)) and is rejected there, unless the rest is k (the bonus falls on the
    rejected guess): m + 1 tokens in all. A run ended by a gap keeps its full rounds only."""
    full, rest = np.divmod(kept, k + 1)
    last = ended.astype(np.int64)
    rounds = int((full + last).sum())
    tokens = int(np.where(ended, kept + 1, full * (k + 1)).sum())
    drafts_kept = int((full * k + np.where(ended, rest, 0)).sum())
    rejected = int((ended & (rest < k)).sum())
    return rounds, tokens, drafts_kept / max(1, drafts_kept + rejected)
