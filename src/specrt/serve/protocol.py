"""The request bodies and response chunks of OpenAI's completions and chat APIs.

The models check types and shapes only (strictly: "0.5" is not a number); what the values may
be (temperature >= 0, top_p in (0, 1], K within the bundle's K_max, the prompt within the
context) is checked once, by the runtime, whose errors name the field at fault. Fields that
would change the output in ways specrt does not implement (penalties, logit bias, logprobs,
tools, several choices) are refused rather than ignored; unknown fields are ignored, as
OpenAI-compatible servers do, so clients that send extras still work.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from specrt.runtime import Result
from specrt.serve.errors import APIError

# OpenAI's finish reasons; "timeout" is specrt's own (the request hit the server's --timeout).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class Speculation(BaseModel):
    """The `speculation` field as an object: which policy picks K, and who drafts."""

    model_config = ConfigDict(strict=True, extra="forbid")
    controller: str | None = None  # off | fixed:K | heuristic | adaptive
    drafter: str | None = None  # model | ngram | hybrid


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

    def refuse_unsupported(self) -> None:
        """Options that would change the output and that specrt does not implement."""
        if self.n != 1:
            raise APIError(
                400,
                f"n must be 1: this server returns one choice per request, got {self.n}",
                param="n",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by specrt", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by specrt", param="logit_bias")

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def runtime_options(self, default_speculation: str, default_drafter: str | None) -> dict:
        """Keyword arguments for `SpeculativeRuntime.stream` (max_new_tokens is the caller's:
        its default depends on the prompt's length)."""
        asked = self.speculation
        if not isinstance(asked, Speculation):
            asked = Speculation(controller=asked)
        spec = asked.controller or default_speculation
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "seed": self.seed,
            "stop": stop,
            "speculate": spec != "off",
            "controller": None if spec == "off" else spec,
            "drafter": asked.drafter or default_drafter,
            "min_draft": self.n_min,
            "max_draft": self.n_max,
            "ignore_eos": self.ignore_eos,
            "prediction": self.prediction.text if self.prediction else None,
        }


class CompletionRequest(_Request):
    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's default for completions

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo or self.suffix or (self.best_of or 1) > 1 or self.logprobs:
            name = next(n for n in ("echo", "suffix", "best_of", "logprobs") if getattr(self, n))
            raise APIError(400, f"{name} is not supported by specrt", param=name)

    def prompt_input(self) -> str | list[int]:
        """One text or one list of token ids; a batch of prompts would be several choices."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(
                    400,
                    f"one prompt per request (n=1), got a list of {len(prompt)}",
                    param="prompt",
                )
            prompt = prompt[0]
        return prompt


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatRequest(_Request):
    default_max_tokens: ClassVar[int | None] = None  # as many as the context holds

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise APIError(400, "logprobs is not supported by specrt", param="logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported by specrt", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(
                400,
                "response_format other than text is not supported by specrt",
                param="response_format",
            )

    def prompt_input(self) -> list[dict]:
        return [m.as_template_input() for m in self.messages]

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def usage(result: Result) -> dict:
    """OpenAI's usage: prediction tokens the output kept, and those verified and dropped."""
    s = result.stats
    prompt, completion = s.prompt_tokens, len(result.token_ids)
    details = {
        "accepted_prediction_tokens": s.accepted_prediction_tokens,
        "rejected_prediction_tokens": s.rejected_prediction_tokens,
    }
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": details,
    }


def speculation(result: Result) -> dict:
    """Extension: how this request's speculation went."""
    s = result.stats
    return {
        "controller": s.controller,
        "drafter": s.drafter,
        "rounds": s.rounds,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "target_calls": s.target_calls,
        "tokens_per_target_call": s.tokens_per_target_call,
        "ks": s.ks,
    }


def finish_reason(result: Result) -> str:
    return FINISH_REASONS.get(result.finish_reason, result.finish_reason)


class Reply:
    """The chunks and the whole response of one request, in the shape its endpoint uses."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent_role = False

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, text: str, finish: str | None = None) -> dict:
        if not self.chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return self._envelope("text_completion", [choice])
        delta: dict = {} if finish and not text else {"content": text}
        if not self.sent_role:
            delta = {"role": "assistant", **delta}
            self.sent_role = True
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return self._envelope("chat.completion.chunk", [choice])

    def last_chunk(self, result: Result) -> dict:
        return {**self.chunk("", finish_reason(result)), "speculation": speculation(result)}

    def usage_chunk(self, result: Result) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(result)}

    def response(self, result: Result) -> dict:
        finish = finish_reason(result)
        if self.chat:
            message = {"role": "assistant", "content": result.text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": usage(result), "speculation": speculation(result)}
