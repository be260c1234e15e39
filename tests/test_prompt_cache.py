"""Prompt reuse: a prompt starts from what a slot already holds of it, and no output changes.

The references are runtimes with the cache off (every prompt computed whole); the controls
show that the comparisons would catch a slot reused with the wrong keys and values."""

from __future__ import annotations

import numpy as np
import pytest
from servers import client, metric_values, serving, wait_healthy

from specrt.runtime import Scheduler, SpeculativeRuntime
from specrt.runtime.prompt_cache import PromptCache, choose_slot, shared_length, take_slot
from specrt.serve import ServeSettings

CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
FOLLOW_UP = {"role": "user", "content": "Now make it subtract them."}


@pytest.fixture(scope="module")
def cold(bundles) -> SpeculativeRuntime:
    return SpeculativeRuntime.load(bundles["llama"], calibrate=False, prompt_cache=False)


@pytest.fixture(scope="module")
def warm(bundles) -> SpeculativeRuntime:
    return SpeculativeRuntime.load(bundles["llama"], calibrate=False, slots=3)


def conversation(rt: SpeculativeRuntime, **options) -> list:
    """Two turns, the second resending the first with its answer: what a chat client does."""
    first = rt.generate(CHAT, max_new_tokens=12, **options)
    answered = [*CHAT, {"role": "assistant", "content": first.text}, FOLLOW_UP]
    return [first, rt.generate(answered, max_new_tokens=12, **options)]


def test_shared_length():
    assert shared_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_length([1, 2], [1, 2, 3]) == 2
    assert shared_length([], [1]) == 0


def test_a_slot_takes_the_longest_prefix_any_slot_holds(warm):
    """In place where its own slot holds the most, copied where another does, never the
    prompt's last token (its logits are needed), and nothing with reuse off."""
    target = warm.target
    for slot in range(3):
        target.reset(slot)
    target.forward_rows([(0, [5, 6, 7, 8, 9]), (1, [5, 6, 10])])
    assert take_slot(target, 2, [5, 6, 7, 8, 11], PromptCache()) == 4  # copied from slot 0
    assert list(target.held(2)) == [5, 6, 7, 8] and target.lengths[2] == 4
    assert take_slot(target, 1, [5, 6, 10, 12], PromptCache()) == 3  # its own, in place
    assert take_slot(target, 1, [5, 6, 7, 8, 9], PromptCache()) == 4  # all but the last token
    assert take_slot(target, 0, [5, 6, 7], None) == 0 and target.lengths[0] == 0


def test_copied_rows_score_as_a_whole_prefill(warm):
    """The target's logits after a copied prefix equal, bit for bit, those of the prompt
    computed whole (in a slot then overwritten, so only the copy can supply the rows)."""
    prompt = [3, 9, 4, 17, 25, 8, 11, 40, 2, 19]
    target = warm.target
    for slot in range(3):
        target.reset(slot)
    whole = target.forward_rows([(2, prompt)], last=3)[0]
    target.forward_rows([(0, prompt[:7] + [50, 51]), (1, [60] * 10)])
    for slot in (1, 2):
        target.reset(slot)
    target.forward_rows([(2, [61] * 10)])
    assert take_slot(target, 1, prompt, PromptCache()) == 7
    assert target.lengths[1] == 7
    rest = target.forward_rows([(1, prompt[7:])], last=3)[0]
    np.testing.assert_array_equal(rest, whole)


def test_a_conversation_equals_the_cold_runtime(cold, warm):
    """The second turn reuses the first turn's prompt (and its answer, as far as the text
    encodes to the tokens generated), greedy and seeded sampling alike (at a fixed K: a
    sampled request's random draws follow its K, which adaptive takes from the clock), and
    every token is the cold runtime's."""
    for options in ({}, {"temperature": 0.8, "seed": 3, "controller": "fixed:2"}):
        want = conversation(cold, **options)
        got = conversation(warm, **options)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        assert want[1].stats.cached_tokens == 0
        assert got[1].stats.cached_tokens >= got[0].stats.prompt_tokens


def test_a_continuation_reuses_the_prompt_and_the_answer(cold, warm):
    """Resent as token ids, the second prompt reuses all the first computed: its prompt and
    every generated token but the last (which no call fed)."""
    prompt = warm.encode("def fibonacci(n):")
    first = warm.generate(prompt, max_new_tokens=20, ignore_eos=True)
    follow = [*prompt, *first.token_ids, *warm.encode(" # and now")]
    got = warm.generate(follow, max_new_tokens=20, ignore_eos=True)
    assert got.stats.cached_tokens == len(prompt) + len(first.token_ids) - 1
    assert got.token_ids == cold.generate(follow, max_new_tokens=20, ignore_eos=True).token_ids


