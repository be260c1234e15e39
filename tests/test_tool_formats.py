"""Tool calls in each family's format: parsed whole and streamed (cut anywhere), enforced by a
grammar in that format for `required` and a named function, through the real server and the
official client, identical with speculation on and off, and a second turn answered in text.

No Mistral, Phi or Llama tokenizer ships here: the tiny qwen2 model gets a template that writes
each format as the family's documented template does (tools in the prompt, calls in the
assistant turn, results after); the parsers were written for Mistral-7B-Instruct-v0.3 (and
later Mistral instruct models), Phi-4-mini-instruct, Llama 3.2's pythonic template and Llama
3.1-3.3 Instruct."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
from servers import client, serving, wait_healthy
from tokenizers import Tokenizer

from specrt.bundle import Bundle
from specrt.exporter.build import build_bundle
from specrt.exporter.tiny import make_tiny_pair
from specrt.runtime.grammar import Grammars, Structure
from specrt.runtime.text import TextTokenizer
from specrt.serve import ServeSettings
from specrt.serve.tool_formats import FORMATS, LLAMA3, MISTRAL, PYTHONIC, CallStream, choose
from specrt.serve.tools import Tools

TURNS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}CALLS{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '{"name": "{{ c.function.name }}", "KEY": {{ c.function.arguments | tojson }}}'
LISTED = "{% for c in m.tool_calls %}" + CALL + "{% if not loop.last %}, {% endif %}{% endfor %}"
TOOLS = "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }} SIGN<|im_end|>\n{% endif %}"
TEMPLATES = {  # each as its family's template writes calls, and the sign it is known by
    "mistral": TOOLS.replace("SIGN", "[TOOL_CALLS]")
    + TURNS.replace("CALLS", "[TOOL_CALLS][" + LISTED.replace("KEY", "arguments") + "]"),
    "phi4_mini_json": TOOLS.replace("SIGN", "functools")
    + TURNS.replace("CALLS", "functools[" + LISTED.replace("KEY", "arguments") + "]"),
    "pythonic": TOOLS.replace("SIGN", "[func_name1(params_name1=params_value1)]")
    + TURNS.replace(
        "CALLS",
        "[{% for c in m.tool_calls %}{{ c.function.name }}("
        "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
        "{% if not loop.last %}, {% endif %}{% endfor %})"
        "{% if not loop.last %}, {% endif %}{% endfor %}]",
    ),
    "llama3_json": TOOLS.replace("SIGN", "<|python_tag|>")
    + TURNS.replace("CALLS", LISTED.replace("KEY", "parameters").replace(", ", "; ")),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ZONE = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Weather in Oslo, and the time?"}]
TEXTS = {  # name: (output, content, calls)
    "mistral": (
        'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
        "Sure.",
        [("f", {"a": 1}), ("g", {})],
    ),
    "phi4_mini_json": ('functools[{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),
    "llama3_json": (
        '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
        "",
        [("f", {"a": 1}), ("g", {})],
    ),
    "llama3_tagged": ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    "llama3_prose": ('The value is {"a": 1}.', 'The value is {"a": 1}.', []),
    "llama3_no_call": ('{"a": 1}', '{"a": 1}', []),
    "mistral_broken": ("[TOOL_CALLS][{oops", "[TOOL_CALLS][{oops", []),
    "pythonic": (
        '[f(a=1, b="x", c=True, d=None), g(e=[1, 2], h={"k": false})]',
        "",
        [("f", {"a": 1, "b": "x", "c": True, "d": None}), ("g", {"e": [1, 2], "h": {"k": False}})],
    ),
    "pythonic_prose": ("[a list, not calls]", "[a list, not calls]", []),
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_calls_parse_the_same_whole_and_streamed_cut_anywhere(name):
    prefix = name.split("_")[0]
    form = FORMATS.get(name) or {"mistral": MISTRAL, "pythonic": PYTHONIC}.get(prefix, LLAMA3)
    text, content, calls = TEXTS[name]
    got = form.parse(text)
    assert (got[0], [(c.name, json.loads(c.arguments)) for c in got[1]]) == (content, calls)
    for cut in range(1, len(text)):
        stream = CallStream(form)
        first, early = stream.feed(text[:cut])
        rest, late = stream.feed(text[cut:], final=True)
        assert (first + rest).strip() == content, cut
        assert [c.name for c in early + late] == [name for name, _ in calls], cut


def test_the_format_is_read_from_the_template_or_named():
    for name, template in TEMPLATES.items():
        assert choose("auto", template) is FORMATS[name]
    assert choose("auto", "{{ messages }}") is None
    assert choose("mistral", "{{ messages }}") is MISTRAL


def test_a_special_marker_is_kept_in_the_decoded_text(bundles, tmp_path):
    """Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens in their
    vocabularies: decoding drops special tokens, except the markers a parser reads."""
    folder = Bundle.load(bundles["qwen2"]).role("target").folder
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    raw.add_special_tokens(["[TOOL_CALLS]"])
    raw.save(str(tmp_path / "tokenizer.json"))
    tokenizer = TextTokenizer(tmp_path, None)
    ids = tokenizer.encode('[TOOL_CALLS][{"name": "f"}]', add_special_tokens=False)
    assert tokenizer.decode(ids) == '[{"name": "f"}]'  # the control: dropped
    tokenizer.keep(MISTRAL.markers)
    assert tokenizer.decode(ids) == '[TOOL_CALLS][{"name": "f"}]'


@pytest.fixture(scope="module")
def roomy(pairs, tmp_path_factory) -> Path:
    """The tiny qwen2 pair with room for tools in the prompt."""
    draft, target = pairs["qwen2"]
    out = tmp_path_factory.mktemp("formats") / "b"
    return build_bundle(str(draft), str(target), out, max_context=1024, log=lambda _: None)


@contextmanager
def _serving_format(name: str, roomy: Path, tmp_path_factory):
    """The server writing calls in format `name`: its template from TEMPLATES, or for Hermes
    the tiny model's own (Qwen2.5's); yields the client and the format."""
    path = None
    if name != "hermes":
        path = tmp_path_factory.mktemp("templates") / f"{name}.jinja"
        path.write_text(TEMPLATES[name])
    settings = ServeSettings(bundle=roomy, model_name="tiny", calibrate=False, chat_template=path)
    with serving(settings) as (base, _):
        wait_healthy(base)
        yield client(base, timeout=60), FORMATS[name]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def server(request, roomy, tmp_path_factory):
    with _serving_format(request.param, roomy, tmp_path_factory) as served:
        yield served


def _chat(api, off=False, **options):
    extra = {"speculation": "off"} if off else {}
    return api.chat.completions.create(
        model="tiny", messages=options.pop("messages", ASK), temperature=0, extra_body=extra,
        **options,
    )  # fmt: skip


@pytest.mark.parametrize(
    "choice, names",
    [("required", None), ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])],
)
def test_required_and_named_calls_in_each_format(server, choice, names):
    """One call each (parallel calls off: a tiny greedy model repeats a call until max_tokens
    where several are allowed; the grammar of several is compiled below)."""
    api, form = server
    options = {"tools": [WEATHER, ZONE], "tool_choice": choice, "max_tokens": 90}
    options["parallel_tool_calls"] = False
    reply = _chat(api, **options)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", (form.name, message)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert calls and all(name in ("get_weather", "get_time") for name, _ in calls)
    for name, arguments in calls:
        assert set(arguments) == ({"city"} if name == "get_weather" else {"zone"})
    if names:
        assert [name for name, _ in calls] == names  # a named choice: that call, once
    alone = _chat(api, off=True, **options).choices[0].message
    assert [c.function.arguments for c in alone.tool_calls] == [
        c.function.arguments for c in message.tool_calls
    ]
    streamed, finish = {}, None
    for chunk in _chat(api, stream=True, **options):
        for call in chunk.choices[0].delta.tool_calls or []:
            streamed[call.index] = (call.function.name, json.loads(call.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert [streamed[i] for i in sorted(streamed)] == calls and finish == "tool_calls"
    made = message.tool_calls
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in made]},
        *[{"role": "tool", "tool_call_id": c.id, "content": "18 degrees"} for c in made],
    ]
    second = _chat(api, messages=turn, tools=[WEATHER, ZONE], max_tokens=12)
    assert second.usage.prompt_tokens > reply.usage.prompt_tokens
    assert second.choices[0].message.content is not None


def test_a_template_without_a_format_is_a_400_unless_one_is_named(roomy, tmp_path):
    """specrt does not guess a model's format: tools to a template that writes none get a 400
    naming --tool-parser; with --tool-parser the calls are enforced and parsed in that one."""
    import openai

    path = tmp_path / "plain.jinja"
    path.write_text(TURNS.replace("CALLS", ""))
    common = {"bundle": roomy, "model_name": "tiny", "calibrate": False, "chat_template": path}
    options = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 120}
    with serving(ServeSettings(**common)) as (base, _):
        wait_healthy(base)
        with pytest.raises(openai.BadRequestError, match="--tool-parser NAME"):
            _chat(client(base), **options)
    with serving(ServeSettings(**common, tool_parser="mistral")) as (base, _):
        wait_healthy(base)
        reply = _chat(client(base), **options)
    message = reply.choices[0].message
    assert message.tool_calls, message.content
    assert message.tool_calls[0].function.name == "get_weather"


def test_every_format_compiles_its_grammars(roomy):
    """required with parallel calls (several), and a named function (one), in each format."""
    target = Bundle.load(roomy).role("target")
    grammars = Grammars(target.folder / "tokenizer.json", target.dim("vocab_size"), [0])
    named = {"type": "function", "function": {"name": "get_time"}}
    for form in FORMATS.values():
        for choice, parallel in (("required", True), (named, True)):
            structure = Tools([WEATHER, ZONE], choice, parallel).structure(grammars, form)
            grammars.compile(structure)


def test_a_marker_that_is_a_special_token_works_end_to_end(tmp_path):
    """Mistral's vocabulary makes [TOOL_CALLS] a special token: the grammar writes it as that
    token, decoding keeps it, and the calls are parsed (a tiny pair whose tokenizer has it)."""
    draft, target = make_tiny_pair(tmp_path / "pair", "qwen2", special_tokens=("[TOOL_CALLS]",))
    quiet = lambda _: None  # noqa: E731
    bundle = build_bundle(str(draft), str(target), tmp_path / "b", max_context=512, log=quiet)
    folder = Bundle.load(bundle).role("target").folder
    marker = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("[TOOL_CALLS]")
    path = tmp_path / "mistral.jinja"
    path.write_text(TEMPLATES["mistral"])
    settings = ServeSettings(bundle=bundle, model_name="tiny", calibrate=False, chat_template=path)
    options = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 90}
    with serving(settings) as (base, app):
        wait_healthy(base)
        reply = _chat(client(base), parallel_tool_calls=False, logprobs=True, **options)
    message = reply.choices[0].message
    assert reply.choices[0].logprobs.content[0].token == "[TOOL_CALLS]"  # one token: the marker
    assert reply.choices[0].finish_reason == "tool_calls", message
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    tokenizer = app.state.service.runtime.tokenizer
    ids = tokenizer.encode("[TOOL_CALLS][", add_special_tokens=False)
    assert ids[0] == marker and tokenizer.decode(ids) == "[TOOL_CALLS]["  # kept
    assert TextTokenizer(folder, None).decode(ids) == "["  # the control: dropped without keep


# A complete set of calls in each format, after which the turn may end.
CALLS = {
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
    "phi4_mini_json": 'functools[{"name": "get_time", "arguments": {"zone": "UTC"}}]',
    "pythonic": '[get_time(zone="UTC")]',
    "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
}


@pytest.mark.parametrize("name", list(CALLS))
def test_whitespace_after_a_call_never_promises_another(roomy, name):
    """`required` with parallel calls: after a complete call, whatever whitespace the grammar
    admits, the end of the turn stays admitted. The control: Hermes' grammar before this
    admitted a newline after a call and then only another call (`start: call ("\\n" call)*`)."""
    target = Bundle.load(roomy).role("target")
    eos = Bundle.load(roomy).eos_token_ids
    grammars = Grammars(target.folder / "tokenizer.json", target.dim("vocab_size"), eos)
    vocabulary = Tokenizer.from_file(str(target.folder / "tokenizer.json"))
    form = FORMATS[name]
    structure = Tools([WEATHER, ZONE], "required", True).structure(grammars, form)
    old = structure.value.replace('start: call ("\\n" call)* "\\n"?', 'start: call ("\\n" call)*')
    for lark, ends in ((structure.value, True), (old, name != "hermes")):
        grammar = grammars.compile(Structure("lark", lark))
        calls = vocabulary.encode(CALLS[name], add_special_tokens=False).ids
        assert grammar.accepts(calls) == len(calls), name
        for token in calls:
            grammar.consume(token)
        assert grammar.allowed(len(calls))[eos].all(), name
        for space in ("\n", " ", "\n\n", " \n"):
            walk = grammar.copy()
            tokens = vocabulary.encode(space, add_special_tokens=False).ids
            if walk.accepts(tokens) < len(tokens):
                continue  # not admitted here: the turn can only end or go on with a call
            for token in tokens:
                walk.consume(token)
            assert walk.allowed(len(calls) + len(tokens))[eos].all() == ends, (name, space)


@pytest.fixture(scope="module", params=["hermes", *TEMPLATES])
def any_format(request, roomy, tmp_path_factory):
    with _serving_format(request.param, roomy, tmp_path_factory) as served:
        yield served


def test_required_with_several_tools_ends_in_tool_calls(any_format, roomy):
    """`required`, parallel calls on, from a model that writes a newline after a call where
    it may and would rather end the turn than call again (a tiny model told so by logit_bias:
    newline +30, end of turn +20, a comma -30, so a list closes). Every format ends with
    tool_calls well before max_tokens; Hermes' grammar before this change forced a call after
    each newline, until max_tokens (test_whitespace_after_a_call_never_promises_another)."""
    api, form = any_format
    folder = Bundle.load(roomy).role("target").folder
    vocabulary = Tokenizer.from_file(str(folder / "tokenizer.json"))
    first = {t: vocabulary.encode(t, add_special_tokens=False).ids[0] for t in ("\n", ",")}
    bias = {first["\n"]: 30, vocabulary.token_to_id("<|im_end|>"): 20, first[","]: -30}
    options = {"tools": [WEATHER, ZONE], "tool_choice": "required", "max_tokens": 200}
    replies = [
        _chat(api, off=off, logit_bias={str(t): b for t, b in bias.items()}, **options)
        for off in (False, True)
    ]
    for reply in replies:
        assert reply.choices[0].finish_reason == "tool_calls", (form.name, reply.choices[0])
        assert reply.usage.completion_tokens < 100
        assert reply.choices[0].message.tool_calls
    assert [c.function.arguments for c in replies[0].choices[0].message.tool_calls] == [
        c.function.arguments for c in replies[1].choices[0].message.tool_calls
    ]
