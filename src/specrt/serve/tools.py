"""Tool calls the way the model's chat template writes them.

The request's tools go into the prompt through the chat template (the model was trained on that
text); the output's calls are parsed back into OpenAI's `message.tool_calls` (whole, or one
delta per call when streamed); `tool_choice: "required"` or a named function is enforced by a
grammar that admits only calls, each call's arguments matching its function's JSON schema, so
the constrained target decides what the call says and speculation keeps it exact. A second turn
sends the calls back as an assistant message and the results as `tool` messages, and the
template renders both.

The format is Hermes', which Qwen2.5 and Qwen3 use: each call a JSON object {"name": ...,
"arguments": {...}} between <tool_call> and </tool_call>. A template that does not write
<tool_call> gets a 400 for tools: specrt does not guess another model's format.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from specrt.errors import SpecrtError
from specrt.runtime import Structure
from specrt.runtime.grammar import JSON_LAYOUT, Grammars
from specrt.serve.errors import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_dict(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


class Tools:
    """A chat request's tools and tool_choice, checked: what the template renders, whether the
    output is parsed for calls, and the grammar that enforces a required or named call."""

    def __init__(self, tools: Sequence[dict], choice: str | dict | None, parallel: bool):
        self.functions = [_function(i, tool) for i, tool in enumerate(tools)]
        names = [f["name"] for f in self.functions]
        if len(set(names)) != len(names):
            raise APIError("invalid", "tool names must be unique", param="tools")
        self.choice = _choice(choice or "auto", names)
        self.parallel = parallel

    @property
    def rendered(self) -> list[dict] | None:
        """The tools as the chat template receives them (none when calls are ruled out)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def check_template(self, chat_template: str | None) -> None:
        if self.parses and OPEN not in (chat_template or ""):
            raise APIError(
                "invalid",
                "this model's chat template does not write tool calls in a format specrt "
                f"parses (Hermes: {OPEN} ... {CLOSE}, as Qwen2.5 and Qwen3 use)",
                param="tools",
            )

    def structure(self, grammars: Grammars) -> Structure | None:
        """The grammar of a required or named call (None for auto and none). Each function's
        parameters are compiled alone first, so a bad schema is named with its tool."""
        if self.choice in ("auto", "none"):
            return None
        chosen = [f for f in self.functions if self.choice in ("required", f["name"])]
        rules = []
        for i, function in enumerate(chosen):
            parameters = function.get("parameters") or {"type": "object"}
            try:
                grammars.compile(Structure("json_schema", parameters))
            except SpecrtError as err:
                index = self.functions.index(function)
                param = f"tools[{index}].function.parameters"
                raise APIError("invalid", f"{param}: {err}", param=param) from err
            call = {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
                "x-guidance": JSON_LAYOUT,
            }
            rules.append(f"f{i}: %json {json.dumps(call)}")
        # A named function is called once (as OpenAI's and vLLM's named choice); `required`
        # calls as many as the model writes, one with parallel_tool_calls off. After the last
        # call the grammar admits only the end of the turn.
        several = self.parallel and self.choice == "required"
        start = 'start: call ("\\n" call)*' if several else "start: call"
        alternatives = " | ".join(f"f{i}" for i in range(len(chosen)))
        call = (
            f'call: {grammars.literal(OPEN)} "\\n" ({alternatives}) "\\n" {grammars.literal(CLOSE)}'
        )
        return Structure("lark", "\n".join([start, call, *rules]))


def _function(index: int, tool) -> dict:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(
            "invalid", f'{where} must be {{"type": "function", "function": {{...}}}}', param=where
        )
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError("invalid", f"{where}.function must have a name", param=f"{where}.function")
    if not NAME.match(function["name"]):
        raise APIError(
            "invalid",
            f"{where}.function.name must be 1-64 letters, digits, _ or -, got {function['name']!r}",
            param=f"{where}.function.name",
        )
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        param = f"{where}.function.parameters"
        raise APIError("invalid", f"{param} must be a JSON schema object", param=param)
    return {k: v for k, v in function.items() if k in ("name", "description", "parameters")}


def _choice(choice, names: list[str]) -> str:
    """none, auto, required, or the name of the function that must be called."""
    if choice in ("none", "auto", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name is None:
        raise APIError(
            "invalid",
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise APIError(
            "invalid", f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
        )
    return name


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside the calls and the calls, in order. A block that is not a JSON object
    with a name stays in the text: a model may write the tags in prose."""
    calls, kept, end = [], [], 0
    for match in CALL.finditer(text):
        call = _call(match.group(1))
        if call is not None:
            kept.append(text[end : match.start()])
            calls.append(call)
            end = match.end()
    kept.append(text[end:])
    return "".join(kept).strip(), calls


def _call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(data["name"], text, f"call_{uuid.uuid4().hex[:24]}")


class CallStream:
    """Streamed text split into content and whole calls: content flows as it comes, except
    from an opening tag (or what may become one) until its call closes."""

    def __init__(self):
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.pending += text
        content, calls = "", []
        while True:
            start = self.pending.find(OPEN)
            if start < 0:
                break
            close = self.pending.find(CLOSE, start)
            if close < 0:
                break
            end = close + len(CLOSE)
            call = _call(self.pending[start + len(OPEN) : close].strip())
            if call is None:
                content += self.pending[:end]
            else:
                content += self.pending[:start]
                calls.append(call)
            self.pending = self.pending[end:]
        hold = 0 if final else _held(self.pending)
        content += self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return content, calls


def _held(text: str) -> int:
    """How much of text's end must wait: an open call, or a tail that may begin a tag."""
    start = text.find(OPEN)
    if start >= 0:
        return len(text) - start
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0
