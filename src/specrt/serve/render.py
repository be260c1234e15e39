"""The responses of OpenAI's completions and chat APIs, as whole bodies and as stream chunks.

`Reply` writes one choice of a request in its endpoint's shape: text, log-probabilities where
asked, tool calls parsed from the text where tools were given, the usage of all choices and
specrt's `speculation` extension. Parsing the request is protocol.py's; this module only
renders what the engines produced.
"""

from __future__ import annotations

import time
import uuid

from specrt.runtime import Result, TokenLogprob
from specrt.serve.tools import CallStream, ToolCall, parse_calls

# OpenAI's finish reasons; "timeout" and "cancelled" are specrt's own and pass as they are.
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


class Reply:
    """The chunks and the whole response of one choice of a request, in the shape its endpoint
    uses: text, log-probabilities where asked, and tool calls parsed from the text where tools
    were given (streamed as one delta per whole call). `replies` makes a request's n, which
    share its id; `response` and `usage_chunk` put their results together."""

    def __init__(self, chat: bool, model: str, tools: bool = False, index: int = 0):
        self.chat, self.model, self.index = chat, model, index
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sent_role = False
        self.calls = CallStream() if tools else None
        self.called = 0  # tool calls streamed so far
        self.offset = 0  # characters of completion text before the next logprob entry

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(
        self, text: str, logprobs: list[TokenLogprob] | None = None, finish: str | None = None
    ) -> dict:
        calls: list[ToolCall] = []
        if self.calls is not None:
            text, calls = self.calls.feed(text, final=finish is not None)
        if not self.chat:
            choice = {"index": self.index, "text": text, "logprobs": self._logprobs(logprobs)}
            return self._envelope("text_completion", [{**choice, "finish_reason": finish}])
        delta: dict = {} if finish and not text else {"content": text}
        if calls:
            delta["tool_calls"] = [c.as_dict(self.called + i) for i, c in enumerate(calls)]
            self.called += len(calls)
        if not self.sent_role:
            delta = {"role": "assistant", **delta}
            self.sent_role = True
        choice = {"index": self.index, "delta": delta, "logprobs": self._logprobs(logprobs)}
        return self._envelope("chat.completion.chunk", [{**choice, "finish_reason": finish}])

    def last_chunk(self, result: Result) -> dict:
        chunk = self.chunk("", finish=finish_reason(result))
        if self.called and result.finish_reason in ("eos", "stop"):
            chunk["choices"][0]["finish_reason"] = "tool_calls"
        return {**chunk, "speculation": speculation(result)}

    def usage_chunk(self, results: list[Result]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(results)}

    @staticmethod
    def replies(chat: bool, model: str, tools: bool, n: int) -> list[Reply]:
        first = Reply(chat, model, tools)
        rest = [Reply(chat, model, tools, index) for index in range(1, n)]
        for reply in rest:
            reply.id, reply.created = first.id, first.created
        return [first, *rest]

    @staticmethod
    def response(replies: list[Reply], results: list[Result]) -> dict:
        """The whole response: a choice per result, the usage of all (the prompt once), and
        the speculation extension (a list, one per choice, where n > 1)."""
        choices = [reply.choice(result) for reply, result in zip(replies, results, strict=True)]
        obj = "chat.completion" if replies[0].chat else "text_completion"
        stats = [speculation(result) for result in results]
        return {
            **replies[0]._envelope(obj, choices),
            "usage": usage(results),
            "speculation": stats[0] if len(stats) == 1 else stats,
        }

    def choice(self, result: Result) -> dict:
        finish = finish_reason(result)
        logprobs = self._logprobs(result.logprobs)
        if self.chat:
            message: dict = {"role": "assistant", "content": result.text}
            if self.calls is not None:
                content, calls = parse_calls(result.text)
                if calls:
                    message = {"role": "assistant", "content": content or None}
                    message["tool_calls"] = [call.as_dict() for call in calls]
                    finish = "tool_calls" if result.finish_reason in ("eos", "stop") else finish
            choice = {"index": self.index, "message": message, "logprobs": logprobs}
        else:
            choice = {"index": self.index, "text": result.text, "logprobs": logprobs}
        return {**choice, "finish_reason": finish}

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists."""
        if not entries:
            return None
        if self.chat:
            return {"content": [_chat_entry(e) for e in entries], "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(self.offset)
            self.offset += len(entry.text)
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
