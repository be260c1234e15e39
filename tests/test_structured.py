"""Structured output under speculation, exact: grammars, forced tokens, penalties and logprobs.

A constrained request's output is the constrained target's alone, token for token, whoever
drafts (the draft model within the grammar, a lookup cut where the grammar refuses it, the
grammar's forced tokens) and whatever shares its rounds; it matches its structure; its
log-probabilities are the target's own. The sampled case is the chi-square test in
test_lossless_sampling.py.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from batch_runs import alone_and_together

from specrt.errors import SpecrtError
from specrt.runtime import SpeculativeRuntime, Structure

CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["friend", "work"]}, "maxItems": 2},
        "verified": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "verified"],
    "additionalProperties": False,
}
STRUCTURES = {
    "schema": Structure("json_schema", CONTACT),
    "regex": Structure("regex", r"(yes|no): [a-z ]{3,12}\."),
    "lark": Structure("lark", 'start: "x = " NUM ";"\nNUM: /[0-9]{1,4}/'),
    "choice": Structure("choice", ["red", "green", "blue"]),
}
SPECULATION = [  # (label, options): every drafter and K policy, forced tokens on and off
    ("fixed:3", {"controller": "fixed:3"}),
    ("adaptive", {}),
    ("ngram", {"drafter": "ngram", "controller": "fixed:4"}),
    ("hybrid", {"drafter": "hybrid"}),
    ("no jump-forward", {"controller": "fixed:3", "jump_forward": False}),
]
PROMPT = "The contact record, as JSON:"


@pytest.fixture(scope="module")
def runtime(bundles):
    return SpeculativeRuntime.load(bundles["qwen2"], slots=4, calibrate=False)


def matches(structure: Structure, text: str) -> bool:
    if structure.kind == "json_schema":
        jsonschema.validate(json.loads(text), structure.value)
        return True
    if structure.kind == "regex":
        return re.fullmatch(structure.value, text) is not None
    if structure.kind == "lark":
        return re.fullmatch(r"x = [0-9]{1,4};", text) is not None
    return text in structure.value


@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_constrained_greedy_equals_the_constrained_target_alone(runtime, kind):
    structure = STRUCTURES[kind]
    alone = runtime.generate(PROMPT, max_new_tokens=80, structure=structure, speculate=False)
    assert alone.finish_reason == "eos" and matches(structure, alone.text), alone.text
    drafted = 0
    for label, options in SPECULATION:
        spec = runtime.generate(PROMPT, max_new_tokens=80, structure=structure, **options)
        assert spec.token_ids == alone.token_ids, label
        drafted += spec.stats.drafted
    assert drafted > 0


def test_forced_tokens_are_drafted_for_free_and_change_nothing(runtime):
    """A JSON schema forces its keys, quotes and separators: proposed without the draft model,
    they save target calls, and the output is the same."""
    structure = STRUCTURES["schema"]
    options = {"structure": structure, "max_new_tokens": 80, "drafter": "ngram"}
    forced = runtime.generate(PROMPT, controller="fixed:8", **options)
    plain = runtime.generate(PROMPT, controller="fixed:8", jump_forward=False, **options)
    assert forced.token_ids == plain.token_ids
    assert "forced" in forced.stats.sources and "forced" not in plain.stats.sources
    assert forced.stats.target_calls < plain.stats.target_calls


def test_unconstrained_tokens_a_grammar_refuses_are_rejections_not_errors(runtime):
    """An n-gram draft copied from the prompt that the grammar forbids is cut, never raised."""
    prompt = "yes: abc. no: abc. yes: abc. " * 3
    structure = STRUCTURES["regex"]
    alone = runtime.generate(prompt, max_new_tokens=30, structure=structure, speculate=False)
    spec = runtime.generate(
        prompt, max_new_tokens=30, structure=structure, drafter="ngram", controller="fixed:6"
    )
    assert spec.token_ids == alone.token_ids


BATCH = [  # constrained, penalised and plain requests sharing rounds
    (PROMPT, {"structure": STRUCTURES["schema"], "max_new_tokens": 70}),
    ("a b c a b c a b", {"max_new_tokens": 30, "drafter": "ngram", "ignore_eos": True}),
    (PROMPT, {"structure": STRUCTURES["regex"], "max_new_tokens": 30, "drafter": "hybrid"}),
    ("def f(x):", {"max_new_tokens": 30, "presence_penalty": 1.2, "logit_bias": {7: 3.0}}),
    (PROMPT, {"structure": STRUCTURES["lark"], "max_new_tokens": 20, "controller": "fixed:2"}),
    ("The quick", {"max_new_tokens": 25, "frequency_penalty": 0.7, "ignore_eos": True}),
]


def test_every_constrained_request_in_a_batch_gives_its_output_alone(runtime):
    alone, together, sizes = alone_and_together(runtime, BATCH, slots=4)
    assert together == alone
    assert max(sizes) >= 3


def test_penalties_and_bias_are_exact_under_speculation(runtime):
    options = {"max_new_tokens": 40, "ignore_eos": True, "logit_bias": {11: 2.5, 40: -4.0}}
    for penalties in ({"presence_penalty": 1.5}, {"frequency_penalty": 0.8}):
        alone = runtime.generate("the the the", speculate=False, **options, **penalties)
        spec = runtime.generate("the the the", controller="fixed:3", **options, **penalties)
        assert spec.token_ids == alone.token_ids
        unpenalised = runtime.generate("the the the", speculate=False, **options)
        assert alone.token_ids != unpenalised.token_ids  # the penalty really acted
    forced = runtime.generate("x", max_new_tokens=6, ignore_eos=True, logit_bias={9: 100.0})
    assert forced.token_ids == [9] * 6


def test_logprobs_are_the_target_alones(runtime):
    """The same numbers with speculation on and off: each comes from the target's row at the
    token's position, whoever drafted it."""
    options = {"max_new_tokens": 40, "logprobs": 3, "structure": STRUCTURES["schema"]}
    alone = runtime.generate(PROMPT, speculate=False, **options)
    spec = runtime.generate(PROMPT, controller="fixed:4", **options)
    assert spec.token_ids == alone.token_ids and spec.stats.accepted > 0
    assert len(alone.logprobs) == len(alone.token_ids)
    for a, s, token in zip(alone.logprobs, spec.logprobs, alone.token_ids, strict=True):
        assert a.token == s.token == token
        assert a.logprob == pytest.approx(s.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in s.top]
        assert a.top[0][0] == token and a.logprob <= 0  # greedy: the best token is the one
        assert sum(np.exp(lp) for _, lp in a.top) <= 1 + 1e-6
    plain = runtime.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
    assert plain.logprobs is None  # not asked, not computed


