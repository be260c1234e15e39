"""PyTorch reference engine: the transformers model itself, with its own dynamic cache.

This is the baseline every speed claim is measured against and the reference every exported
graph is checked against, so it runs the very weights the bundle was built from (its recorded
source, re-hashed on load).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import DynamicCache

from specrt.bundle import Bundle
from specrt.engines.base import OneSlot, check_rollback, check_room, check_slot
from specrt.errors import BundleError
from specrt.sources import Source, load_model


class TorchEngine(OneSlot):
    def __init__(self, model, capacity: int, *, threads: int | None = None, device: str = "cpu"):
        """device: "cpu", or "cuda" for the GPU check's PyTorch row (float32 either way)."""
        if threads:
            torch.set_num_threads(threads)
        self.device = device
        self.model = model.eval().to(device)
        self.vocab_size = model.config.vocab_size
        self.capacity = capacity
        self.cache = DynamicCache(config=model.config)
        self._tokens: list[int] = []  # what the cache holds

    @classmethod
    def from_bundle(cls, bundle: Bundle, role: str, **options) -> TorchEngine:
        recorded = bundle.role(role).info["source"]
        source = Source.parse(recorded["spec"])
        if recorded.get("sha256") and source.sha256() != recorded["sha256"]:
            raise BundleError(
                f"{role} source {source.spec} changed since the bundle was built "
                "(its weights no longer match the recorded sha256)"
            )
        return cls(load_model(source), bundle.max_context, **options)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def lengths(self) -> list[int]:
        return [self.length]

    def held(self, slot: int = 0) -> list[int]:
        check_slot(self, slot)
        return self._tokens[: self.length]

    def reset(self, slot: int = 0) -> None:
        check_slot(self, slot)
        self.cache = DynamicCache(config=self.model.config)
        self._tokens = []

    def rollback(self, length: int, slot: int = 0) -> None:
        check_slot(self, slot)
        check_rollback(self, length)
        if length < self.length:  # transformers >= 5 crops by a negative count of tokens
            self.cache.crop(length - self.length)
        del self._tokens[length:]

    def forward(self, tokens: Sequence[int], last: int | None = None) -> np.ndarray:
        keep = check_room(self, len(tokens), last)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep
            )
        self._tokens.extend(tokens)
        return out.logits[0].float().cpu().numpy()
