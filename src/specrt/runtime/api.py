"""The Python API: load a bundle once, then generate or stream text with speculation.

    rt = SpeculativeRuntime.load("bundle/")
    result = rt.generate("def fib(n):", max_new_tokens=64)
    for delta in rt.stream([{"role": "user", "content": "hi"}], temperature=0.7, seed=1):
        print(delta, end="")

A generation iterated here is served alone (a batch of one, in slot 0); a server batches many
`sequence`s through one `Scheduler` over the same engines (`SpeculativeRuntime.load(...,
slots=N)`).
"""

from __future__ import annotations

import collections.abc as cabc
from pathlib import Path

import numpy as np

from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.engines.base import Engine
from specrt.errors import SpecrtError
from specrt.runtime.constraints import Constraints
from specrt.runtime.controller import PooledAcceptance, make_controller
from specrt.runtime.costs import StepCosts, measure_costs
from specrt.runtime.drafters import ConstrainedDrafter, make_drafter
from specrt.runtime.generation import Generation
from specrt.runtime.grammar import Grammars, Structure
from specrt.runtime.logprobs import check_top
from specrt.runtime.prediction import PredictionDrafter
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import PREFILL_CHUNK, Scheduler
from specrt.runtime.sequence import Result, Sequence
from specrt.runtime.stops import StopRules
from specrt.runtime.text import TextTokenizer

Prompt = str | cabc.Sequence[dict] | cabc.Sequence[int]


