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
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.speculative import LoopStats, Request, speculate
from specrt.runtime.text import IncrementalDecoder, TextTokenizer

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class Stats(LoopStats):
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    controller: str = ""
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

    def to_dict(self) -> dict:
        derived = ("acceptance_rate", "tokens_per_target_call", "tokens_per_second")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


@dataclass
class Result:
    text: str
    token_ids: list[int]
    finish_reason: str  # "eos" | "stop" | "length" | "context"
    stats: Stats = field(repr=False)


def _partial_stop(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class Generation:
    """One request: iterate for text deltas; `.result` is set once iteration ends."""

    def __init__(
        self,
        runtime: SpeculativeRuntime,
        request: Request,
        controller,
        speculate_: bool,
        stop: Sequence[str],
        eos: frozenset[int],
    ):
        self.runtime, self.request, self.stop, self.eos = runtime, request, list(stop), eos
        self.controller, self.speculate = controller, speculate_
        self.result: Result | None = None

    def __iter__(self) -> Iterator[str]:
        rt, req = self.runtime, self.request
        stats = Stats(prompt_tokens=len(req.prompt), controller=self.controller.__class__.__name__)
        decoder = IncrementalDecoder(rt.tokenizer)
        tokens: list[int] = []
        finish, shown, text = "context", 0, ""
        start = time.perf_counter()
        draft = rt.draft if self.speculate else None
        for emitted in speculate(draft, rt.target, req, self.controller, stats):
            now = time.perf_counter() - start
            if not tokens:
                stats.ttft_seconds = now
            for token in emitted:
                tokens.append(token)
                stats.token_times.append(now)
                if token in self.eos:
                    finish = "eos"
                    break
                decoder.push(token)
                text, cut = self._apply_stops(decoder.text)
                if cut:
                    finish = "stop"
                    break
                if len(tokens) >= req.max_new_tokens:
                    finish = "length"
                    break
            else:
                safe = len(text) - _partial_stop(text, self.stop)
                if safe > shown:
                    yield text[shown:safe]
                    shown = safe
                continue
            break
        if shown < len(text):
            yield text[shown:]
        stats.total_seconds = time.perf_counter() - start
        stats.new_tokens = len(tokens)
        self.result = Result(text, tokens, finish, stats)

    def _apply_stops(self, text: str) -> tuple[str, bool]:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return (text[: min(hits)], True) if hits else (text, False)


class SpeculativeRuntime:
    def __init__(
        self, bundle: Bundle, draft: Engine, target: Engine, *, controller: str = "adaptive"
    ):
        self.bundle = bundle
        self.draft, self.target = draft, target
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
        calibrate: bool = True,
        **engine_options,
    ) -> SpeculativeRuntime:
        bundle = Bundle.load(path)
        draft = load_engine(bundle, "draft", backend, **engine_options)
        target = load_engine(bundle, "target", backend, **engine_options)
        runtime = cls(bundle, draft, target, controller=controller)
        if calibrate:
            runtime.calibrate()
        return runtime

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a prompt (see TextTokenizer.encode_prompt), checked against the context."""
        ids = self.tokenizer.encode_prompt(prompt)
        if not ids:
            raise SpecrtError("the prompt is empty")
        if len(ids) >= self.bundle.max_context:
            raise SpecrtError(
                f"the prompt has {len(ids)} tokens; the bundle's max context is "
                f"{self.bundle.max_context}, leaving no room to generate"
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
        load: int = 0,
        ignore_eos: bool = False,
    ) -> Generation:
        """Start a request; iterate the result for text deltas, then read `.result`.

        controller is a spec (`fixed:K`, `heuristic`, `adaptive`) or a policy object of one's
        own; ignore_eos generates exactly max_new_tokens (what benchmarks need); load is the
        caller's queue depth, which caps the speculation length under the adaptive policy.
        """
        if max_new_tokens < 1:
            raise SpecrtError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if load < 0:
            raise SpecrtError(f"load must be >= 0, got {load}")
        params = SamplingParams(temperature, top_k, top_p)
        policy = make_controller(controller or self.controller, self.bundle.max_draft, self.costs)
        request = Request(
            self.encode(prompt), params, max_new_tokens, np.random.default_rng(seed), load
        )
        eos = frozenset() if ignore_eos else self.eos_token_ids
        return Generation(self, request, policy, speculate, [s for s in stop if s], eos)

    def generate(self, prompt: Prompt, **options) -> Result:
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result
