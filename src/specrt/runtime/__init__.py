"""The lean runtime: numpy, onnxruntime and tokenizers only (no torch, no transformers)."""

from specrt.runtime.api import SpeculativeRuntime
from specrt.runtime.budget import KVBudget
from specrt.runtime.generation import Generation
from specrt.runtime.grammar import Structure
from specrt.runtime.logprobs import TokenLogprob
from specrt.runtime.options import Options
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.scheduler import Scheduler
from specrt.runtime.sequence import Result, Sequence, Stats

__all__ = [
    "Generation",
    "KVBudget",
    "Options",
    "Result",
    "SamplingParams",
    "Scheduler",
    "Sequence",
    "SpeculativeRuntime",
    "Stats",
    "Structure",
    "TokenLogprob",
]
