"""Requests run alone and then together through one scheduler: the batching tests' comparison."""

from __future__ import annotations

from specrt.runtime import Scheduler, SpeculativeRuntime


def alone_and_together(runtime: SpeculativeRuntime, requests, slots: int):
    """Each (prompt, options) generated alone, then all through a scheduler of `slots` slots
    (joining and leaving between rounds): the token ids both ways, and the round sizes seen."""
    alone = [runtime.generate(p, **o).token_ids for p, o in requests]
    scheduler = Scheduler(runtime.target, runtime.costs, slots=slots)
    generations = [runtime.sequence(p, **o) for p, o in requests]
    for generation in generations:
        scheduler.add(generation)
    sizes = set()
    while any(g.result is None for g in generations):
        sizes.add(scheduler.step().batch)
    return alone, [g.result.token_ids for g in generations], sizes
