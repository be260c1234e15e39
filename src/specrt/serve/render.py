"""The responses of OpenAI's completions and chat APIs, as whole bodies and as stream chunks.

`Writer` writes one request's response in its endpoint's shape: each choice's text,
log-probabilities where asked, tool calls parsed from the text where tools were given, the usage
of all choices and specrt's `speculation` extension. Parsing the request is protocol.py's; this
module only renders what the engines produced.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from specrt.runtime import Result, TokenLogprob
from specrt.serve.reasoning import ThoughtStream, split
from specrt.serve.tool_formats import CallStream, ToolCall, ToolFormat

# OpenAI's finish reasons; "timeout", "shutdown" and "cancelled" are specrt's own and pass as
# they are.
FINISH_REASONS = {"eos": "stop", "context": "length"}


def usage(results: list[Result]) -> dict:
    """OpenAI's usage over a request's choices (its prompt counted once): how much of the prompt
    a slot already held (cached, not computed again), prediction tokens the outputs kept, and
    those verified and dropped."""
    prompt = results[0].stats.prompt_tokens
    completion = sum(len(result.token_ids) for result in results)
    details = {
        kind: sum(getattr(result.stats, kind) for result in results)
        for kind in ("accepted_prediction_tokens", "rejected_prediction_tokens")
    }
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": results[0].stats.cached_tokens},
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
    """The finish reason as the API (and the metrics' outcomes) name it."""
    return FINISH_REASONS.get(result.finish_reason, result.finish_reason)


@dataclass(frozen=True)
class Shape:
    """How a choice's text is parsed (decided with its prompt, see service.py): for a thought
    (None: not), starting inside one or not (reasoning.py); for tool calls in a format (None:
    not, tool_formats.py)."""

    thinking: bool | None = None
    tools: ToolFormat | None = None


@dataclass
class _Choice:
    """What the writer keeps of one choice while it streams."""

    shape: Shape
    calls: CallStream | None  # where tools are parsed: the text's calls, whole
    thought: ThoughtStream | None = None  # where a thought is: the streamed text's
    sent_role: bool = False
    called: int = 0  # tool calls streamed so far
    offset: int = 0  # characters of completion text before the next logprob entry
    result: Result | None = None


class Writer:
    """One request's response, in the shape its endpoint uses: the chunks of each of its n
    choices as they stream (text, log-probabilities where asked, tool calls parsed from the
    text where tools were given, one delta per whole call), their last chunks and the usage
    chunk, or the whole body. The request's one response object: its id, its clock and what
    each choice has streamed so far."""

    def __init__(self, chat: bool, model: str, shapes: list[Shape] = (Shape(),)):
        """shapes: how each choice's text is parsed; their number is the request's n."""
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [
            _Choice(
                shape,
                CallStream(shape.tools) if shape.tools and chat else None,
                None if shape.thinking is None or not chat else ThoughtStream(shape.thinking),
            )
            for shape in shapes
        ]

    @property
    def done(self) -> bool:
        return all(choice.result is not None for choice in self.choices)

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(
        self,
        index: int,
        text: str,
        logprobs: list[TokenLogprob] | None = None,
        finish: str | None = None,
    ) -> dict:
        state = self.choices[index]
        calls: list[ToolCall] = []
        reasoning = ""
        if state.thought is not None:
            reasoning, text = state.thought.feed(text, final=finish is not None)
        if state.calls is not None:
            text, calls = state.calls.feed(text, final=finish is not None)
        if not self.chat:
            choice = {"index": index, "text": text, "logprobs": self._logprobs(index, logprobs)}
            return self._envelope("text_completion", [{**choice, "finish_reason": finish}])
        delta: dict = {} if (finish or reasoning) and not text else {"content": text}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if calls:
            delta["tool_calls"] = [c.as_dict(state.called + i) for i, c in enumerate(calls)]
            state.called += len(calls)
        if not state.sent_role:
            delta = {"role": "assistant", **delta}
            state.sent_role = True
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(index, logprobs)}
        return self._envelope("chat.completion.chunk", [{**choice, "finish_reason": finish}])

    def last_chunk(self, index: int, result: Result) -> dict:
        """A choice's last chunk (its finish reason and speculation); its result is kept for
        the usage chunk."""
        self.choices[index].result = result
        chunk = self.chunk(index, "", finish=finish_reason(result))
        if self.choices[index].called and result.finish_reason in ("eos", "stop"):
            chunk["choices"][0]["finish_reason"] = "tool_calls"
        return {**chunk, "speculation": speculation(result)}

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(self._results())}

    def response(self, results: list[Result]) -> dict:
        """The whole response: a choice per result, the usage of all (the prompt once), and
        the speculation extension (a list, one per choice, where n > 1)."""
        for state, result in zip(self.choices, results, strict=True):
            state.result = result
        choices = [self._choice(index, result) for index, result in enumerate(results)]
        obj = "chat.completion" if self.chat else "text_completion"
        stats = [speculation(result) for result in results]
        return {
            **self._envelope(obj, choices),
            "usage": usage(results),
            "speculation": stats[0] if len(stats) == 1 else stats,
        }

    def _results(self) -> list[Result]:
        return [choice.result for choice in self.choices]

    def _choice(self, index: int, result: Result) -> dict:
        finish = finish_reason(result)
        logprobs = self._logprobs(index, result.logprobs)
        if self.chat:
            text, shape = result.text, self.choices[index].shape
            message: dict = {"role": "assistant", "content": text}
            if shape.thinking is not None:
                message["reasoning_content"], text = split(text, shape.thinking)
                message["content"] = text or None
            if shape.tools is not None:
                content, calls = shape.tools.parse(text)
                if calls:
                    message["content"] = content or None
                    message["tool_calls"] = [call.as_dict() for call in calls]
                    finish = "tool_calls" if result.finish_reason in ("eos", "stop") else finish
            choice = {"index": index, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": result.text, "logprobs": logprobs}
        return {**choice, "finish_reason": finish}

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists."""
        if not entries:
            return None
        if self.chat:
            return {"content": [_chat_entry(e) for e in entries], "refusal": None}
        state, offsets = self.choices[index], []
        for entry in entries:
            offsets.append(state.offset)
            state.offset += len(entry.text)
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                dict(zip(e.top_texts, (lp for _, lp in e.top), strict=True)) for e in entries
            ],
            "text_offset": offsets,
        }


def _chat_entry(entry: TokenLogprob) -> dict:
    top = [
        {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        for text, (_, logprob) in zip(entry.top_texts, entry.top, strict=True)
    ]
    return {
        "token": entry.text,
        "logprob": entry.logprob,
        "bytes": list(entry.text.encode()),
        "top_logprobs": top,
    }
