"""One generation, whole: what it asked for, where it stands, and how it ended.

A `Sequence` is the only object that holds a request's state, from the moment it is queued to
its result (nano-vllm's `Sequence` is the model): the prompt and every token emitted, in one
list; its sampling parameters and random stream; the constraints with their one cursor; its
stop rules; its drafter and K policy; its slot in the engines; its status, finish reason,
deadline and cancel flag; its statistics and log-probabilities. The scheduler moves sequences
between its queue, the prompt feed and the running batch; the round (`speculative.py`) reads
and extends their tokens; callers read their text (`take`) and `result`.

Stopping lives here, not in the loop: EOS, stop strings and max_new_tokens may land anywhere in
a round's accepted block, and the output is cut at that exact token and character. The round
may have emitted tokens past that point (they stay in `tokens`, and in the slot's cache, for
the prompt cache to reuse); the output is `tokens[len(prompt) : len(prompt) + length]`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from specrt.runtime.constraints import Constraints
from specrt.runtime.drafters import Drafter
from specrt.runtime.logprobs import TokenLogprob
from specrt.runtime.policy import Policy
from specrt.runtime.prompt_cache import PromptCache
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.stops import StopRules

WAITING, PREFILLING, RUNNING, FINISHED = "waiting", "prefilling", "running", "finished"


def per_token_latencies(token_times: Seq[float], ttft: float) -> list[float]:
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

    def record(self, step, i: int) -> None:
        """Request i's part in one round (a `speculative.Round`)."""
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
    # "eos" | "stop" | "length" | "context" | "timeout" | "shutdown" | "cancelled"
    finish_reason: str
    stats: Stats = field(repr=False)
    logprobs: list[TokenLogprob] | None = field(default=None, repr=False)  # one per token


class Sequence:
    """One generation (see the module's docstring). Built by `SpeculativeRuntime.sequence`;
    only the thread that steps the scheduler touches it, except `cancel`, a flag any thread
    may set (the scheduler looks at it once a step)."""

    def __init__(
        self,
        prompt: Seq[int],
        params: SamplingParams,
        rng: np.random.Generator,
        stops: StopRules,
        *,
        policy: Policy,
        drafter: Drafter | None = None,
        constraints: Constraints | None = None,
        logprobs: int | None = None,
        prompt_cache: PromptCache | None = None,
        timeout: float | None = None,
    ):
        self.prompt = list(prompt)
        self.tokens = list(prompt)  # the prompt, then every token emitted: the one copy
        self.params, self.rng, self.stops = params, rng, stops
        self.policy, self.drafter = policy, drafter  # drafter None: the target alone
        self.constraints = constraints  # grammar, logit_bias, penalties: draft and target
        self.logprobs = logprobs  # report each token's log-probability and this many best
        self.prompt_cache = prompt_cache  # where its prompt may start from (None: empty)
        self.slot: int | None = None  # its row in the engines' caches, once seated
        self.status = WAITING
        self.timeout = timeout  # seconds from its creation, after which it ends ("timeout")
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.cancelled: str | None = None
        self.arrived = time.monotonic()
        self.queue_seconds = 0.0
        self.stats = Stats(
            prompt_tokens=len(self.prompt),
            controller=type(policy).__name__ if drafter else "off",
            drafter=drafter.name if drafter else "none",
        )
        self.token_logprobs: list[TokenLogprob] = []  # of the output, where it asked
        self._logprobs_taken = 0
        self.result: Result | None = None
        self._start = time.perf_counter()

    @property
    def max_new_tokens(self) -> int:
        return self.stops.max_new_tokens

    @property
    def produced(self) -> int:
        """Tokens emitted after the prompt (the output and, past its end, a round's rest)."""
        return len(self.tokens) - len(self.prompt)

    @property
    def output(self) -> list[int]:
        start = len(self.prompt)
        return self.tokens[start : start + self.stops.length]

    def room(self, capacity: int) -> int:
        """Drafts it can take now: K + 1 tokens go to the target, whose cache holds all of the
        tokens but the last; negative once the budget or the context is spent."""
        return min(self.max_new_tokens - self.produced - 1, capacity - len(self.tokens))

    def cancel(self, reason: str = "cancelled") -> None:
        """End it after the round in flight (or before it starts); safe from any thread."""
        self.cancelled = self.cancelled or reason

    def interrupted(self) -> str | None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "timeout"
        return self.cancelled

    @property
    def stopped(self) -> bool:
        """Whether its output has ended (EOS, a stop string, the budget)."""
        return self.stops.finish is not None

    def seat(self, slot: int) -> None:
        """It leaves the queue for a slot: its prefill starts now, and times count from here."""
        self.slot, self.status = slot, PREFILLING
        self.queue_seconds = time.monotonic() - self.arrived
        self._start = time.perf_counter()

    def emit(self, count: int, origins: Seq[str] = (), logprobs: Seq[TokenLogprob] = ()) -> None:
        """The last `count` tokens are new: take them into the output up to the one that ends
        it; origins says who made each (draft, prediction; target where not given), logprobs
        their log-probabilities where it asked."""
        now = time.perf_counter() - self._start
        if not self.stops.length:
            self.stats.ttft_seconds = now
        origins = [*origins, *["target"] * (count - len(origins))]
        name = self.stops.tokenizer.token_text
        for i, token in enumerate(self.tokens[len(self.tokens) - count :]):
            self.stats.token_times.append(now)
            self.stats.token_origins.append(origins[i])
            for e in logprobs[i : i + 1]:
                texts = tuple(name(t) for t, _ in e.top)
                self.token_logprobs.append(replace(e, text=name(e.token), top_texts=texts))
            if self.stops.push(token):
                break

    def take(self) -> str:
        """Text that may be shown now and was not yet."""
        return self.stops.release()

    def take_logprobs(self) -> list[TokenLogprob]:
        """Log-probabilities of the tokens emitted since the last call."""
        taken = self.token_logprobs[self._logprobs_taken :]
        self._logprobs_taken = len(self.token_logprobs)
        return taken

    def finish(self, reason: str = "context") -> None:
        """End it (reason counts if nothing ended it before: the context is full, or it was
        interrupted) and set its result."""
        self.stops.end(reason)
        self.status = FINISHED
        self.stats.total_seconds = time.perf_counter() - self._start
        self.stats.new_tokens = self.stops.length
        logprobs = self.token_logprobs if self.logprobs is not None else None
        self.result = Result(self.stops.text, self.output, self.stops.finish, self.stats, logprobs)
