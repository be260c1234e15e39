"""The formats families write tool calls in, each parsed back into OpenAI's calls (whole, or
one delta per call when streamed), and the grammar that writes a required or named call in it.

- hermes (Qwen2.5, Qwen3, Hermes fine-tunes): each call a block,
  `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`;
- mistral (Mistral's instruct models): `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`;
- phi4_mini_json (Phi-4-mini): `functools[{"name": .., "arguments": {..}}, ..]`;
- pythonic (Llama 3.2 1B/3B's pythonic template, Llama 4, some Gemma fine-tunes): a Python
  list of calls, `[get_weather(city="Oslo"), get_time(zone="CET")]`;
- llama3_json (Llama 3.1-3.3 with custom tools): the whole answer a call,
  `{"name": .., "parameters": {..}}`, after `<|python_tag|>` or not, several joined by `; `.

A bundle's format is read from its chat template (the first whose sign the template writes),
or set with `--tool-parser`. The markers are kept in the decoded text even where the vocabulary
makes them special tokens (TextTokenizer.keep). Text that looks like calls but does not parse
as them stays the answer: a model may write the tags in prose.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from specrt.runtime.grammar import JSON_LAYOUT
from specrt.runtime.stops import partial_stop

JSON_NAMES = {"true": True, "false": False, "null": None}


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


@dataclass(frozen=True)
class ToolFormat:
    name: str
    signs: tuple[str, ...]  # a chat template that writes one of these writes this format
    start: str  # what opens the calls ("": a JSON object that begins the answer)
    end: str | None  # what closes each call's block; None: the calls run to the end
    listed: bool  # the calls after `start` are one JSON list
    arguments: str  # a call's key for its arguments
    separator: str  # between calls, where several are written
    prefix: str = ""  # a marker the model may write before the calls (Llama's python tag)
    opener: str = "{"  # where `start` is "": the character the calls begin with

    @property
    def markers(self) -> tuple[str, ...]:
        """Text the decoded output must keep, special tokens or not."""
        return tuple(m for m in (self.start, self.end, self.prefix) if m)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text outside the calls and the calls, in order."""
        if self.end is not None:
            return self._parse_blocks(text)
        at = self.calls_at(text)
        if at is None:
            return text, []
        calls = self._parse_body(text[at:])
        return (text, []) if calls is None else (text[:at].strip(), calls)

    def calls_at(self, text: str) -> int | None:
        """Where the calls begin in text, if anywhere."""
        if self.start:
            at = text.find(self.start)
            return None if at < 0 else at
        stripped = text.lstrip()
        if stripped.startswith((self.opener, self.prefix or self.opener)):
            return len(text) - len(stripped)
        return None

    def _parse_body(self, body: str) -> list[ToolCall] | None:
        body = body[len(self.start) :] if self.start else body
        body = body.strip().removeprefix(self.prefix).strip() if self.prefix else body.strip()
        try:
            items = json.loads(body) if self.listed else _objects(body, self.separator)
        except json.JSONDecodeError:
            return None
        calls = [self._call(item) for item in items] if isinstance(items, list) else None
        return None if not calls or None in calls else calls

    def _parse_blocks(self, text: str) -> tuple[str, list[ToolCall]]:
        pattern = re.escape(self.start) + r"\s*(.*?)\s*" + re.escape(self.end)
        calls, kept, end = [], [], 0
        for match in re.finditer(pattern, text, re.DOTALL):
            call = self.block(match.group(1))
            if call is not None:
                kept.append(text[end : match.start()])
                calls.append(call)
                end = match.end()
        kept.append(text[end:])
        return "".join(kept).strip(), calls

    def block(self, body: str) -> ToolCall | None:
        """One block's call (hermes), None where it is no call."""
        try:
            return self._call(json.loads(body))
        except json.JSONDecodeError:
            return None

    def _call(self, data) -> ToolCall | None:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get(self.arguments, data.get("arguments", data.get("parameters", {})))
        text = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        return ToolCall(data["name"], text, f"call_{uuid.uuid4().hex[:24]}")

    def function_rules(self, i: int, name: str, parameters: dict) -> list[str]:
        """The Lark rule `f{i}`: one call of this function in this format, its arguments
        matching their schema."""
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, self.arguments: parameters},
            "required": ["name", self.arguments],
            "additionalProperties": False,
            "x-guidance": JSON_LAYOUT,
        }
        return [f"f{i}: %json {json.dumps(call)}"]

    def grammar(self, literal, alternatives: str, several: bool) -> list[str]:
        """The Lark rules of the calls (`call` is one of `alternatives`, a function's rule):
        `start` writes one, or with `several` one or more. literal: how a marker is written
        (a special token by its id, see Grammars.literal)."""
        one = f"({alternatives})"
        if self.end is not None:
            call = f'call: {literal(self.start)} "\\n" {one} "\\n" {literal(self.end)}'
            # Calls are a newline apart, as the templates write them, and that newline must
            # not promise another call: the end stays reachable after it. (A model that writes
            # a newline after each call, as Qwen2.5 does, was forced into calls until max_tokens.)
            more = '("\\n" call)* "\\n"?' if several else ""
            return [f"start: call {more}".strip(), call]
        sep = json.dumps(self.separator)
        calls = f"call ({sep} call)*" if several else "call"
        body = f'"[" {calls} "]"' if self.listed else calls
        head = f"{literal(self.start)} " if self.start else ""
        return [f"start: {head}{body}", f"call: {one}"]


