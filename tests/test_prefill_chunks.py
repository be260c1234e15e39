"""Chunked prefill: a long prompt joins a batch a chunk at a time, between the running
requests' rounds, and every output stays the one the request gives alone."""

from __future__ import annotations

import pytest

from specrt.errors import SpecrtError
from specrt.runtime import Scheduler, SpeculativeRuntime
from specrt.serve import ServeSettings

LONG = [(7 * i + 3) % 300 + 10 for i in range(61)]  # token ids: a 61-token prompt
SHORT = [12, 40, 7, 99]


@pytest.fixture(scope="module")
def runtime(bundles) -> SpeculativeRuntime:
    return SpeculativeRuntime.load(bundles["llama"], calibrate=False, slots=3, prompt_cache=False)


@pytest.mark.parametrize("chunk", [1, 5, 16, None])
def test_chunked_prompts_give_each_output_alone(runtime, chunk):
    """Two slots: the first two prompts go whole, the others join while the first (the
    longest answer) is running, so they are fed in chunks."""
    prompts = [SHORT, LONG[:20], LONG, LONG[::-1], [*SHORT, *LONG[:30]]]
    budgets = [40, 8, 8, 8, 8]
    pairs = list(zip(prompts, budgets, strict=True))
    alone = [runtime.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in pairs]
    scheduler = Scheduler(runtime.target, runtime.costs, slots=2, chunk=chunk)
    generations = [runtime.sequence(p, max_new_tokens=n, ignore_eos=True) for p, n in pairs]
    for generation in generations:
        scheduler.add(generation)
    while any(g.result is None for g in generations):
        scheduler.step()
    assert [g.result.token_ids for g in generations] == alone
    calls = [g.result.stats.target_calls for g in generations]
    assert all(c <= n for c, n in zip(calls, budgets, strict=True))  # a prefill counts once


def test_a_long_prompt_joins_a_chunk_at_a_time_between_rounds(runtime):
    """While the long prompt is fed in 8-token chunks, the running request gets a round after
    every chunk, so its tokens keep coming (one chunk's stall at most)."""
    scheduler = Scheduler(runtime.target, runtime.costs, slots=2, chunk=8)
    running = runtime.sequence(SHORT, max_new_tokens=40, ignore_eos=True, speculate=False)
    scheduler.add(running)
    scheduler.step()  # its prefill
    joining = runtime.sequence(LONG, max_new_tokens=4, ignore_eos=True, speculate=False)
    scheduler.add(joining)
    before, batches = running.stops.length, []
    while not joining.stops.length:
        batches.append(scheduler.step().batch)
    chunks = -(-len(LONG) // 8)
    assert batches == [1, 0] * chunks  # the prefill step went last, so a round comes first
    assert running.stops.length - before == chunks


def test_without_chunks_a_prompt_is_fed_whole_before_the_next_round(runtime):
    scheduler = Scheduler(runtime.target, runtime.costs, slots=2, chunk=None)
    running = runtime.sequence(SHORT, max_new_tokens=40, ignore_eos=True, speculate=False)
    scheduler.add(running)
    scheduler.step()
    joining = runtime.sequence(LONG, max_new_tokens=4, ignore_eos=True, speculate=False)
    scheduler.add(joining)
    assert scheduler.step().batch == 1  # the running request's turn: the last step fed
    assert scheduler.step().batch == 0 and joining.stops.length == 1


def test_with_nothing_running_prompts_are_fed_whole(runtime):
    """Chunks bound the stall of running requests: with none, every prompt goes at once."""
    scheduler = Scheduler(runtime.target, runtime.costs, slots=2, chunk=8)
    generations = [runtime.sequence(p, max_new_tokens=4) for p in (LONG, LONG[::-1])]
    for generation in generations:
        scheduler.add(generation)
    assert scheduler.step().batch == 0
    assert all(g.stops.length == 1 for g in generations)


def test_a_request_cancelled_mid_prompt_leaves_its_slot(runtime):
    scheduler = Scheduler(runtime.target, runtime.costs, slots=2, chunk=8)
    running = runtime.sequence(SHORT, max_new_tokens=40, ignore_eos=True)
    scheduler.add(running)
    scheduler.step()
    joining = runtime.sequence(LONG, max_new_tokens=4)
    scheduler.add(joining)
    scheduler.step()  # a round
    scheduler.step()  # the first chunk
    assert scheduler.active == 2 and joining.result is None
    assert runtime.target.lengths[joining.slot] == 8
    joining.cancel()
    scheduler.step()  # a round
    scheduler.step()
    assert joining.result.finish_reason == "cancelled" and not joining.result.token_ids
    assert scheduler.active == 1 and running.result is None


def test_a_bad_chunk_is_refused(runtime, bundles):
    with pytest.raises(ValueError, match="at least 1 token"):
        Scheduler(runtime.target, runtime.costs, chunk=0)
    with pytest.raises(SpecrtError, match="at least 1 token"):
        SpeculativeRuntime.load(bundles["llama"], calibrate=False, prefill_chunk=0)
    with pytest.raises(SpecrtError, match="--prefill-chunk"):
        ServeSettings(bundle=bundles["llama"], prefill_chunk=-1).check()
