"""The request bodies of OpenAI's completions and chat APIs (their responses are render.py's).

The models check types and shapes only (strictly: "0.5" is not a number); what the values may
be (temperature >= 0, top_p in (0, 1], K within the bundle's K_max, the prompt within the
context, a schema the grammar engine compiles) is checked once, by the runtime, whose errors
name the field at fault. Fields that would change the output in ways specrt does not implement
(echo, suffix, best_of) are refused rather than ignored; unknown fields are ignored, as
OpenAI-compatible servers do, so clients that send extras still work. `n` choices are n
generations of the same request (`choices`), run side by side in the batch; with a seed, choice
i samples with seed + i, so the set is reproducible and its members differ.

Structured output comes as OpenAI's `response_format` (json_object, json_schema) or as vLLM's
`structured_outputs` (json, regex, grammar: Lark or GBNF, choice, json_object), on both
endpoints; tools as OpenAI's `tools` and `tool_choice` (tools.py).
"""

from __future__ import annotations

import contextlib
import json
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from specrt.runtime import Options, Structure
from specrt.serve.errors import APIError
from specrt.serve.tools import Tools

MAX_CHOICES = 16  # n per request: each choice is a generation of its own in the queue


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class Speculation(BaseModel):
    """The `speculation` field as an object: which policy picks K, and who drafts."""

    model_config = ConfigDict(strict=True, extra="forbid")
    controller: str | None = None  # off | fixed:K | heuristic | adaptive
    drafter: str | None = None  # model | ngram | hybrid
    jump_forward: bool | None = None  # draft a grammar's forced tokens for free (default on)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, grammar (Lark, or
    llama.cpp's GBNF), choice or json_object."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_schema: dict | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None

    def structure(self) -> Structure:
        given = {k: v for k, v in self.model_dump().items() if v not in (None, False)}
        if len(given) != 1:
            raise APIError(
                "invalid",
                "structured_outputs takes exactly one of json, regex, grammar, choice, "
                f"json_object; got {', '.join(given) or 'none'}",
                param="structured_outputs",
            )
        ((kind, value),) = given.items()
        kind = {"grammar": "lark"}.get(kind, kind)
        return Structure(kind, None if kind == "json_object" else value)


def response_format(fmt: dict) -> Structure | None:
    """OpenAI's response_format: text (no structure), json_object or json_schema."""
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structure("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(
                "invalid",
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format.json_schema.schema",
            )
        return Structure("json_schema", spec["schema"])
    raise APIError(
        "invalid",
        f"response_format type {kind!r} is not one of text, json_object, json_schema",
        param="response_format.type",
    )


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the output is expected to mostly repeat (a file with
    one function changed), drafted for free where the output follows it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Request(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = None  # OpenAI's default is 1 (sampling), not greedy
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, llama.cpp)
    min_p: float | None = None  # extension (vLLM, llama.cpp)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extension: a controller spec (off | fixed:K | heuristic | adaptive), or an object with
    # `controller` and `drafter` (model | ngram | hybrid).
    speculation: str | Speculation | None = None
    n_max: int | None = Field(None, alias="speculative.n_max")  # llama.cpp's bounds on K
    n_min: int | None = Field(None, alias="speculative.n_min")
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens
    prediction: Prediction | None = None  # on completions too, as an extension
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    structured_outputs: StructuredOutputs | None = None  # extension (vLLM)

    def refuse_unsupported(self) -> None:
        """Options that would change the output and that specrt does not implement."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(
                "invalid",
                f"n must be 1 to {MAX_CHOICES} (choices a request), got {self.n}",
                param="n",
            )

    def choices(self) -> list:
        """One request per choice: this one for n = 1; else n copies with n = 1, choice i with
        seed + i where a seed was given (else each samples on its own)."""
        if self.n == 1:
            return [self]
        seeds = [None if self.seed is None else self.seed + i for i in range(self.n)]
        return [self.model_copy(update={"n": 1, "seed": seed}) for seed in seeds]

    def structure(self) -> tuple[Structure | None, str]:
        """What the output must match, and the field that asked (it names errors)."""
        if self.structured_outputs is not None and self.response_format is not None:
            raise APIError(
                "invalid",
                "send response_format or structured_outputs, not both",
                param="structured_outputs",
            )
        if self.structured_outputs is not None:
            return self.structured_outputs.structure(), "structured_outputs"
        if self.response_format is not None:
            return response_format(self.response_format), "response_format"
        return None, "response_format"

    def logprobs_count(self) -> int | None:
        """How many alternatives each token's log-probability comes with (None: not asked)."""
        return None

    def tool_plan(self, structure: Structure | None) -> Tools | None:
        """The request's tools, checked against the structure it asked for (None: no tools)."""
        return None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def options(self, default_speculation: str, default_drafter: str | None) -> tuple[Options, str]:
        """The request's `Options` (max_new_tokens and timeout are the service's: the default
        depends on the prompt's length), and the field that asked for its structure (it names
        errors)."""
        structure, field = self.structure()
        asked = self.speculation
        if not isinstance(asked, Speculation):
            asked = Speculation(controller=asked)
        spec = asked.controller or default_speculation
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        options = Options(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            speculate=spec != "off",
            controller=None if spec == "off" else spec,
            drafter=asked.drafter or default_drafter,
            min_draft=self.n_min,
            max_draft=self.n_max,
            ignore_eos=self.ignore_eos,
            prediction=self.prediction.text if self.prediction else None,
            jump_forward=asked.jump_forward is not False,
            structure=structure,
            logit_bias=_token_ids(self.logit_bias),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=self.logprobs_count(),
        )
        return options, field


class CompletionRequest(_Request):
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default for completions
    template_kwargs: ClassVar[None] = None  # a plain prompt meets no template

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo or self.suffix or (self.best_of or 1) > 1:
            name = next(n for n in ("echo", "suffix", "best_of") if getattr(self, n))
            raise APIError("invalid", f"{name} is not supported by specrt", param=name)

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> str | list[int]:
        """One text or one list of token ids; a batch of prompts would be several choices."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(
                    "invalid",
                    f"one prompt per request (n=1), got a list of {len(prompt)}",
                    param="prompt",
                )
            prompt = prompt[0]
        return prompt


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, sent back in the next turn
    tool_call_id: str | None = None  # a tool message answers this call
    name: str | None = None

    def as_template_input(self) -> dict:
        """The message as chat templates read it: calls' arguments as objects (OpenAI sends
        them as JSON text; templates write them with tojson, as transformers passes them)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def _token_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """logit_bias's keys are token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError as err:
        raise APIError(
            "invalid", f"logit_bias keys must be token ids: {err}", param="logit_bias"
        ) from err


class ChatRequest(_Request):
    default_max_tokens: ClassVar[int | None] = None  # as many as the context holds

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # Extra variables for the chat template, as vLLM and llama-server take them (Qwen3's
    # `enable_thinking`); the template's own (messages, tools, ...) cannot be replaced.
    chat_template_kwargs: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("invalid", "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise APIError("invalid", "tool_choice needs tools", param="tool_choice")

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_plan(self, structure: Structure | None) -> Tools | None:
        if not self.tools:
            return None
        plan = Tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        if plan.choice not in ("auto", "none") and structure is not None:
            raise APIError(
                "invalid",
                "a required or named tool call and a response format cannot both be enforced",
                param="tool_choice",
            )
        return plan

    def prompt_input(self) -> list[dict]:
        return [m.as_template_input() for m in self.messages]

    @property
    def template_kwargs(self) -> dict | None:
        return self.chat_template_kwargs

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