def test_a_structure_that_cannot_finish_ends_at_the_budget(runtime):
    result = runtime.generate(PROMPT, max_new_tokens=4, structure=STRUCTURES["schema"])
    assert result.finish_reason == "length" and len(result.token_ids) == 4


BAD = [
    (
        {
            "structure": Structure(
                "json_schema",
                {"type": "object", "properties": {"a": {"properties": {"b": {"type": "strin"}}}}},
            )
        },
        "structure",
        "#/properties/a/properties/b",
    ),
    ({"structure": Structure("json_schema", {"not": {"type": "string"}})}, "structure", "not"),
    ({"structure": Structure("regex", "((")}, "structure", "invalid regex"),
    ({"structure": Structure("lark", "start: undefined_rule")}, "structure", "invalid lark"),
    ({"structure": Structure("choice", [])}, "structure", "non-empty"),
    ({"structure": Structure("yaml", "a: 1")}, "structure", "unknown structure"),
    ({"structure": Structure("json_object"), "ignore_eos": True}, "ignore_eos", "grammar"),
    ({"logit_bias": {10**9: 1.0}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {5: 101.0}}, "logit_bias", "-100, 100"),
    ({"presence_penalty": 2.5}, "presence_penalty", "-2, 2"),
    ({"logprobs": 21}, "top_logprobs", "0, 20"),
]


@pytest.mark.parametrize(("options", "param", "message"), BAD)
def test_bad_constraints_are_refused_by_name(runtime, options, param, message):
    with pytest.raises(SpecrtError, match=re.escape(message)) as caught:
        runtime.stream(PROMPT, **options)
    assert caught.value.param == param


def test_specrt_generate_takes_a_schema_a_grammar_or_a_regex(runtime, bundles, tmp_path):
    from click.testing import CliRunner

    from specrt.cli import cli

    schema = tmp_path / "contact.json"
    schema.write_text(json.dumps(CONTACT))
    grammar = tmp_path / "assign.lark"
    grammar.write_text(STRUCTURES["lark"].value)
    base = ["generate", str(bundles["qwen2"]), PROMPT, "--max-new-tokens", "80"]
    for option, structure in (
        (["--json-schema", str(schema)], STRUCTURES["schema"]),
        (["--grammar", str(grammar)], STRUCTURES["lark"]),
        (["--regex", STRUCTURES["regex"].value], STRUCTURES["regex"]),
    ):
        done = CliRunner().invoke(cli, [*base, *option])
        assert done.exit_code == 0, done.output
        want = runtime.generate(PROMPT, max_new_tokens=80, structure=structure)
        assert done.output.rstrip("\n") == want.text
    both = CliRunner().invoke(cli, [*base, "--regex", "a", "--grammar", str(grammar)])
    assert both.exit_code != 0 and "one of" in both.output
