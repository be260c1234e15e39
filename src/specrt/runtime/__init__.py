"""The lean runtime: numpy, onnxruntime and tokenizers only (no torch, no transformers)."""

from specrt.runtime.api import Generation, Result, SpeculativeRuntime, Stats
from specrt.runtime.sampling import SamplingParams

__all__ = ["Generation", "Result", "SamplingParams", "SpeculativeRuntime", "Stats"]
