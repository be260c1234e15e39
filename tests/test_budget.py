"""Memory that follows the work: a slot gives back the cache pages it no longer needs, and a KV
budget seats a sequence only where what it may need fits beside the others, releasing idle slots
to make room; a request that could never fit is refused, and nothing else changes an output."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from servers import client, serving, wait_healthy

from specrt import machine
from specrt.bundle import Bundle
from specrt.engines import load_engine
from specrt.errors import SpecrtError
from specrt.runtime import KVBudget, Scheduler, SpeculativeRuntime
from specrt.runtime.drafters import make_drafter
from specrt.serve import ServeSettings

TOKENS = np.random.default_rng(3).integers(3, 384, 100).tolist()
PROMPTS = [TOKENS[:12], TOKENS[20:31], TOKENS[40:54]]
NEW = 16


@pytest.fixture(scope="module")
def runtime(bundles) -> SpeculativeRuntime:
    return SpeculativeRuntime.load(bundles["llama"], calibrate=False, slots=3)


def _positions(engine, slot: int, start: int, end: int) -> list[np.ndarray]:
    """Every layer's keys and values of a slot at these positions."""
    return [host[slot, start:end] for _, _, host in engine._caches]


def test_a_released_slot_keeps_its_prefix_and_its_later_pages_read_as_zeros(bundles):
    engine = load_engine(Bundle.load(bundles["llama"]), "target", "onnxruntime", slots=2)
    engine.forward_rows([(1, TOKENS)], last=1)
    prefix = [a.copy() for a in _positions(engine, 1, 0, 10)]
    later = _positions(engine, 1, 64, 100)  # whole pages past position 10 (128 bytes each)
    assert all(a.any() for a in later)  # the control: written
    engine.release(1, 10)
    assert engine.lengths[1] == 10 and list(engine.held(1)) == TOKENS[:10]
    assert not any(a.any() for a in _positions(engine, 1, 64, 100))
    assert all(
        np.array_equal(a, b) for a, b in zip(_positions(engine, 1, 0, 10), prefix, strict=True)
    )
    again = engine.forward_rows([(1, TOKENS[10:])], last=1)[0]
    engine.reset(0)
    assert np.array_equal(again, engine.forward_rows([(0, TOKENS)], last=1)[0])


def _run(runtime, budget: KVBudget | None, sequences=None) -> tuple[list[list[int]], int]:
    """Sequences (default: the prompts') through a 3-slot scheduler; their outputs and the most
    seated at once."""
    scheduler = Scheduler(runtime.target, runtime.costs, slots=3, budget=budget)
    if sequences is None:
        sequences = [runtime.sequence(p, max_new_tokens=NEW, ignore_eos=True) for p in PROMPTS]
    for sequence in sequences:
        scheduler.add(sequence)
    most = 0
    while scheduler.busy:
        scheduler.step()
        most = max(most, scheduler.active)
    return [s.result.token_ids for s in sequences], most


def test_a_budget_seats_what_fits_and_changes_no_output(runtime):
    alone = [runtime.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids for p in PROMPTS]
    outputs, most = _run(runtime, None)
    assert outputs == alone and most == 3  # the control: all three side by side
    need = max(len(p) for p in PROMPTS) + NEW
    outputs, most = _run(runtime, KVBudget(2 * need, [runtime.target, runtime.draft]))
    assert outputs == alone and most == 2


def test_each_engine_counts_what_it_holds(runtime):
    """A sequence's need weighs each engine's positions by what a position costs it: a draft
    model that reads a long prompt's window holds that window and the answer; without a draft
    model, nothing. The control: a draft reading the whole prompt needs the target's count.
    Seated by that count, two windowed sequences fit where two whole-prompt ones do not, and
    both give their outputs alone."""
    t, d = runtime.target.position_bytes, runtime.draft.position_bytes
    engines = [runtime.target, runtime.draft]
    prompt = TOKENS[:40]

    def sequence(window: int | None = None, **changes):
        drafter = make_drafter("model", runtime.draft, window=window)
        options = {"drafter": drafter, "max_new_tokens": 8, "ignore_eos": True, **changes}
        return runtime.sequence(prompt, **options)

    budget = KVBudget(1000, engines)
    assert budget.need(sequence()) == 48
    assert budget.need(sequence(window=12)) == (48 * t + 20 * d) / (t + d)
    assert budget.need(sequence(speculate=False)) == 48 * t / (t + d)
    alone = runtime.generate(prompt, max_new_tokens=8, ignore_eos=True, speculate=False)
    two_windowed = KVBudget(int(2 * budget.need(sequence(window=12))) + 1, engines)
    for window, together in ((12, 2), (None, 1)):
        outputs, most = _run(runtime, two_windowed, [sequence(window) for _ in range(2)])
        assert most == together, window
        assert outputs == [alone.token_ids] * 2