class Pythonic(ToolFormat):
    """Calls as a Python list of function calls with keyword arguments. Values are read as
    Python literals, and as JSON's where a grammar wrote them (true, false, null)."""

    def _parse_body(self, body: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body.strip(), mode="eval").body
            calls = [self._pycall(node) for node in tree.elts] if isinstance(tree, ast.List) else []
        except (SyntaxError, ValueError):
            return None
        return calls or None

    def _pycall(self, node) -> ToolCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        arguments = {k.arg: _literal(k.value) for k in node.keywords}
        return self._call({"name": node.func.id, "arguments": arguments})

    def function_rules(self, i: int, name: str, parameters: dict) -> list[str]:
        """`name(key=value, ...)` with the schema's required arguments in its order, each value
        JSON of its property's schema (optional arguments are left out)."""
        properties = parameters.get("properties") or {}
        parts, rules = [json.dumps(f"{name}(")], []
        for j, key in enumerate(parameters.get("required") or []):
            schema = {**properties.get(key, {}), "x-guidance": JSON_LAYOUT}
            rules.append(f"f{i}a{j}: %json {json.dumps(schema)}")
            parts += [json.dumps((", " if j else "") + f"{key}="), f"f{i}a{j}"]
        return [f"f{i}: {' '.join([*parts, json.dumps(')')])}", *rules]


def _literal(node):
    """A Python literal's value; JSON's true, false and null as Python's."""
    if isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)


class CallStream:
    """Streamed text split into content and whole calls: content flows as it comes, except
    from where calls may begin: a block is held until it closes (hermes), calls that run to
    the end until the end (then parsed, or let out as content where they are no calls)."""

    def __init__(self, form: ToolFormat):
        self.form, self.pending = form, ""
        self.holding = False  # the calls have begun: the rest waits for the end
        self.wrote = False  # content came first (llama3_json's calls are the whole answer)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.pending += text
        if self.form.end is not None:
            return self._blocks(final)
        content = ""
        if not self.holding:
            at = None if self.wrote and not self.form.start else self.form.calls_at(self.pending)
            cut = at if at is not None else len(self.pending) - (0 if final else self._tail())
            content, self.pending = self.pending[:cut], self.pending[cut:]
            self.holding = at is not None
            self.wrote = self.wrote or bool(content.strip())
        if not final:
            return content, []
        held, self.pending = self.pending, ""
        text, calls = self.form.parse(held)
        return content + text, calls

    def _tail(self) -> int:
        """How much of the pending text may still begin the calls."""
        if self.form.start:
            return partial_stop(self.pending, [self.form.start])
        stripped = self.pending.lstrip()
        maybe = not self.wrote and (self.form.prefix or self.form.opener).startswith(stripped)
        return len(self.pending) if maybe else 0

    def _blocks(self, final: bool) -> tuple[str, list[ToolCall]]:
        start, end = self.form.start, self.form.end
        content, calls = "", []
        while (at := self.pending.find(start)) >= 0 and (close := self.pending.find(end, at)) >= 0:
            stop = close + len(end)
            call = self.form.block(self.pending[at + len(start) : close].strip())
            content += self.pending[:stop] if call is None else self.pending[:at]
            calls += [call] if call is not None else []
            self.pending = self.pending[stop:]
        at = self.pending.find(start)
        if final:
            hold = 0
        elif at >= 0:  # a block begun and not closed: held whole
            hold = len(self.pending) - at
        else:  # the end may begin the start marker
            hold = partial_stop(self.pending, [start])
        content += self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return content, calls


def _objects(body: str, separator: str) -> list:
    """JSON objects written one after another, joined by the separator (Llama 3's `; `)."""
    decoder, items, at = json.JSONDecoder(), [], 0
    while at < len(body):
        item, at = decoder.raw_decode(body, at)
        items.append(item)
        rest = body[at:].lstrip()
        if rest.startswith(separator.strip()):
            rest = rest[len(separator.strip()) :].lstrip()
        elif rest:
            raise json.JSONDecodeError("text after the calls", body, at)
        at = len(body) - len(rest)
    return items


HERMES = ToolFormat(
    "hermes", ("<tool_call>",), "<tool_call>", "</tool_call>", False, "arguments", "\n"
)
MISTRAL = ToolFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", None, True, "arguments", ", ")
PHI4_MINI = ToolFormat("phi4_mini_json", ("functools",), "functools", None, True, "arguments", ", ")
LLAMA3 = ToolFormat(
    "llama3_json", ("<|python_tag|>", "ipython"), "", None, False, "parameters", "; ",
    prefix="<|python_tag|>",
)  # fmt: skip
PYTHONIC = Pythonic("pythonic", ("[func_name1(",), "", None, True, "arguments", ", ", opener="[")
FORMATS = {f.name: f for f in (HERMES, MISTRAL, PHI4_MINI, PYTHONIC, LLAMA3)}


PARSERS = ("auto", *FORMATS)  # --tool-parser


def choose(parser: str, chat_template: str | None) -> ToolFormat | None:
    """--tool-parser's format, or with `auto` the one the chat template writes: the first
    whose sign it carries (None: no format)."""
    if parser != "auto":
        return FORMATS[parser]
    template = chat_template or ""
    return next((f for f in FORMATS.values() if any(s in template for s in f.signs)), None)
