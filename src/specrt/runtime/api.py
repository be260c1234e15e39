"""The Python API: load a bundle once, then generate or stream text with speculation.

    rt = SpeculativeRuntime.load("bundle/")
    result = rt.generate("def fib(n):", max_new_tokens=64)
    for delta in rt.stream([{"role": "user", "content": "hi"}], temperature=0.7, seed=1):
        print(delta, end="")

Stopping lives here, not in the loop: EOS, stop strings and max_new_tokens may land anywhere in
a round's accepted block, and the output is cut at that exact token and character.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.engines.base import Engine
from specrt.errors import SpecrtError
from specrt.runtime.controller import make_controller
from specrt.runtime.costs import StepCosts, measure_costs
from specrt.runtime.drafters import Drafter, make_drafter
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import LoopStats, Request, speculate
from specrt.runtime.stops import StopRules
from specrt.runtime.text import TextTokenizer

Prompt = str | Sequence[dict] | Sequence[int]


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
class Stats(LoopStats):
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    controller: str = ""
    drafter: str = ""  # model, ngram, hybrid, or none (the target alone)
    token_times: list[float] = field(default_factory=list)  # seconds from start, per token

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds else 0.0

    def token_latencies(self) -> list[float]:
        return per_token_latencies(self.token_times, self.ttft_seconds)

    def to_dict(self) -> dict:
        derived = ("acceptance_rate", "tokens_per_target_call", "tokens_per_second")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length" | "context" | "timeout" | "cancelled"
    stats: Stats = field(repr=False)


class Generation:
    """One request: iterate for text deltas; `.result` is set once iteration ends.

    Iterating drives the engines, so it belongs to one thread at a time. `cancel` may be called
    from any thread: the generation ends after the round in flight, with that finish reason.
    """

    def __init__(
        self,
        runtime: SpeculativeRuntime,
        request: Request,
        controller,
        drafter: Drafter | None,
        stops: StopRules,
        deadline: float | None = None,
    ):
        self.runtime, self.request, self.stops = runtime, request, stops
        self.controller, self.drafter = controller, drafter  # drafter None: the target alone
        self.deadline = deadline  # time.monotonic() past which the generation ends ("timeout")
        self.cancelled: str | None = None
        self.result: Result | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        self.cancelled = self.cancelled or reason

    def _interrupted(self) -> str | None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "timeout"
        return self.cancelled

    def __iter__(self) -> Iterator[str]:
        rt, req, stops = self.runtime, self.request, self.stops
        stats = Stats(
            prompt_tokens=len(req.prompt),
            controller=self.controller.__class__.__name__,
            drafter=self.drafter.name if self.drafter else "none",
        )
        start = time.perf_counter()
        rounds = speculate(self.drafter, rt.target, req, self.controller, stats)
        for emitted in rounds:
            now = time.perf_counter() - start
            if not stops.tokens:
                stats.ttft_seconds = now
            for token in emitted:
                stats.token_times.append(now)
                if stops.push(token):
                    break
            interrupted = self._interrupted()
            if interrupted:
                stops.end(interrupted)
            delta = stops.release()
            if delta:
                yield delta
            if stops.finish:
                break
        rounds.close()
        stops.end("context")  # the loop ran out of room before any other reason came
        delta = stops.release()
        if delta:
            yield delta
        stats.total_seconds = time.perf_counter() - start
        stats.new_tokens = len(stops.tokens)
        self.result = Result(stops.text, stops.tokens, stops.finish, stats)


class SpeculativeRuntime:
    def __init__(
        self,
        bundle: Bundle,
        draft: Engine | None,
        target: Engine,
        *,
        controller: str = "adaptive",
        drafter: str | None = None,
    ):
        """draft is None for a bundle built without a draft model; drafter is the default
        source of drafts (`model`, `ngram` or `hybrid`; default: model where there is one)."""
        self.bundle = bundle
        self.draft, self.target = draft, target
        self.drafter: str = drafter or ("ngram" if draft is None else "model")
        make_drafter(self.drafter, draft)  # refuse a bad name now, not mid-request
        self.tokenizer = TextTokenizer.from_bundle(bundle)
        self.eos_token_ids = frozenset(bundle.eos_token_ids)
        self.controller = controller
        make_controller(controller, bundle.max_draft)  # refuse a bad spec now, not mid-request
        self.costs = StepCosts()  # learned by the requests' adaptive policies, or calibrated

    def calibrate(self) -> StepCosts:
        """Measure the draft step and the verify curve for K = 0..K_max now (a few target calls),
        so the adaptive policy's first rounds already use this machine's costs."""
        self.costs = measure_costs(self.draft, self.target, self.bundle.max_draft)
        return self.costs

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        backend: str = "onnxruntime",
        controller: str = "adaptive",
        drafter: str | None = None,
        calibrate: bool = True,
        **engine_options,
    ) -> SpeculativeRuntime:
        bundle = Bundle.load(path)
        draft = None
        if bundle.has_draft:
            draft = load_engine(bundle, "draft", backend, **engine_options)
        target = load_engine(bundle, "target", backend, **engine_options)
        runtime = cls(bundle, draft, target, controller=controller, drafter=drafter)
        if calibrate:
            runtime.calibrate()
        return runtime

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt (see TextTokenizer.encode_prompt), checked against the context."""
        ids = self.tokenizer.encode_prompt(prompt)
        if not ids:
            raise SpecrtError("the prompt is empty", param="prompt")
        if len(ids) >= self.bundle.max_context:
            raise SpecrtError(
                f"the prompt has {len(ids)} tokens; the bundle's max context is "
                f"{self.bundle.max_context}, leaving no room to generate",
                param="prompt",
                code="context_length_exceeded",
            )
        return ids

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        controller=None,
        speculate: bool = True,
        drafter: str | None = None,
        min_draft: int | None = None,
        max_draft: int | None = None,
        load: int = 0,
        ignore_eos: bool = False,
        timeout: float | None = None,
    ) -> Generation:
        """Start a request; iterate the result for text deltas, then read `.result`.

        Safe to call from any thread (it tokenizes and validates; no engine runs until the
        result is iterated). controller is a spec (`fixed:K`, `heuristic`, `adaptive`) or a
        policy object of one's own; drafter is `model`, `ngram`, `hybrid` (default: the
        runtime's) or a drafter object of one's own; speculate=False runs the target alone;
        min_draft/max_draft bound the K a spec may choose (K_max caps max_draft); ignore_eos
        generates exactly max_new_tokens (what benchmarks need); load is the caller's queue
        depth, which caps K under the adaptive policy and is read again every round (a
        scheduler may update `generation.request.load`); timeout, in seconds from now, ends
        the generation after the round in flight (finish "timeout").
        """
        if max_new_tokens < 1:
            raise SpecrtError(
                f"max_new_tokens must be >= 1, got {max_new_tokens}", param="max_new_tokens"
            )
        if load < 0:
            raise SpecrtError(f"load must be >= 0, got {load}", param="load")
        params = SamplingParams(temperature, top_k, top_p)
        bounds = None
        if min_draft is not None or max_draft is not None:
            bounds = (min_draft or 0, self.bundle.max_draft if max_draft is None else max_draft)
        spec = controller or self.controller
        policy = make_controller(spec, self.bundle.max_draft, self.costs, bounds=bounds)
        request = Request(
            self.encode(prompt), params, max_new_tokens, np.random.default_rng(seed), load
        )
        eos = frozenset() if ignore_eos else self.eos_token_ids
        stops = StopRules(self.tokenizer, stop, eos, max_new_tokens)
        deadline = None if timeout is None else time.monotonic() + timeout
        source = make_drafter(drafter or self.drafter, self.draft) if speculate else None
        return Generation(self, request, policy, source, stops, deadline)

    def generate(self, prompt: Prompt, **options) -> Result:
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result