class SpeculativeRuntime:
    def __init__(
        self,
        bundle: Bundle,
        draft: Engine | None,
        target: Engine,
        *,
        controller: str = "adaptive",
        drafter: str | None = None,
        prompt_cache: bool = True,
        prefill_chunk: int | None = PREFILL_CHUNK,
    ):
        """draft is None for a bundle built without a draft model; drafter is the default
        source of drafts (`model`, `ngram` or `hybrid`; default: model where there is one);
        prompt_cache: a prompt starts from what a slot already holds of it (exact; see
        prompt_cache.py), off where a benchmark measures prefill; prefill_chunk: prompt
        tokens a batch feeds between rounds (None: each prompt whole, see scheduler.py)."""
        self.bundle = bundle
        self.draft, self.target = draft, target
        self.drafter: str = drafter or ("ngram" if draft is None else "model")
        make_drafter(self.drafter, draft)  # refuse a bad name now, not mid-request
        self.tokenizer = TextTokenizer.from_bundle(bundle)
        self.eos_token_ids = frozenset(bundle.eos_token_ids)
        folder = bundle.role("target").folder
        self.grammars = Grammars(folder / "tokenizer.json", target.vocab_size, bundle.eos_token_ids)
        self.controller = controller
        make_controller(controller, bundle.max_draft)  # refuse a bad spec now, not mid-request
        self.costs = StepCosts()  # learned by the rounds, or calibrated
        self.acceptance = PooledAcceptance()  # where a request's adaptive estimate starts
        self.prompt_cache = prompt_cache
        if prefill_chunk is not None and prefill_chunk < 1:
            raise SpecrtError(f"a prefill chunk must be at least 1 token, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk

    @property
    def slots(self) -> int:
        """How many requests the engines can hold side by side (a server's batch)."""
        return self.target.slots

    def calibrate(self) -> StepCosts:
        """Measure the draft step and the verify curve for K = 0..K_max at each batch size up to
        the engines' slots (a few target calls), so the adaptive policy's first rounds already
        use this machine's costs."""
        bundle = self.bundle
        self.costs = measure_costs(
            self.draft, self.target, bundle.max_draft, slots=self.slots, k_lookup=bundle.max_lookup
        )
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
        slots: int = 1,
        prompt_cache: bool = True,
        prefill_chunk: int | None = PREFILL_CHUNK,
        **engine_options,
    ) -> SpeculativeRuntime:
        """slots: requests the engines hold side by side (a server's --max-batch)."""
        if slots > 1:
            engine_options["slots"] = slots
        bundle = Bundle.load(path)
        draft = None
        if bundle.has_draft:
            draft = load_engine(bundle, "draft", backend, **engine_options)
        target = load_engine(bundle, "target", backend, **engine_options)
        runtime = cls(
            bundle,
            draft,
            target,
            controller=controller,
            drafter=drafter,
            prompt_cache=prompt_cache,
            prefill_chunk=prefill_chunk,
        )
        if calibrate:
            runtime.calibrate()
        return runtime

    def encode(self, prompt: Prompt, tools: cabc.Sequence[dict] | None = None) -> list[int]:
        """Token ids for a prompt (see TextTokenizer.encode_prompt; tools, in OpenAI's form, go
        to the chat template), checked against the context."""
        ids = self.tokenizer.encode_prompt(prompt, tools)
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

    def stream(self, prompt: Prompt, **options) -> Generation:
        """Start a request; iterate the result for text deltas, then read `.result`.

        Takes `sequence`'s options. Safe to call from any thread (it tokenizes and validates;
        no engine runs until the result is iterated, alone, in slot 0)."""
        alone = Scheduler(self.target, self.costs, chunk=None)
        return Generation(self.sequence(prompt, **options), alone)

    def sequence(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: cabc.Sequence[str] = (),
        controller=None,
        speculate: bool = True,
        drafter: str | None = None,
        min_draft: int | None = None,
        max_draft: int | None = None,
        ignore_eos: bool = False,
        timeout: float | None = None,
        prediction: str | None = None,
        structure: Structure | None = None,
        jump_forward: bool = True,
        logit_bias: dict[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
    ) -> Sequence:
        """A request as one `Sequence`, validated, for a scheduler to run (`stream` runs it
        alone; a server's worker adds it to its batch).

        controller is a spec (`fixed:K`, `heuristic`, `adaptive`) or a policy object of one's
        own; drafter is `model`, `ngram`, `hybrid` (default: the runtime's) or a drafter object
        of one's own; speculate=False runs the target alone; min_draft/max_draft bound the K a
        spec may choose (K_max caps max_draft); ignore_eos generates exactly max_new_tokens
        (what benchmarks need); timeout, in seconds from now, ends the generation after the
        round in flight (finish "timeout"); prediction is text the output is expected to mostly
        repeat (OpenAI's Predicted Outputs), drafted for free where the output follows it, by
        the drafter elsewhere.

        structure constrains the output (`Structure("json_schema", schema)`, a regex, a Lark
        grammar, choices): the target decodes from its masked distribution, the draft drafts
        within it, and tokens it forces are drafted for free unless jump_forward=False.
        logit_bias (token id: -100..100), presence_penalty and frequency_penalty (-2..2) apply
        to draft and target alike, as OpenAI defines them. logprobs=N reports each token's
        log-probability under the target and its N most likely alternatives (0..20).
        """
        if max_new_tokens < 1:
            raise SpecrtError(
                f"max_new_tokens must be >= 1, got {max_new_tokens}", param="max_new_tokens"
            )
        params = SamplingParams(temperature, top_k, top_p)
        policy = self._policy(controller, min_draft, max_draft)
        ids = self.target.vocab_size
        source = make_drafter(drafter or self.drafter, self.draft, ids) if speculate else None
        if prediction is not None:
            predicted = self._predicted(prediction, source)  # checked even when not speculating
            source = predicted if speculate else None
        if structure is not None and ignore_eos:
            raise SpecrtError(
                "ignore_eos cannot be combined with a structure: the grammar decides where the "
                "output may end",
                param="ignore_eos",
            )
        constraints = None
        if structure is not None or logit_bias or presence_penalty or frequency_penalty:
            constraints = Constraints(
                self.grammars.compile(structure) if structure is not None else None,
                logit_bias=logit_bias,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                eos=self.eos_token_ids,
                vocab=ids,
                jump_forward=jump_forward,
            )
        if source is not None and structure is not None:
            source = ConstrainedDrafter(source, constraints)
        rng = np.random.default_rng(seed)
        ids = self.encode(prompt)
        top = check_top(logprobs)
        eos = frozenset() if ignore_eos else self.eos_token_ids
        stops = StopRules(self.tokenizer, stop, eos, max_new_tokens)
        return Sequence(
            ids,
            params,
            rng,
            stops,
            policy=policy,
            drafter=source,
            constraints=constraints,
            logprobs=top,
            reuse_prompt=self.prompt_cache,
            timeout=timeout,
        )

    def _policy(self, controller, min_draft: int | None, max_draft: int | None):
        """The request's K policy: its spec (or the runtime's) within its bounds."""
        bounds = None
        if min_draft is not None or max_draft is not None:
            bounds = (min_draft or 0, self.bundle.max_draft if max_draft is None else max_draft)
        bundle = self.bundle
        return make_controller(
            controller or self.controller,
            bundle.max_draft,
            self.costs,
            bounds=bounds,
            k_lookup=bundle.max_lookup,
            pool=self.acceptance,
        )

    def _predicted(self, prediction, fallback) -> PredictionDrafter:
        """A drafter of the prediction's text, the request's own drafter where it has nothing."""
        if not isinstance(prediction, str):
            raise SpecrtError(
                f"the prediction must be text, got {type(prediction).__name__}",
                param="prediction",
            )
        drafter = PredictionDrafter(prediction, self.tokenizer, fallback)
        if drafter.length > self.bundle.max_context:
            raise SpecrtError(
                f"the prediction has {drafter.length} tokens; the bundle's max context is "
                f"{self.bundle.max_context}",
                param="prediction",
                code="context_length_exceeded",
            )
        return drafter

    def generate(self, prompt: Prompt, **options) -> Result:
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result
