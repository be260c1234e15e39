"""What services send, through the real server and the official `openai` client: structured
output (`parse` with a Pydantic model, json_object, vLLM's structured_outputs), tool calls
(required, named, streamed, and the second turn), logprobs and penalties; each the same with
speculation on and off, at concurrency 1 and 8, and bad input refused by name."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field
from servers import client, http, serving, wait_healthy

from specrt.bundle import Bundle
from specrt.exporter.build import build_bundle
from specrt.runtime.grammar import Grammars
from specrt.serve import ServeSettings
from specrt.serve.tool_formats import HERMES, CallStream
from specrt.serve.tools import Tools

CONTEXT = 1024
GREEDY = {"temperature": 0}
OFF = {"speculation": "off"}
ASK = [{"role": "user", "content": "Extract the contact: Ada Lovelace, 36, a friend."}]


class Contact(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    kind: Literal["friend", "work"]
    verified: bool


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def server(pairs, tmp_path_factory):
    draft, target = pairs["qwen2"]
    out = tmp_path_factory.mktemp("structured") / "tiny"
    bundle = build_bundle(str(draft), str(target), out, max_context=CONTEXT, log=lambda _: None)
    settings = ServeSettings(bundle=Path(bundle), model_name="tiny", max_batch=8, timeout=120)
    with serving(settings) as (base, _):
        assert wait_healthy(base)["status"] == "ok"
        yield base


def chat(base: str, off: bool = False, **options):
    extra = {**options.pop("extra_body", {}), **(OFF if off else {})}
    return client(base, timeout=60).chat.completions.create(
        model="tiny", messages=options.pop("messages", ASK), extra_body=extra, **options
    )


def test_parse_with_a_pydantic_model(server):
    """`parse` sends the model's strict JSON schema: the answer validates into the model, and
    is the constrained target's own (speculation off gives the same text)."""
    api = client(server, timeout=60)
    options = {"model": "tiny", "messages": ASK, "response_format": Contact, "max_tokens": 120}
    parsed = api.chat.completions.parse(**options, **GREEDY)
    alone = api.chat.completions.parse(**options, **GREEDY, extra_body=OFF)
    message = parsed.choices[0].message
    assert isinstance(message.parsed, Contact), message.content
    assert message.content == alone.choices[0].message.content
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.speculation["drafted"] > 0


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "(yes|no), [0-9]{2,4}"}},
        {"structured_outputs": {"choice": ["red", "green", "blue"]}},
        {"structured_outputs": {"grammar": 'root ::= "x = " [0-9] [0-9]? ";"'}},  # GBNF
        {"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}}}},
    ],
)
def test_every_form_of_structure_is_exact(server, extra):
    spec = chat(server, max_tokens=60, extra_body=dict(extra), **GREEDY)
    alone = chat(server, off=True, max_tokens=60, extra_body=dict(extra), **GREEDY)
    text = spec.choices[0].message.content
    assert text == alone.choices[0].message.content
    if spec.choices[0].finish_reason == "stop" and "json" in json.dumps(extra):
        json.loads(text)


def test_a_structure_that_cannot_finish_ends_with_length(server):
    reply = chat(server, max_tokens=3, response_format={"type": "json_object"}, **GREEDY)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    assert chat(server, max_tokens=3).usage.completion_tokens >= 1  # the next is served


def _streamed_calls(server: str, **options) -> tuple[list[dict], str | None]:
    """Tool calls rebuilt from a stream's deltas, as the client's accumulators do."""
    calls: dict[int, dict] = {}
    finish = None
    stream = client(server, timeout=60).chat.completions.create(
        model="tiny", messages=ASK, stream=True, **options
    )
    for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        if choice is None:
            continue
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish


