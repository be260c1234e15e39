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
from dataclasses import replace
from pathlib import Path

import numpy as np

from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.engines.base import Engine
from specrt.errors import SpecrtError
from specrt.runtime.constraints import Constraints
from specrt.runtime.controller import make_controller
from specrt.runtime.costs import StepCosts, measure_costs
from specrt.runtime.drafters import DRAFT_WINDOW, ConstrainedDrafter, make_drafter
from specrt.runtime.generation import Generation
from specrt.runtime.grammar import Grammar, Grammars
from specrt.runtime.logprobs import check_top
from specrt.runtime.options import Options
from specrt.runtime.pool import PooledAcceptance
from specrt.runtime.prediction import PredictionDrafter
from specrt.runtime.prefix_store import PrefixStore
from specrt.runtime.prompt_cache import PromptCache
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import PREFILL_CHUNK, Scheduler
from specrt.runtime.sequence import Result, Sequence
from specrt.runtime.stops import StopRules
from specrt.runtime.text import PastLimit, TextTokenizer

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
        prefix_store: int = 0,
        prefill_chunk: int | None = PREFILL_CHUNK,
        chat_template: str | None = None,
        draft_window: int | None = DRAFT_WINDOW,
    ):
        """draft is None for a bundle built without a draft model; drafter is the default
        source of drafts (`model`, `ngram` or `hybrid`; default: model where there is one);
        prompt_cache: a prompt starts from what a slot already holds of it (exact; see
        prompt_cache.py), off where a benchmark measures prefill; prefix_store: bytes of host
        memory that keep prefixes beyond the slots (0: none; prefix_store.py); prefill_chunk:
        prompt tokens a batch feeds between rounds (None: each prompt whole, scheduler.py);
        chat_template: Jinja text used in place of the bundle's; draft_window: the most prompt
        tokens the draft model reads, its first and its last (None: all; drafters.py)."""
        self.bundle = bundle
        self.draft, self.target = draft, target
        self.drafter: str = drafter or ("ngram" if draft is None else "model")
        self.draft_window = draft_window
        make_drafter(self.drafter, draft, window=draft_window)  # refuse a bad one now
        self.tokenizer = TextTokenizer.from_bundle(bundle, chat_template)
        self.eos_token_ids = frozenset(bundle.eos_token_ids)
        folder = bundle.role("target").folder
        self.grammars = Grammars(folder / "tokenizer.json", target.vocab_size, bundle.eos_token_ids)
        self.controller = controller
        make_controller(controller, bundle.max_draft)  # refuse a bad spec now, not mid-request
        self.costs = StepCosts()  # learned by the rounds, or calibrated
        self.acceptance = PooledAcceptance()  # where a request's adaptive estimate starts
        store = PrefixStore(prefix_store) if prefix_store > 0 else None
        self.prompt_cache = PromptCache(store) if prompt_cache else None
        if prefill_chunk is not None and prefill_chunk < 1:
            raise SpecrtError(f"a prefill chunk must be at least 1 token, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk

    @property
    def slots(self) -> int:
        """How many requests the engines can hold side by side (a server's batch)."""
        return self.target.slots

    def calibrate(self, longest: int | None = None) -> StepCosts:
        """Measure the draft step and the verify curve for K = 0..K_max at each batch size up to
        the engines' slots (a few target calls), so the adaptive policy's first rounds already
        use this machine's costs. `longest`: the most tokens of context a request will bring
        (a one-off generation's prompt and answer), so the narrow calls are not timed after
        longer contexts than that (`measure_narrow`: ~4-9 s a knot on a 2-core EPYC)."""
        bundle = self.bundle
        self.costs = measure_costs(
            self.draft,
            self.target,
            bundle.max_draft,
            slots=self.slots,
            k_lookup=bundle.max_lookup,
            longest=longest,
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
        prefix_store: int = 0,
        prefill_chunk: int | None = PREFILL_CHUNK,
        chat_template: str | None = None,
        draft_window: int | None = DRAFT_WINDOW,
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
            prefix_store=prefix_store,
            prefill_chunk=prefill_chunk,
            chat_template=chat_template,
            draft_window=draft_window,
        )
        if calibrate:
            runtime.calibrate()
        return runtime

    def encode(
        self,
        prompt: Prompt,
        tools: cabc.Sequence[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> list[int]:
        """Token ids for a prompt (see TextTokenizer.encode_prompt; tools, in OpenAI's form,
        and extra template variables go to the chat template), checked against the context."""
        limit = self.bundle.max_context - 1
        try:
            ids = self.tokenizer.encode_prompt(prompt, tools, template_kwargs, limit)
        except PastLimit as err:
            raise self._past("prompt", f"more than {err.tokens}", " (counted no further)") from None
        if not ids:
            raise SpecrtError("the prompt is empty", param="prompt")
        self._fits("prompt", len(ids), ", leaving no room to generate", room=1)
        return ids

    def _fits(self, what: str, tokens: int, why: str = "", room: int = 0) -> None:
        """Refuse `what` (a parameter) where its tokens and `room` more pass the context."""
        if tokens + room > self.bundle.max_context:
            raise self._past(what, tokens, why)

    def _past(self, what: str, tokens: int | str, why: str) -> SpecrtError:
        return SpecrtError(
            f"the {what} has {tokens} tokens; the bundle's max context is "
            f"{self.bundle.max_context}{why}",
            param=what,
            code="context_length_exceeded",
        )

    def stream(self, prompt: Prompt, **options) -> Generation:
        """Start a request; iterate the result for text deltas, then read `.result`.

        Takes the keywords of `Options` (max_new_tokens, temperature, structure, ...). Safe to
        call from any thread (it tokenizes and validates; no engine runs until the result is
        iterated, alone, in slot 0)."""
        alone = Scheduler(self.target, self.costs, chunk=None)
        return Generation(self.sequence(prompt, **options), alone)

    def sequence(self, prompt: Prompt, options: Options | None = None, **changes) -> Sequence:
        """A request as one `Sequence`, validated, for a scheduler to run (`stream` runs it
        alone; a server's worker adds it to its batch). changes: `Options` fields to set."""
        return self.sequences(prompt, options, 1, **changes)[0]

    def sequences(
        self, prompt: Prompt, options: Options | None = None, n: int = 1, **changes
    ) -> list[Sequence]:
        """n choices of one request: its prompt tokenized once, its values checked once, its
        grammar compiled once (each choice walks its own copy); choice i samples with seed + i.
        """
        o = replace(options or Options(), **changes)
        if o.max_new_tokens < 1:
            raise SpecrtError(
                f"max_new_tokens must be >= 1, got {o.max_new_tokens}", param="max_new_tokens"
            )
        params = SamplingParams(o.temperature, o.top_k, o.top_p, o.min_p)
        first = self._choice(o)
        ids = self.encode(prompt)
        top = check_top(o.logprobs)
        grammar = first[2].grammar if first[2] is not None else None
        choices = [first, *(self._choice(o, grammar) for _ in range(n - 1))]
        eos = frozenset() if o.ignore_eos else self.eos_token_ids
        return [
            Sequence(
                ids,
                params,
                np.random.default_rng(seed),
                StopRules(self.tokenizer, o.stop, eos, o.max_new_tokens),
                policy=policy,
                drafter=drafter,
                constraints=constraints,
                logprobs=top,
                prompt_cache=self.prompt_cache,
                timeout=o.timeout,
            )
            for (policy, drafter, constraints), seed in zip(choices, o.seeds(n), strict=True)
        ]

    def _choice(self, o: Options, grammar: Grammar | None = None) -> tuple:
        """One choice's own K policy, drafter and constraints, each value checked as it is
        used; grammar: the request's, compiled for its first choice, copied for the others."""
        policy = self._policy(o)
        vocab = self.target.vocab_size
        source = None
        if o.speculate:
            source = make_drafter(o.drafter or self.drafter, self.draft, vocab, self.draft_window)
        if o.prediction is not None:
            predicted = self._predicted(o.prediction, source)  # checked even when not speculating
            source = predicted if o.speculate else None
        if o.structure is not None and o.ignore_eos:
            raise SpecrtError(
                "ignore_eos cannot be combined with a structure: the grammar decides where the "
                "output may end",
                param="ignore_eos",
            )
        constraints = None
        if o.constrained:
            if o.structure is not None:
                grammar = grammar.copy() if grammar else self.grammars.compile(o.structure)
            constraints = Constraints(
                grammar,  # None without a structure: the first choice passes none
                logit_bias=o.logit_bias,
                presence_penalty=o.presence_penalty,
                frequency_penalty=o.frequency_penalty,
                eos=self.eos_token_ids,
                vocab=vocab,
                jump_forward=o.jump_forward,
            )
        if source is not None and o.structure is not None:
            source = ConstrainedDrafter(source, constraints)
        return policy, source, constraints

    def _policy(self, o: Options):
        """The request's K policy: its spec (or the runtime's) within its bounds."""
        bounds = None
        if o.min_draft is not None or o.max_draft is not None:
            high = self.bundle.max_draft if o.max_draft is None else o.max_draft
            bounds = (o.min_draft or 0, high)
        bundle = self.bundle
        return make_controller(
            o.controller or self.controller,
            bundle.max_draft,
            self.costs,
            bounds=bounds,
            k_free=bundle.max_lookup,
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
        self._fits("prediction", drafter.length)
        return drafter

    def generate(self, prompt: Prompt, **options) -> Result:
        generation = self.stream(prompt, **options)
        for _ in generation:
            pass
        return generation.result
