"""The KV budget: how many cache positions the slots may hold at once, shared by them all.

Every slot of an engine can hold the bundle's whole context, and a CPU slot's memory is
committed only as it is written (see `OrtEngine.release`), so memory follows the sequences
seated, not the worst case: eight slots of a 32k-context bundle cost nothing until eight long
conversations fill them, and then 21 GB for the default pair. A budget bounds that sum, as
llama-server's `-c` bounds the context its slots share. A sequence is seated only where the
positions it may need (its prompt and its token budget: it must never run out mid-answer)
fit beside what the seated sequences may need and what the idle slots still hold for the
prompt cache; to make room, idle slots give their memory back, the one released longest ago
first. A sequence that could never fit is refused when it is added. A server without a
budget of its own takes what most of the memory available at load holds (`fitting`).

A position of the budget is one position in every engine (82 KB for the default pair), but
the engines do not hold the same positions: a windowed draft model (drafters.py) reads a long
prompt's first and last tokens only, and a request without a draft model leaves it idle. So a
sequence's need is counted per engine and weighed by what a position costs each (`weights`):
after a prompt of 8,000 tokens, the default pair's draft model holds about 500 positions, not
8,000, and the budget seats about 40 % more such conversations than if it counted 8,000 there
(27 against 19 in 159,370 positions, answers of 16 tokens; docs/serving.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence

from specrt import machine
from specrt.engines.base import Engine
from specrt.errors import SpecrtError
from specrt.runtime.prompt_cache import PromptCache

UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
FITTING = 0.8  # of the memory available at load, the default budget's share
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:(k|m|g|ki|mi|gi)b|(tokens?)?)\s*$", re.I)


def parse_size(spec: str) -> tuple[float, str | None]:
    """A --kv-budget's number and its unit of bytes (None: positions), or a refusal."""
    match = SIZE.match(spec)
    if match is None:
        raise SpecrtError(
            f"--kv-budget takes positions (65536) or a size (12GB, 8GiB), got {spec!r}"
        )
    return float(match.group(1)), match.group(2)


def parse_bytes(spec: str, flag: str) -> int:
    """A size in bytes ("8GB", "512MiB", "0"), or a refusal naming the flag."""
    match = SIZE.match(spec)
    if match is None or match.group(2) is None and float(match.group(1)) != 0:
        raise SpecrtError(f"{flag} takes a size (8GB, 512MiB) or 0, got {spec!r}")
    unit = match.group(2)
    return int(float(match.group(1)) * UNITS[unit.lower()]) if unit else 0


def position_bytes(engines: Iterable[Engine | None]) -> int | None:
    """What one cache position costs all the engines together (None where an engine cannot
    say: only the ONNX Runtime engine knows its buffers)."""
    costs = [getattr(e, "position_bytes", None) for e in engines if e is not None]
    return None if None in costs else sum(costs)


class KVBudget:
    def __init__(self, positions: int, engines: Iterable[Engine | None]):
        """positions: what the slots may hold at once; engines: every engine whose slots
        hold a sequence's cache (the target, and the draft model where there is one)."""
        if positions < 1:
            raise SpecrtError(f"--kv-budget must be at least one position, got {positions}")
        self.positions = positions
        self.engines = [engine for engine in engines if engine is not None]
        # What a position costs each engine, in any unit: bytes where the engines can say, else
        # the target's positions alone (the others counted as holding as many).
        costs = [getattr(e, "position_bytes", None) for e in self.engines]
        self.weights = costs if None not in costs else [1] + [0] * (len(costs) - 1)

    @classmethod
    def parse(cls, spec: str, engines: Sequence[Engine | None]) -> KVBudget:
        """A budget in positions ("65536", "65536 tokens") or bytes ("12GB", "8GiB"), the
        bytes split by what one position costs all the engines."""
        value, unit = parse_size(spec)
        if unit is None:
            return cls(int(value), engines)
        per_position = position_bytes(engines)
        if per_position is None:
            raise SpecrtError(
                "--kv-budget as a size needs the ONNX Runtime engines; give positions"
            )
        return cls(int(value * UNITS[unit.lower()] // per_position), engines)

    @classmethod
    def fitting(
        cls, engines: Sequence[Engine | None], slots: int, beside: int = 0
    ) -> KVBudget | None:
        """The default: what FITTING of the memory available now (the engines loaded), less
        `beside` bytes promised to something else (the prefix store), holds, where every
        slot's full context would not fit in it; None where it would, or where the memory or
        a position's cost is unknown."""
        available, per_position = machine.available_memory(), position_bytes(engines)
        if available is None or per_position is None:
            return None
        positions = int(max(0, available - beside) * FITTING // per_position)
        full = slots * engines[0].capacity
        return cls(positions, engines) if positions < full else None

    def need(self, sequence) -> float:
        """The positions a sequence may come to hold, in positions of every engine: in the
        target its prompt and every token it may emit, within the context; in the draft model
        what it reads of the prompt (all of it, or a window) and those tokens, or, without a
        draft model, what its slot still holds."""
        capacity = self.engines[0].capacity
        target = min(capacity, len(sequence.prompt) + sequence.max_new_tokens)
        if len(self.engines) == 1:
            return target
        model = sequence.drafter.model if sequence.drafter is not None else None
        draft = 0
        if model is not None:
            read = min(len(sequence.prompt), model.window or len(sequence.prompt))
            draft = min(target, read + sequence.max_new_tokens)
        if sequence.slot is not None:
            draft = max(draft, self.engines[1].lengths[sequence.slot])
        return self._share([target, draft])

    def _share(self, positions: Sequence[int]) -> float:
        """Positions held in each engine, as positions of every engine."""
        held = sum(n * weight for n, weight in zip(positions, self.weights, strict=True))
        return held / sum(self.weights)

    def check(self, sequence) -> None:
        """Refuse a sequence no emptying of the slots would make room for."""
        need = math.ceil(self.need(sequence))
        if need > self.positions:
            raise SpecrtError(
                f"the request may need {need} cache positions (a prompt of "
                f"{len(sequence.prompt)} tokens and up to {sequence.max_new_tokens} new ones), "
                f"more than the server's --kv-budget of {self.positions}; send a shorter "
                "prompt or a smaller max_tokens",
                param="max_tokens",
            )

    def make_room(self, reserved: float, idle: list[int], cache: PromptCache | None) -> bool:
        """Whether `reserved` positions (what the seated sequences and the one joining may
        need) fit beside what the idle slots hold, after releasing idle slots in the order
        given (the one released longest ago first) as far as that takes; what they held goes
        to the cache's prefix store, where it has one."""
        held = [(slot, self._share([e.lengths[slot] for e in self.engines])) for slot in idle]
        held = [(slot, length) for slot, length in held if length]
        cached = sum(length for _, length in held)
        for slot, length in held:
            if reserved + cached <= self.positions:
                break
            for engine in self.engines:
                if cache is None:
                    engine.release(slot)
                else:
                    cache.spill(engine, slot)
            cached -= length
        return reserved + cached <= self.positions
