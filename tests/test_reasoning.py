"""Reasoning output: a <think>...</think> thought returned as reasoning_content apart from the
answer, streamed and not, through the real server and the official client; thinking switched off
by chat_template_kwargs; identical with speculation on and off; and the split itself, cut
anywhere."""

from __future__ import annotations

import pytest
from servers import client, serving, wait_healthy

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.runtime import Structure
from specrt.runtime.grammar import Grammars
from specrt.runtime.text import TextTokenizer
from specrt.serve import ServeSettings
from specrt.serve.reasoning import (
    ThoughtStream,
    after_thought,
    closes_thought,
    opens_thought,
    split,
)

# A Qwen3-like template: the generation prompt opens the thought (R1-style), or, with
# enable_thinking false, writes an empty one so the answer comes at once (Qwen3's switch).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Think, then answer."}]
GREEDY = {"temperature": 0, "max_tokens": 24}


@pytest.mark.parametrize(
    "text, inside, want",
    [
        ("<think>\nplan\n</think>\n\nthe answer", False, ("\nplan\n", "the answer")),
        ("plan</think>  answer <think>x</think>", True, ("plan", "answer <think>x</think>")),
        ("no thought at all", False, (None, "no thought at all")),
        ("a thought cut short", True, ("a thought cut short", "")),
        ("<think>opened, never closed", False, ("opened, never closed", "")),
    ],
)
def test_a_thought_splits_the_same_whole_and_streamed_cut_anywhere(text, inside, want):
    assert split(text, inside) == want
    for cut in range(1, len(text)):
        stream = ThoughtStream(inside)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:], final=True)]
        assert "".join(r for r, _ in parts) == (want[0] or "")
        assert "".join(a for _, a in parts) == want[1], cut


def test_a_prompt_that_ends_in_an_open_or_a_closed_thought():
    assert opens_thought("<|im_start|>assistant\n<think>\n")
    assert not opens_thought("<think>\n\n</think>\n\n")
    assert not opens_thought("<|im_start|>assistant\n")
    assert closes_thought("<think>\n\n</think>\n\n")
    assert not closes_thought("<|im_start|>assistant\n<think>\n")
    assert not closes_thought("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def servers(bundles, tmp_path_factory):
    """The tiny qwen2 bundle with the thinking template, parsed and not."""
    template = tmp_path_factory.mktemp("think") / "think.jinja"
    template.write_text(TEMPLATE)
    common = {"bundle": bundles["qwen2"], "model_name": "tiny", "calibrate": False}
    parsed = ServeSettings(**common, chat_template=template)
    raw = ServeSettings(**common, chat_template=template, reasoning_parser="none")
    with serving(parsed) as (one, _), serving(raw) as (two, _):
        wait_healthy(one)
        wait_healthy(two)
        yield client(one), client(two)


def _chat(api, **options):
    return api.chat.completions.create(model="tiny", messages=ASK, **GREEDY, **options)


def test_the_thought_is_reasoning_content_apart_from_the_answer(servers):
    """The thought and the answer together are the text the model wrote (less the tags and
    the space between them); the same with speculation off, and streamed as deltas."""
    parsed, raw = servers
    text = _chat(raw).choices[0].message.content  # what the model wrote, unparsed
    message = _chat(parsed).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning
    assert "".join((reasoning + (message.content or "")).split()) == "".join(text.split())
    off = _chat(parsed, extra_body={"speculation": "off"}).choices[0].message
    assert off.model_extra["reasoning_content"] == reasoning and off.content == message.content
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in _chat(parsed, stream=True):
        delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        for field in pieces:
            pieces[field] += delta.get(field) or ""
    assert pieces == {"reasoning_content": reasoning, "content": message.content or ""}


def test_thinking_switched_off_by_the_template_kwargs(servers):
    parsed, _ = servers
    thinking = _chat(parsed)
    answer = _chat(parsed, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = answer.choices[0].message
    assert message.model_extra["reasoning_content"] is None and message.content
    assert answer.usage.prompt_tokens > thinking.usage.prompt_tokens  # the empty thought


def test_a_bad_reasoning_parser_is_refused(bundles):
    with pytest.raises(SpecrtError, match="--reasoning-parser must be one of auto, think, none"):
        ServeSettings(bundle=bundles["qwen2"], reasoning_parser="deepseek").check()


def test_a_json_answer_is_constrained_after_a_free_thought(bundles):
    """The grammar of a JSON answer after a thought: any text up to the first </think> (the
    model opens it where the prompt did not), then only the schema; the control: the same
    answer with no closed thought, or a wrong answer after it, is refused."""
    target = Bundle.load(bundles["qwen2"]).role("target")
    grammars = Grammars(target.folder / "tokenizer.json", target.dim("vocab_size"), [0])
    tokenizer = TextTokenizer(target.folder, None)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    structure = Structure("json_schema", schema)

    def accepted(text: str, inside: bool) -> bool:
        grammar = grammars.compile(after_thought(structure, inside, grammars.literal))
        ids = tokenizer.encode(text, add_special_tokens=False)
        return grammar.accepts(ids) == len(ids)

    assert accepted('First {"b": 2}, then\nmore.</think>\n\n{"a": 1}', inside=True)
    assert accepted('<think>plan</think>{"a": 1}', inside=False)
    assert not accepted('<think>plan</think>{"b": 1}', inside=False)  # the answer is checked
    assert not accepted('{"a": 1}', inside=False)  # no thought: the model must open one
    assert not accepted('plan</think>{"a": 1}</think>{"a": 1}', inside=True)  # the first ends it


def test_a_structured_request_thinks_first_the_same_with_speculation_off(servers):
    """Served: the JSON grammar starts after the thought, so the output begins as reasoning
    (the tiny model's thought may not end within max_tokens), identical with speculation
    off."""
    parsed, _ = servers
    options = {"response_format": {"type": "json_object"}}
    message = _chat(parsed, **options).choices[0].message
    off = _chat(parsed, extra_body={"speculation": "off"}, **options).choices[0].message
    assert message.model_extra["reasoning_content"]
    assert off.model_extra["reasoning_content"] == message.model_extra["reasoning_content"]
    assert off.content == message.content


def test_with_thinking_off_a_structured_answer_comes_at_once(servers):
    """The prompt closed the thought (enable_thinking false): the JSON grammar starts at the
    first token, and the answer is the content."""
    parsed, _ = servers
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = parsed.chat.completions.create(
        model="tiny",
        messages=ASK,
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_object"},
        extra_body=off,
    )
    message = reply.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert message.content.lstrip().startswith("{")
