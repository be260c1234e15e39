"""Costs that no round refines, for tests of what the adaptive controller chooses.

The runtime's costs are wall-clock measurements, refined by every round, so a controller's
choices on real engines depend on the CPU, its speed and its load. A test that asserts which K
it picks runs on these instead: its choices then depend on acceptance alone, on every machine.
"""

from __future__ import annotations

from specrt.runtime.costs import StepCosts


class FixedCosts(StepCosts):
    """A StepCosts whose curves stay as given."""

    def observe_draft(self, rows: int, seconds: float) -> None:
        pass

    def observe_verify(
        self, rows: int, seconds: float, context: float | None = None, requests: int = 1
    ) -> None:
        pass


def flat_costs() -> FixedCosts:
    """A draft step a fifth of a verify call, catch-ups that cost, and a verify curve that
    grows 5 % a row: a small draft in front of a weight-bound float32 target."""
    return FixedCosts(
        draft={1: 0.002, 16: 0.004, 33: 0.006},
        verify={1: 0.010, 33: 0.010 + 0.0005 * 32},
    )


def gguf_costs() -> FixedCosts:
    """The gguf 1.5B target's and the int4 0.5B draft's curves, calibrated at 8 slots on a
    2-core AVX-512 EPYC (fixed here: no CPU decides a test that uses them)."""
    verify = {1: 0.0608, 2: 0.0682, 3: 0.0808, 4: 0.0941, 5: 0.1043, 8: 0.1372, 10: 0.1709}
    verify |= {16: 0.2291, 24: 0.3467, 40: 0.5123}
    draft = {1: 0.0138, 2: 0.0166, 4: 0.0257, 8: 0.0403, 16: 0.0635}
    return FixedCosts(draft=draft, verify=verify)
