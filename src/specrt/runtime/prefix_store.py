"""Prefixes kept beyond the slots: keys and values in host memory, by token prefix, LRU in a size.

A slot holds one sequence's cache; once a new sequence takes it, what it held is gone, so a
conversation that comes back after more than `--max-batch` others, a document sent again, or
a system prompt shared by more requests than there are slots would be computed again. Before a
slot's cache is overwritten or released, its positions are copied here in blocks of BLOCK
tokens; a new prompt then starts from the longest run of stored blocks it begins with, where
that is longer than what any slot holds (prompt_cache.py decides).

A block is keyed by its tokens and the block before it (`(owner, parent, tokens)`: the same
tokens after another prefix have other keys and values), so prompts that share a prefix share
its blocks, and a lookup walks the prompt's blocks from the first. Keys compare the tokens
themselves, so a lookup can never take another prefix's block (no hash stands in for them).
Blocks are used least recently first out; a chain is touched from its last block to its first,
so a prefix outlives the blocks that continue it. llama-server's `--cache-ram` is the same idea
for whole prompts; vLLM's prefix caching hashes blocks like this on the device.

Exact by the engines' invariance, as slot reuse is: a position's keys and values depend only on
the tokens up to it, never on how calls were cut (see prompt_cache.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrt import machine
from specrt.engines.base import Engine

BLOCK = 64  # tokens a block holds: a prompt restores whole blocks, and feeds the rest
# A server's default size: this share of the memory available at start-up, at most CEILING
# bytes (llama-server's --cache-ram default is 8 GiB).
SHARE, CEILING = 0.25, 8 * 2**30


def default_capacity() -> int:
    """What a server keeps by default: SHARE of the memory available now, CEILING at most
    (0 where the memory is unknown)."""
    available = machine.available_memory()
    return 0 if available is None else int(min(CEILING, available * SHARE))


@dataclass
class Block:
    key: tuple  # (owner engine's id, the parent block's serial or 0, the tokens)
    serial: int  # names this block as the parent of the next
    data: np.ndarray  # what the engine's read_positions gave

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.key[2]


class PrefixStore:
    def __init__(self, capacity: int, block: int = BLOCK):
        """capacity: bytes the stored blocks may take (every engine's together); block:
        tokens a block holds."""
        self.capacity, self.block = capacity, block
        self.bytes = 0
        self._blocks: OrderedDict[tuple, Block] = OrderedDict()  # least recently used first
        self._serial = itertools.count(1)

    def __len__(self) -> int:
        return len(self._blocks)

    def find(self, engine: Engine, tokens: Sequence[int]) -> list[Block]:
        """The stored blocks the tokens begin with, in order (touched: used now)."""
        chain, parent = [], 0
        size = self.block
        for start in range(0, len(tokens) - size + 1, size):
            block = self._blocks.get((id(engine), parent, tuple(tokens[start : start + size])))
            if block is None:
                break
            chain.append(block)
            parent = block.serial
        self._touch(chain)
        return chain

    def save(self, engine: Engine, slot: int) -> None:
        """Keep the whole blocks the slot holds (those not kept already), before its cache is
        overwritten; nothing where the engine keeps no host cache or a block would not fit."""
        held = engine.held(slot)
        chain, parent = [], 0
        size = self.block
        for start in range(0, len(held) - size + 1, size):
            tokens = tuple(held[start : start + size])
            key = (id(engine), parent, tokens)
            block = self._blocks.get(key)
            if block is None:
                data = engine.read_positions(slot, start, start + size)
                if data is None or data.nbytes > self.capacity:
                    break
                block = self._blocks[key] = Block(key, next(self._serial), data)
                self.bytes += data.nbytes
            chain.append(block)
            parent = block.serial
        self._touch(chain)
        while self.bytes > self.capacity:
            _, oldest = self._blocks.popitem(last=False)
            self.bytes -= oldest.data.nbytes

    def _touch(self, chain: list[Block]) -> None:
        """Mark a chain used now, its first block last: a prefix is evicted after the blocks
        that continue it (whose keys name it, so they could not be found without it)."""
        for block in reversed(chain):
            self._blocks.move_to_end(block.key)
