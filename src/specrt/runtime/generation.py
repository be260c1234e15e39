"""One request from start to result: its loop state, stop rules, timing and statistics.

The scheduler advances a generation (`absorb` each round's tokens, `close` when it ends); the
caller reads its text as it comes (`take`) and its `result` at the end. Iterating a generation
serves it alone through the runtime that made it. Stopping lives here, not in the loop: EOS,
stop strings and max_new_tokens may land anywhere in a round's accepted block, and the output
is cut at that exact token and character.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

from specrt.runtime.logprobs import TokenLogprob
from specrt.runtime.speculative import Request, Round
from specrt.runtime.stops import StopRules


def per_token_latencies(token_times: Sequence[float], ttft: float) -> list[float]:
    """Seconds per token after the first. A round emits its block of tokens at once, so each
    token is charged the time since the previous block divided by the block's size (for
    one-token decoding this is the usual inter-token latency)."""
    latencies, previous, i = [], ttft, 0
    times = token_times[1:]  # the first token is the time to first token, reported apart
    while i < len(times):
        j = i
        while j < len(times) and times[j] == times[i]:
            j += 1
        latencies += [(times[i] - previous) / (j - i)] * (j - i)
        previous, i = times[i], j
    return latencies


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    prefill_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens a slot already held: reused, not computed
    controller: str = ""
    drafter: str = ""  # model, ngram, hybrid, or none (the target alone)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_seconds: float = 0.0  # of the rounds it took part in (shared with its batch)
    verify_seconds: float = 0.0
    ks: list[int] = field(default_factory=list)  # per round: the K the controller chose
    reasons: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per round: model, ngram, none
    drafted_counts: list[int] = field(default_factory=list)  # per round (< K if the draft stopped)
    accepted_counts: list[int] = field(default_factory=list)  # per round
    batch_sizes: list[int] = field(default_factory=list)  # per round: requests in the round
    token_times: list[float] = field(default_factory=list)  # seconds from start, per token
    token_origins: list[str] = field(default_factory=list)  # per token: draft, prediction, target

    def record(self, step: Round, i: int) -> None:
        """Request i's part in one round."""
        self.rounds += 1
        self.target_calls += 1
        self.drafted += step.drafted[i]
        self.accepted += step.accepted[i]
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds
        self.ks.append(step.decisions[i].k)
        self.reasons.append(step.decisions[i].reason)
        self.sources.append(step.sources[i])
        self.drafted_counts.append(step.drafted[i])
        self.accepted_counts.append(step.accepted[i])
        self.batch_sizes.append(len(step.drafted))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_prediction_tokens(self) -> int:
        """Tokens of the prediction that the output kept (OpenAI's usage field)."""
        return self._prediction_counts()[0]

    @property
    def rejected_prediction_tokens(self) -> int:
        """Tokens of the prediction that were verified and not kept."""
        return self._prediction_counts()[1]

    def _prediction_counts(self) -> tuple[int, int]:
        rounds = zip(self.sources, self.drafted_counts, self.accepted_counts, strict=True)
        predicted = [(drafted, accepted) for s, drafted, accepted in rounds if s == "prediction"]
        accepted = sum(a for _, a in predicted)
        return accepted, sum(d for d, _ in predicted) - accepted

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def token_latencies(self) -> list[float]:
        return per_token_latencies(self.token_times, self.ttft_seconds)

    def to_dict(self) -> dict:
        derived = (
            "acceptance_rate",
            "tokens_per_target_call",
            "tokens_per_second",
            "accepted_prediction_tokens",
            "rejected_prediction_tokens",
        )
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length" | "context" | "timeout" | "cancelled"
    stats: Stats = field(repr=False)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # one per token


class Generation:
    """One request: iterate for text deltas; `.result` is set once it ends.

    Iterating drives the engines, so it belongs to one thread at a time. `cancel` may be called
    from any thread: the generation ends after the round in flight, with that finish reason.
    """

    def __init__(self, runtime, request: Request, stops: StopRules, deadline: float | None = None):
        self.runtime, self.request, self.stops = runtime, request, stops
        self.deadline = deadline  # time.monotonic() past which the generation ends ("timeout")
        self.cancelled: str | None = None
        self.result: Result | None = None
        self.logprobs: list[TokenLogprob] = []  # of the tokens kept, where the request asked
        self._logprobs_taken = 0
        drafter = request.drafter
        self.stats = Stats(
            prompt_tokens=len(request.prompt),
            controller=type(request.policy).__name__ if drafter else "off",
            drafter=drafter.name if drafter else "none",
        )
        self._start = time.perf_counter()

    def __iter__(self) -> Iterator[str]:
        return self.runtime.serve_alone(self)

    def cancel(self, reason: str = "cancelled") -> None:
        self.cancelled = self.cancelled or reason

    def interrupted(self) -> str | None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "timeout"
        return self.cancelled

    @property
    def stopped(self) -> bool:
        """Whether its output has ended (EOS, a stop string, the budget, an interruption)."""
        return self.stops.finish is not None

    def begin(self) -> None:
        """Its prefill starts now: times are measured from here."""
        self._start = time.perf_counter()

    def absorb(
        self,
        tokens: Sequence[int],
        origins: Sequence[str] = (),
        logprobs: Sequence[TokenLogprob] = (),
    ) -> None:
        """Take a round's emitted tokens, up to the one that ends the output; origins says who
        made each (draft, prediction; target where not given), logprobs their log-probabilities
        where the request asked."""
        now = time.perf_counter() - self._start
        if not self.stops.tokens:
            self.stats.ttft_seconds = now
        origins = [*origins, *["target"] * (len(tokens) - len(origins))]
        for i, (token, origin) in enumerate(zip(tokens, origins, strict=True)):
            self.stats.token_times.append(now)
            self.stats.token_origins.append(origin)
            self.logprobs.extend(self._named(logprobs[i : i + 1]))
            if self.stops.push(token):
                break
        reason = self.interrupted()
        if reason:
            self.stops.end(reason)

    def take(self) -> str:
        """Text that may be shown now and was not yet."""
        return self.stops.release()

    def take_logprobs(self) -> list[TokenLogprob]:
        """Log-probabilities of the tokens absorbed since the last call."""
        taken = self.logprobs[self._logprobs_taken :]
        self._logprobs_taken = len(self.logprobs)
        return taken

    def _named(self, entries: Sequence[TokenLogprob]) -> list[TokenLogprob]:
        """Entries with their tokens' texts, as the API reports them."""
        text = self.runtime.tokenizer.token_text
        return [
            replace(e, text=text(e.token), top_texts=tuple(text(t) for t, _ in e.top))
            for e in entries
        ]

    def close(self, reason: str = "context") -> None:
        """End it (reason counts if nothing ended it before: the context is full, or it was
        interrupted before it started) and set its result."""
        self.stops.end(reason)
        self.stats.total_seconds = time.perf_counter() - self._start
        self.stats.new_tokens = len(self.stops.tokens)
        logprobs = self.logprobs if self.request.logprobs is not None else None
        self.result = Result(
            self.stops.text, self.stops.tokens, self.stops.finish, self.stats, logprobs
        )
