"""Tool calls the way the model's chat template writes them.

The request's tools go into the prompt through the chat template (the model was trained on that
text); the output's calls are parsed back into OpenAI's `message.tool_calls` (whole, or one
delta per call when streamed) in the bundle's format (tool_formats.py: Hermes', Mistral's,
Phi-4-mini's, the pythonic list, Llama 3's); `tool_choice: "required"` or a named function is
enforced by a grammar that admits only calls in that format, each call's arguments matching
its function's JSON schema, so the constrained target decides what the call says and
speculation keeps it exact. A second turn sends the calls back as an assistant message and the
results as `tool` messages, and the template renders both. A template that writes none of the
formats gets a 400 for tools unless `--tool-parser` names one: specrt does not guess another
model's format.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from specrt.errors import SpecrtError
from specrt.runtime import Structure
from specrt.runtime.grammar import Grammars
from specrt.serve.errors import APIError
from specrt.serve.tool_formats import FORMATS, ToolFormat

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


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

    def check_format(self, form: ToolFormat | None) -> None:
        """Refuse tools where the bundle's template writes calls in no format specrt parses
        (and --tool-parser names none)."""
        if self.parses and form is None:
            raise APIError(
                "invalid",
                "this model's chat template does not write tool calls in a format specrt "
                f"parses ({', '.join(FORMATS)}); if the model writes one of them, start the "
                "server with --tool-parser NAME",
                param="tools",
            )

    def structure(self, grammars: Grammars, form: ToolFormat) -> Structure | None:
        """The grammar of a required or named call in the bundle's format (None for auto and
        none). Each function's parameters are compiled alone first, so a bad schema is named
        with its tool."""
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
            rules += form.function_rules(i, function["name"], parameters)
        # A named function is called once (as OpenAI's and vLLM's named choice); `required`
        # calls as many as the model writes, one with parallel_tool_calls off. After the last
        # call the grammar admits only the end of the turn.
        several = self.parallel and self.choice == "required"
        alternatives = " | ".join(f"f{i}" for i in range(len(chosen)))
        calls = form.grammar(grammars.literal, alternatives, several)
        return Structure("lark", "\n".join([*calls, *rules]))


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
