"""Gemma 2 and Gemma 3 (text): what they do differently from Llama, as transformers' modeling
files do it.

- embeddings scaled by sqrt(hidden_size);
- RMSNorm scaled by (1 + weight), and four norms per block: before and after attention, before
  and after the MLP ("sandwich");
- GeGLU: gelu with the tanh approximation on the gate;
- attention scores scaled by query_pre_attn_scalar^-1/2, and soft-capped (tanh(s / c) * c) where
  the config has attn_logit_softcapping; the final logits likewise with final_logit_softcapping;
- Gemma 3: q/k norms per head (read from the weights), and a rotary table per layer type: local
  sliding-window layers have their own rope base (rope_parameters["sliding_attention"]).
"""

from __future__ import annotations

import math

import numpy as np

from specrt.exporter.families import Family

GELU_TANH = math.sqrt(2.0 / math.pi)


class Gemma2(Family):
    model_types = ("gemma2",)
    activation_field = "hidden_activation"
    activations = ("gelu_pytorch_tanh",)
    norm_offset = 1.0
    sandwich = True
    gguf_interleaved_qk = ()

    def embed_scale(self) -> float | None:
        return self.config.hidden_size**0.5

    def attention_scale(self, head_dim: int) -> float:
        return self.config.query_pre_attn_scalar**-0.5

    def attention_softcap(self) -> float | None:
        return getattr(self.config, "attn_logit_softcapping", None)

    def final_softcap(self) -> float | None:
        return getattr(self.config, "final_logit_softcapping", None)

    def activation(self, b, gate: str) -> str:
        """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as torch's gelu(approximate='tanh')."""
        cube = b.op("Mul", b.op("Mul", gate, gate), gate)
        inner = b.op("Add", gate, b.op("Mul", cube, b.const(0.044715, np.float32)))
        tanh = b.op("Tanh", b.op("Mul", inner, b.const(GELU_TANH, np.float32)))
        half = b.op("Mul", gate, b.const(0.5, np.float32))
        return b.op("Mul", half, b.op("Add", tanh, b.const(1.0, np.float32)))


class Gemma3(Gemma2):
    model_types = ("gemma3_text",)

    def rope_key(self, layer: int) -> str | None:
        return self.config.layer_types[layer]
