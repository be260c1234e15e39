"""Reasoning output: the model's thought, written between <think> and </think>, returned apart
from its answer as `message.reasoning_content` (`delta.reasoning_content` when streamed), as
vLLM, SGLang and llama-server return it.

Two kinds of template lead there. Qwen3's lets the model open the thought itself (and with
`chat_template_kwargs: {"enable_thinking": false}` writes an empty one into the prompt, so the
answer comes straight away); DeepSeek-R1's distills end the prompt inside an opened thought, so
the output starts as reasoning with no tag of its own. Which one a request is in is read from
the end of its rendered prompt (`opens_thought`). Only the first thought is parsed: text after
it is the answer, tags and all. The parse changes only how the text is shown: the tokens are
the target's, exact under speculation like any other.
"""

from __future__ import annotations

import json

from specrt.runtime import Structure
from specrt.runtime.grammar import JSON_LAYOUT
from specrt.runtime.stops import partial_stop

OPEN, CLOSE = "<think>", "</think>"
JSON_KINDS = ("json_schema", "json_object")  # the structures a thought may precede
PARSERS = ("auto", "think", "none")  # --reasoning-parser: auto parses where the template thinks


def parses(parser: str, chat_template: str | None) -> bool:
    """Whether outputs are parsed for a thought: `think` always, `none` never, `auto` where
    the chat template writes the tags."""
    return parser == "think" or (parser == "auto" and OPEN in (chat_template or ""))


def opens_thought(prompt_tail: str) -> bool:
    """Whether a prompt ending so leaves a thought open: its last <think> after its last
    </think>."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def closes_thought(prompt_tail: str) -> bool:
    """Whether a prompt ending so has closed a thought for the model (Qwen3's template with
    enable_thinking false writes an empty one): the answer comes without one."""
    return prompt_tail.rfind(CLOSE) > prompt_tail.rfind(OPEN) >= 0


def after_thought(structure: Structure, inside: bool, literal) -> Structure:
    """A JSON structure that starts once the thought has closed: free text up to the first
    </think> (opened by the model where the prompt did not), the space after it, then the
    answer, which alone must match the schema. literal: how <think> is written (a special
    token by its id, see Grammars.literal)."""
    schema = structure.value if structure.kind == "json_schema" else {"type": "object"}
    opener = "" if inside else f"{literal(OPEN)} "
    answer = {**schema, "x-guidance": JSON_LAYOUT}
    rules = [
        f"start: {opener}thought answer | {opener}thought SPACE answer",
        "thought[lazy]: /(.|\\n)*<\\/think>/",
        "SPACE: /[ \\n]+/",
        f"answer: %json {json.dumps(answer)}",
    ]
    return Structure("lark", "\n".join(rules))


class ThoughtStream:
    """Streamed text split into reasoning and answer: text flows as it comes, but for a tail
    that may begin the tag that switches between the two."""

    def __init__(self, inside: bool):
        self.inside = inside  # in the thought now
        self.done = False  # the thought has closed: the rest is the answer
        self.pending = ""
        self._trim = False  # drop the whitespace between the thought and the answer

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) of the text fed so far that can be placed."""
        self.pending += text
        reasoning = answer = ""
        while not self.done:
            tag = CLOSE if self.inside else OPEN
            at = self.pending.find(tag)
            if at < 0:
                break
            if self.inside:
                reasoning += self.pending[:at]
                self.done, self._trim = True, True
            else:
                answer += self.pending[:at]
            self.pending = self.pending[at + len(tag) :]
            self.inside = not self.inside
        hold = (
            0
            if final or self.done
            else partial_stop(self.pending, [CLOSE if self.inside else OPEN])
        )
        cut = len(self.pending) - hold
        ready, self.pending = self.pending[:cut], self.pending[cut:]
        if self.inside:
            return reasoning + ready, answer
        if self._trim:
            ready = ready.lstrip()
            self._trim = not ready
        return reasoning, answer + ready


def split(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole output's reasoning (None where it has no thought) and answer."""
    stream = ThoughtStream(inside)
    reasoning, answer = stream.feed(text, final=True)
    thought = inside or stream.done or stream.inside
    return (reasoning if thought else None), answer
