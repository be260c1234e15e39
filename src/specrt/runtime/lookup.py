"""Prompt lookup's search: where the sequence's last tokens occurred before, and what followed
(`NgramDrafter` proposes it). Kept apart as pure arithmetic over token ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lookup(seq: Sequence[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """Up to `limit` tokens that followed the most recent earlier match of seq's last n tokens,
    for the largest n in max_n..min_n that matches; [] when none does.

    One pass over the sequence finds where its last token occurred before (the only places a
    match can end); only those few candidates are extended backwards to n tokens.
    """
    if limit < 1 or len(seq) <= min_n:
        return []
    tokens = np.asarray(seq, dtype=np.int64)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # a match ending here continues at end + 1
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):
            found = found[tokens[found - back] == tokens[-1 - back]]
        if found.size:
            start = int(found[-1]) + 1
            return tokens[start : start + limit].tolist()
    return []
