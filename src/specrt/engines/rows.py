"""Whether a position's logits depend on how many rows its call carries, probed on this machine.

Speculation is exact only if the target scores a position the same in a verify call of K+1
tokens, in a one-token decode step and beside other requests in a batch. Some kernels do not:
ONNX Runtime's MatMulNBits (int8/int4/gguf weights) takes activation rows in pairs and, on AVX2
CPUs, gives an odd last row to a one-row kernel whose results differ (up to 0.3 in a logit on
the int4 1.5B target); on AVX-512/VNNI CPUs the same build gives identical rows. So the engine
does not assume either: at load it scores the same positions in calls of 1, 2 and 3 tokens, in
one call of 4 and, where it holds several slots, beside another row of other lengths in one
call (a lone row's attention takes one path, a batch's rows another, their row views or a
Loop: exporter/attention.py), compares bit for bit, and pads every call to an even
number of rows only where they differ (a padded row is not free: about 17 ms on the int4 1.5B
target).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.engines.base import Engine

PREFIX, NEW = 5, 4  # tokens of context, then the positions scored in every cut
WIDTHS = (1, 2, 3)  # calls whose rows are compared with the call of all NEW tokens


@dataclass(frozen=True)
class RowProbe:
    """What the probe found. unpadded: the largest |difference| in a logit between a position
    scored in an odd call and the same position in an even one (0.0: bit-identical); padded:
    the same with every call padded to even rows (None where padding was not needed)."""

    unpadded: float
    padded: float | None = None

    @property
    def pads(self) -> bool:
        return self.unpadded > 0.0

    @property
    def exact(self) -> bool:
        """A position scores the same in every call the engine will make."""
        return not self.pads or self.padded == 0.0

    def describe(self) -> str:
        if not self.pads:
            return "identical in calls of any row count: no padding"
        if self.exact:
            return (
                f"odd calls differ (max |dlogit| {self.unpadded:.2g}): every call padded to an "
                "even number of rows, which makes them identical"
            )
        return (
            f"odd calls differ (max |dlogit| {self.unpadded:.2g}) and padded calls still differ "
            f"({self.padded:.2g}): outputs may differ from the target alone"
        )

    def as_dict(self) -> dict:
        """The record results and `specrt doctor --json` keep, the finding in words included."""
        return {
            "finding": self.describe(),
            "pads": self.pads,
            "exact": self.exact,
            "max_abs_dlogit_unpadded": self.unpadded,
            "max_abs_dlogit_padded": self.padded,
        }


def cut_difference(engine: Engine) -> float:
    """The largest |difference| between the logits of the same positions scored in calls of
    WIDTHS tokens and in one call of NEW tokens, after a PREFIX-token context in slot 0, and,
    with two slots or more, in a call beside slot 1 (0.0 where every one is bit-identical).
    Leaves slots 0 and 1 empty."""
    ids = [(17 + 31 * i) % engine.vocab_size for i in range(PREFIX + NEW)]
    engine.reset(0)
    engine.forward(ids[:PREFIX], last=1)
    whole = engine.forward(ids[PREFIX:])
    worst = 0.0
    for width in WIDTHS:
        engine.rollback(PREFIX)
        worst = max(worst, _gap(engine.forward(ids[PREFIX : PREFIX + width]), whole[:width]))
    if getattr(engine, "slots", 1) > 1:
        other = [(5 + 7 * i) % engine.vocab_size for i in range(PREFIX + NEW + 3)]
        engine.reset(0)
        engine.reset(1)
        engine.forward_rows([(0, ids[:PREFIX]), (1, other[: PREFIX + 2])], last=1)
        beside, _ = engine.forward_rows([(0, ids[PREFIX:]), (1, other[PREFIX + 2 :])])
        worst = max(worst, _gap(beside, whole))
        engine.reset(1)
    engine.reset(0)
    return worst


def _gap(part: np.ndarray, whole: np.ndarray) -> float:
    if np.array_equal(part, whole):
        return 0.0
    gap = float(np.max(np.abs(part - whole)))
    return gap if gap > 0 else float("inf")  # NaN: by how much, unknown
