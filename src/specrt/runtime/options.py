"""What one request asks for: every generation option, with its default, in one object.

The Python API's keywords (`SpeculativeRuntime.stream(prompt, max_new_tokens=..., ...)`) and an
HTTP body (`serve/protocol.py`) both become an `Options`, and `SpeculativeRuntime.sequences`
turns it into the request's `Sequence`s, checking each value once. A new option is a field
here, its check and use in the runtime, and its name in the HTTP body.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specrt.runtime.grammar import Structure


@dataclass(frozen=True)
class Options:
    """controller is a spec (`fixed:K`, `heuristic`, `adaptive`; default: the runtime's) or a
    policy object of one's own; drafter is `model`, `ngram`, `hybrid` (default: the runtime's)
    or a drafter object of one's own; speculate=False runs the target alone; min_draft and
    max_draft bound the K a spec may choose (K_max caps max_draft); ignore_eos generates exactly
    max_new_tokens (what benchmarks need); timeout, in seconds from the request's start, ends
    it after the round in flight (finish "timeout"); prediction is text the output is expected
    to mostly repeat (OpenAI's Predicted Outputs), drafted for free where the output follows it,
    by the drafter elsewhere.

    structure constrains the output (`Structure("json_schema", schema)`, a regex, a Lark
    grammar, choices): the target decodes from its masked distribution, the draft drafts within
    it, and tokens it forces are drafted for free unless jump_forward=False. logit_bias (token
    id: -100..100), presence_penalty and frequency_penalty (-2..2) apply to draft and target
    alike, as OpenAI defines them. logprobs=N reports each token's log-probability under the
    target and its N most likely alternatives (0..20). With a seed, choice i of a request of n
    samples with seed + i, so the set is reproducible and its members differ.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    controller: object = None
    speculate: bool = True
    drafter: object = None
    min_draft: int | None = None
    max_draft: int | None = None
    ignore_eos: bool = False
    timeout: float | None = None
    prediction: str | None = None
    structure: Structure | None = None
    jump_forward: bool = True
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    @property
    def constrained(self) -> bool:
        """Whether anything changes the logits before a token is drawn (draft and target)."""
        return bool(
            self.structure is not None
            or self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
        )

    def seeds(self, n: int) -> list[int | None]:
        """Each of n choices' seed: seed + i, or None each (each samples on its own)."""
        return [None if self.seed is None else self.seed + i for i in range(n)]
