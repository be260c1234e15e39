"""Prefixes beyond the slots: what a slot held is kept in host memory when the slot is taken
or released, a prompt restores the longest run of blocks it begins with, least recently used
blocks go first, and no output changes. The references are runtimes with the cache off; the
control shows a wrong block would be caught."""

from __future__ import annotations

import numpy as np
import pytest
from servers import client, serving, wait_healthy

from specrt.errors import SpecrtError
from specrt.runtime import KVBudget, Scheduler, SpeculativeRuntime
from specrt.runtime.prefix_store import PrefixStore
from specrt.runtime.prompt_cache import PromptCache
from specrt.serve import ServeSettings

TOKENS = np.random.default_rng(5).integers(3, 384, 200).tolist()
DOC = TOKENS[:40]  # a document the prompts share: five blocks of 8
PROMPTS = [DOC + TOKENS[50:58], TOKENS[100:140], DOC + TOKENS[60:66]]
NEW = 12


def store_runtime(bundles, slots: int = 1, capacity: int = 10**8) -> SpeculativeRuntime:
    """A runtime whose prompt cache keeps prefixes in blocks of 8 tokens (the tiny bundles
    hold 128 positions: the server's 64 would leave one block)."""
    rt = SpeculativeRuntime.load(bundles["llama"], calibrate=False, slots=slots)
    rt.prompt_cache = PromptCache(PrefixStore(capacity, block=8))
    return rt


@pytest.fixture(scope="module")
def cold(bundles) -> SpeculativeRuntime:
    return SpeculativeRuntime.load(bundles["llama"], calibrate=False, prompt_cache=False)


def test_a_prompt_comes_back_after_its_slot_was_taken(bundles, cold):
    """One slot: the second prompt takes it from the first, whose blocks stay in the store;
    the third starts from them (all whole blocks of what it shares with the first, from both
    models), and every output is the cold runtime's."""
    rt = store_runtime(bundles)
    want = [cold.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids for p in PROMPTS]
    got = [rt.generate(p, max_new_tokens=NEW, ignore_eos=True) for p in PROMPTS]
    assert [r.token_ids for r in got] == want
    assert [r.stats.cached_tokens for r in got] == [0, 0, len(DOC)]
    store = rt.prompt_cache.store
    assert 0 < store.bytes <= store.capacity
    owners = {key[0] for key in store._blocks}
    assert owners == {id(rt.target), id(rt.draft)}


def test_restored_rows_score_as_a_whole_prefill(bundles):
    """The target's logits after restored blocks equal, bit for bit, those of the prompt
    computed whole, in a slot that held something else before."""
    rt = store_runtime(bundles)
    target, cache = rt.target, rt.prompt_cache
    prompt = DOC + TOKENS[70:75]
    target.reset(0)
    whole = target.forward_rows([(0, prompt)], last=3)[0]
    cache.take(target, 0, TOKENS[150:160])  # saves the prompt's blocks, empties the slot
    target.forward_rows([(0, TOKENS[150:160])])
    assert cache.take(target, 0, prompt) == len(DOC)
    assert list(target.held(0)) == DOC
    rest = target.forward_rows([(0, prompt[len(DOC) :])], last=3)[0]
    np.testing.assert_array_equal(rest, whole)


def test_control_a_wrong_block_changes_the_output(bundles, cold):
    """Control: a stored block holding other keys and values than its tokens' gives other
    tokens, so the comparisons above would catch a wrong restore."""
    rt = store_runtime(bundles)
    want = cold.generate(PROMPTS[2], max_new_tokens=NEW, ignore_eos=True, speculate=False)
    rt.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True, speculate=False)
    rt.generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True, speculate=False)
    for block in rt.prompt_cache.store._blocks.values():
        block.data[:] = block.data[::-1].copy()  # the layers' keys and values swapped about
    got = rt.generate(PROMPTS[2], max_new_tokens=NEW, ignore_eos=True, speculate=False)
    assert got.stats.cached_tokens == len(DOC)
    assert got.token_ids != want.token_ids


def test_least_recently_used_blocks_go_first_and_a_prefix_outlives_its_continuations(bundles):
    rt = store_runtime(bundles)
    target = rt.target
    store = PrefixStore(0, block=8)
    target.reset(0)
    target.forward_rows([(0, TOKENS[:32])])  # four blocks
    block_bytes = target.read_positions(0, 0, 8).nbytes
    store.capacity = 3 * block_bytes
    store.save(target, 0)
    assert len(store) == 3 and store.bytes == 3 * block_bytes  # the last block went
    assert len(store.find(target, TOKENS[:32])) == 3  # the first three, a prefix
    target.reset(0)
    target.forward_rows([(0, TOKENS[100:116])])  # two blocks of another prompt
    store.save(target, 0)
    assert [len(store.find(target, t)) for t in (TOKENS[:32], TOKENS[100:116])] == [1, 2]
    store.capacity = block_bytes // 2
    target.reset(0)
    target.forward_rows([(0, TOKENS[:8])])
    store.save(target, 0)  # a block that could never fit is not kept
    assert store.bytes <= store.capacity


def test_a_slot_released_for_the_budget_goes_to_the_store(bundles, cold):
    """Under a KV budget, an idle slot released to seat another keeps its prefix in the
    store, and its conversation coming back starts from it."""
    rt = store_runtime(bundles, slots=2)
    budget = KVBudget(len(PROMPTS[1]) + NEW + 8, [rt.target, rt.draft])
    scheduler = Scheduler(rt.target, rt.costs, slots=2, budget=budget)
    runs = []
    for prompt in PROMPTS:
        sequence = rt.sequence(prompt, max_new_tokens=NEW, ignore_eos=True)
        scheduler.add(sequence)
        while scheduler.busy:
            scheduler.step()
        runs.append(sequence.result)
        if len(runs) == 2:  # the first's slot was released (the budget holds one), kept
            assert sorted(rt.target.lengths) == [0, len(PROMPTS[1]) + NEW - 1]
            assert len(rt.prompt_cache.store) >= 2 * len(PROMPTS[0]) // 8  # both models
    want = [cold.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids for p in PROMPTS]
    assert [r.token_ids for r in runs] == want
    assert runs[2].stats.cached_tokens == len(DOC)


def test_the_server_keeps_prefixes_within_its_size(bundles):
    """--prefix-cache sizes the store (a size or 0, refused otherwise), /v1/models says it."""
    with pytest.raises(SpecrtError, match="--prefix-cache takes a size"):
        ServeSettings(bundle=bundles["llama"], prefix_cache="1000").check()
    assert ServeSettings(bundle=bundles["llama"], prefix_cache="0").prefix_bytes() == 0
    assert ServeSettings(bundle=bundles["llama"], prefix_cache="2MiB").prefix_bytes() == 2**21
    off = ServeSettings(bundle=bundles["llama"], prompt_cache=False, prefix_cache="2MiB")
    assert off.prefix_bytes() == 0
    settings = ServeSettings(
        bundle=bundles["llama"], model_name="tiny", calibrate=False, prefix_cache="3MB"
    )
    with serving(settings) as (base, _):
        wait_healthy(base)
        card = client(base).models.retrieve("tiny")
        assert card.model_extra["prefix_cache_bytes"] == 3 * 10**6