def test_a_required_tool_call_round_trip(server):
    """tool_choice=required: the grammar admits only calls of the given tools, with arguments
    of their schemas; streamed and not, the same calls; the result goes back in a second turn."""
    options = {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 120}
    reply = chat(server, **options, **GREEDY)
    alone = chat(server, off=True, **options, **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and [c.function.arguments for c in calls] == [
        c.function.arguments for c in alone.choices[0].message.tool_calls
    ]
    for call in calls:
        assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == (
            {"city", "unit"} if call.function.name == "get_weather" else {"zone"}
        )
    streamed, finish = _streamed_calls(server, **options, **GREEDY)
    assert finish == "tool_calls"
    assert streamed == [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": "18 degrees"} for c in calls],
    ]
    second = chat(server, messages=turn, tools=[WEATHER, TIME], max_tokens=20, **GREEDY)
    assert second.usage.prompt_tokens > reply.usage.prompt_tokens
    assert second.choices[0].message.content is not None


def test_a_named_tool_is_the_one_called(server):
    """A named choice yields exactly one call of that function (the grammar ends the turn after
    it, as OpenAI's named choice does); parallel_tool_calls off, one call at most."""
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = chat(server, tools=[WEATHER, TIME], tool_choice=named, max_tokens=80, **GREEDY)
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"]
    assert reply.choices[0].finish_reason == "tool_calls"
    single = chat(
        server,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        **GREEDY,
    )
    assert len(single.choices[0].message.tool_calls) == 1


def test_only_required_calls_in_parallel_may_repeat(bundles):
    """The control for the test above: the grammar's start rule admits further calls only for
    `required` with parallel calls on; a named choice and parallel_tool_calls off admit one."""
    target = Bundle.load(bundles["qwen2"]).role("target")
    eos = Bundle.load(bundles["qwen2"]).eos_token_ids
    grammars = Grammars(target.folder / "tokenizer.json", target.dim("vocab_size"), eos)
    several = 'start: call ("\\n" call)*'
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel, repeats in [
        ("required", True, True),
        ("required", False, False),
        (named, True, False),
    ]:
        lark = Tools([WEATHER, TIME], choice, parallel).structure(grammars, HERMES).value
        assert lark.startswith(several) == repeats, (choice, parallel)


def test_tool_calls_are_parsed_from_text():
    """The pure parts: a call among prose, a tag in prose that is no call, a streamed call cut
    anywhere."""
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = HERMES.parse(text + "\n<tool_call>not json</tool_call>")
    assert content.startswith("Sure.") and "not json" in content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    for cut in range(1, len(text)):
        stream = CallStream(HERMES)
        first, early = stream.feed(text[:cut])
        rest, late = stream.feed(text[cut:], final=True)
        assert first + rest == "Sure.\n" and [c.name for c in early + late] == ["f"]


def test_logprobs_are_the_same_with_speculation_on_and_off(server):
    options = {"max_tokens": 30, "logprobs": True, "top_logprobs": 3, "response_format": Contact}
    options["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "contact", "schema": Contact.model_json_schema()},
    }
    spec = chat(server, **options, **GREEDY).choices[0].logprobs.content
    alone = chat(server, off=True, **options, **GREEDY).choices[0].logprobs.content
    assert [e.token for e in spec] == [e.token for e in alone] and len(spec) == 30
    for a, b in zip(spec, alone, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert a.top_logprobs[0].token == a.token  # greedy
    stream = client(server, timeout=60).chat.completions.create(
        model="tiny", messages=ASK, stream=True, **options, **GREEDY
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in spec]
    completion = client(server, timeout=60).completions.create(
        model="tiny", prompt="The", max_tokens=8, logprobs=2, **GREEDY
    )
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 8 and all(isinstance(t, str) for t in logprobs.tokens)
    assert len(logprobs.token_logprobs) == 8 and all(len(t) <= 2 for t in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_penalties_and_bias_are_the_same_with_speculation_on_and_off(server):
    options = {"max_tokens": 30, "presence_penalty": 1.0, "frequency_penalty": 0.5}
    options["logit_bias"] = {"17": 4.0, "23": -50}
    spec = chat(server, **options, **GREEDY)
    assert (
        spec.choices[0].message.content
        == chat(server, off=True, **options, **GREEDY).choices[0].message.content
    )


def test_eight_constrained_clients_get_the_constrained_target_alones_outputs(server):
    """At concurrency 8 (every slot), each constrained output equals the same request alone."""
    variants = [
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"structured_outputs": {"regex": "(yes|no), [0-9]{2,4}"}}},
        {"tools": [WEATHER, TIME], "tool_choice": "required"},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": Contact.model_json_schema()},
            }
        },
    ]
    requests = [
        {**variants[i % 4], "messages": [{"role": "user", "content": f"Request {i}: a record."}]}
        for i in range(8)
    ]

    def run(request: dict, off: bool) -> str:
        reply = chat(server, off=off, max_tokens=60, **json.loads(json.dumps(request)), **GREEDY)
        message = reply.choices[0].message
        return message.content or json.dumps([c.function.model_dump() for c in message.tool_calls])

    alone = [run(r, True) for r in requests]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda r: run(r, False), requests, timeout=300))
    assert together == alone


BAD = [  # (body, param, words)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "#/properties/a"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "invalid regex"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"tools": [{}]}, "tools[0]", '"type": "function"'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integr"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters", "#/properties/x"),
]  # fmt: skip


@pytest.mark.parametrize("body, param, words", BAD)
def test_bad_structured_requests_get_a_400_naming_the_field(server, body, param, words):
    payload = {"model": "tiny", "messages": ASK, **body}
    status, reply = http(f"{server}/v1/chat/completions", json.dumps(payload).encode())
    assert status == 400, reply
    assert reply["error"]["param"] == param and words in reply["error"]["message"], reply