def test_control_reused_rows_of_another_sequence_change_the_output(cold, bundles):
    """Control: a slot that claims to hold the prompt but holds another sequence's keys and
    values gives other tokens, so the comparisons above would catch a wrong copy."""
    rt = SpeculativeRuntime.load(bundles["llama"], calibrate=False)
    prompt = rt.encode(CHAT)
    want = cold.generate(CHAT, max_new_tokens=24, speculate=False)
    other = [(t + 1) % rt.target.vocab_size for t in prompt[:-1]]
    rt.target.reset(0)
    rt.target.forward(other)
    rt.target._tokens[0][: len(other)] = prompt[:-1]  # the bookkeeping lies about the rows
    got = rt.generate(CHAT, max_new_tokens=24, speculate=False)
    assert got.stats.cached_tokens == len(prompt) - 1
    assert got.token_ids != want.token_ids


def test_choices_of_one_prompt_share_its_prefill(cold, warm):
    """Requests of one prompt admitted together: the first computes it, the others copy all
    of it but its last token, and each output is the cold runtime's (greedy: a sampled
    request's random draws follow its batch's choices of K)."""
    want = [cold.generate(CHAT, max_new_tokens=16 + s) for s in range(3)]
    for slot in range(3):
        warm.target.reset(slot)
    scheduler = Scheduler(warm.target, warm.costs, slots=3)
    runs = [warm.sequence(CHAT, max_new_tokens=16 + s) for s in range(3)]
    for generation in runs:
        scheduler.add(generation)
    while any(g.result is None for g in runs):
        scheduler.step()
    assert [g.result.token_ids for g in runs] == [w.token_ids for w in want]
    prompt = runs[0].result.stats.prompt_tokens
    assert [g.result.stats.cached_tokens for g in runs] == [0, prompt - 1, prompt - 1]


def test_the_server_reports_cached_tokens(bundles, cold):
    """OpenAI's usage.prompt_tokens_details.cached_tokens, and the metrics' counter; with
    --no-prompt-cache every prompt is computed whole."""
    want = conversation(cold)
    answered = [*CHAT, {"role": "assistant", "content": want[0].text}, FOLLOW_UP]
    for cache in (True, False):
        settings = ServeSettings(
            bundle=bundles["llama"], model_name="tiny", calibrate=False, prompt_cache=cache
        )
        with serving(settings) as (base, _):
            assert wait_healthy(base)["status"] == "ok"
            api = client(base)
            replies = [
                api.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=12, temperature=0
                )
                for messages in (CHAT, answered)
            ]
            counted = metric_values(base).get(("specrt:prompt_tokens_cached_total", ()))
        assert [r.choices[0].message.content for r in replies] == [w.text for w in want]
        cached = replies[1].usage.prompt_tokens_details.cached_tokens
        assert (cached >= want[0].stats.prompt_tokens) if cache else cached == 0
        assert counted == replies[0].usage.prompt_tokens_details.cached_tokens + cached


def test_a_request_takes_its_own_slot_else_the_oldest(warm):
    """Its conversation's slot where it keeps more than it loses; else the slot released
    longest ago; never a slot that widens the rounds' span."""
    target = warm.target
    for slot in range(3):
        target.reset(slot)
    conversation_a = list(range(10, 40))
    target.forward_rows([(0, conversation_a), (1, [10, 11, 99, 98])])
    follow_up = [*conversation_a, 7, 8]
    other = [10, 11, 12, 50, 51]  # shares 3 tokens with slot 0, 2 with slot 1
    released = {0: 2, 1: 1}  # slot 2 never released: the oldest
    assert choose_slot(target, follow_up, [0, 1, 2], [], released) == 0
    assert choose_slot(target, other, [0, 1, 2], [], released) == 2
    assert choose_slot(target, other, [0, 1], [], released) == 1
    assert choose_slot(target, other, [1, 2], [0], {}) == 1  # slot 2 would leave a gap


def test_alternating_conversations_keep_their_slots(cold, bundles):
    """Two users taking turns through one scheduler: each second turn finds its first turn
    in the slot it left (the other user took another slot), and every output is the cold
    runtime's."""
    rt = SpeculativeRuntime.load(bundles["llama"], calibrate=False, slots=2)
    scheduler = Scheduler(rt.target, rt.costs, slots=2)

    def turn(prompt):
        generation = rt.sequence(prompt, max_new_tokens=10, ignore_eos=True)
        scheduler.add(generation)
        while generation.result is None:
            scheduler.step()
        return generation

    first = [turn(rt.encode(p)) for p in ("def fibonacci(n):", "The quick brown fox")]
    seconds = []
    for generation in first:
        prompt = generation.prompt
        seconds.append(turn([*prompt, *generation.result.token_ids, *rt.encode(" and")]))
    for earlier, later in zip(first, seconds, strict=True):
        assert later.slot == earlier.slot
        assert later.result.stats.cached_tokens == len(earlier.tokens) - 1
        want = cold.generate(later.prompt, max_new_tokens=10, ignore_eos=True)
        assert later.result.token_ids == want.token_ids