def test_idle_slots_give_their_positions_back_to_make_room(runtime):
    budget = KVBudget(len(PROMPTS[0]) + NEW + 5, [runtime.target, runtime.draft])
    scheduler = Scheduler(runtime.target, runtime.costs, slots=3, budget=budget)
    first = runtime.sequence(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)
    scheduler.add(first)
    while scheduler.busy:
        scheduler.step()
    held = runtime.target.lengths[first.slot]
    assert held > 0  # kept for the prompt cache while nobody needs the room
    second = runtime.sequence(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True)
    scheduler.add(second)
    scheduler.step()
    assert second.slot != first.slot and runtime.target.lengths[first.slot] == 0
    assert runtime.draft.lengths[first.slot] == 0


def test_a_request_that_could_never_fit_is_refused(runtime):
    budget = KVBudget(20, [runtime.target, runtime.draft])
    scheduler = Scheduler(runtime.target, runtime.costs, slots=3, budget=budget)
    sequence = runtime.sequence(PROMPTS[0], max_new_tokens=NEW)
    with pytest.raises(SpecrtError, match="may need 28 cache positions .* --kv-budget of 20"):
        scheduler.add(sequence)
    assert not scheduler.busy


def test_a_budget_is_given_in_positions_or_bytes(runtime):
    engines = [runtime.target, runtime.draft]
    per_position = runtime.target.position_bytes + runtime.draft.position_bytes
    assert KVBudget.parse("4096", engines).positions == 4096
    assert KVBudget.parse("4096 tokens", engines).positions == 4096
    assert KVBudget.parse("1MB", engines).positions == 10**6 // per_position
    assert KVBudget.parse("2GiB", engines).positions == 2 * 2**30 // per_position
    for bad in ("lots", "-3", "12 parsecs"):
        with pytest.raises(SpecrtError, match="--kv-budget takes positions"):
            KVBudget.parse(bad, engines)
    with pytest.raises(SpecrtError, match="--kv-budget takes positions"):
        ServeSettings(bundle=runtime.bundle.path, kv_budget="lots").check()


def test_the_server_refuses_a_request_past_its_budget_with_a_400(bundles):
    runtime = SpeculativeRuntime.load(bundles["llama"], calibrate=False, slots=2)
    settings = ServeSettings(bundle=bundles["llama"], model_name="tiny", kv_budget="40")
    with serving(settings, runtime) as (base, _):
        wait_healthy(base)
        api = client(base)
        assert api.models.retrieve("tiny").model_extra["kv_budget"] == 40
        ok = api.completions.create(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert ok.choices[0].text
        with pytest.raises(openai.BadRequestError, match="--kv-budget of 40"):
            api.completions.create(model="tiny", prompt="Hello", max_tokens=60, temperature=0)


def test_without_a_budget_a_server_takes_what_the_memory_available_holds(
    runtime, monkeypatch, tmp_path
):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert machine.available_memory(str(meminfo)) == 20000000 * 1024
    assert machine.available_memory(str(tmp_path / "none")) is None
    engines = [runtime.target, runtime.draft]
    per_position = runtime.target.position_bytes + runtime.draft.position_bytes
    monkeypatch.setattr(machine, "available_memory", lambda: 100 * per_position)
    assert KVBudget.fitting(engines, slots=3).positions == 80  # 80 % of it
    monkeypatch.setattr(machine, "available_memory", lambda: 10**6 * per_position)
    assert KVBudget.fitting(engines, slots=3) is None  # every slot's context fits anyway
    monkeypatch.setattr(machine, "available_memory", lambda: None)
    assert KVBudget.fitting(engines, slots=3) is None
