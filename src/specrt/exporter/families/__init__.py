"""Model families: what each decoder does differently from Llama, one class per family.

The graph writer asks its family for the few things that differ in kind: how a norm applies its
weight, what scales the embeddings and the attention scores, the MLP's activation, where the
norms sit around each block, soft-capping, which rotary table a layer uses. What is data is read
from the config and the weights for every family alike: biases, q/k norms, sliding windows,
rope scaling, fused projections, tied heads.
"""

from __future__ import annotations

import math

from specrt.errors import SpecrtError


class Family:
    """Llama 2/3, Qwen2, Qwen3, Mistral, Phi-3: pre-norm blocks, RMSNorm scaled by its weight,
    SiLU-gated MLP, attention scaled by 1/sqrt(head_dim)."""

    model_types: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "phi3")
    activation_field = "hidden_act"
    activations: tuple[str, ...] = ("silu",)
    norm_offset = 0.0  # a norm's scale is offset + weight
    sandwich = False  # norms after attention and the MLP as well as before (Gemma 2/3)

    def __init__(self, config):
        self.config = config
        activation = getattr(config, self.activation_field, self.activations[0])
        if activation not in self.activations:
            raise SpecrtError(
                f"{config.model_type}: config.{self.activation_field} {activation!r} is not "
                f"supported ({', '.join(self.activations)} only)"
            )

    def embed_scale(self) -> float | None:
        return None

    def attention_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)

    def attention_softcap(self) -> float | None:
        return None

    def final_softcap(self) -> float | None:
        return None

    def rope_key(self, layer: int) -> str | None:
        """Which rotary table layer `layer` uses (None: the model's one table)."""
        return None

    def activation(self, b, gate: str) -> str:
        """SiLU: gate * sigmoid(gate)."""
        return b.op("Mul", gate, b.op("Sigmoid", gate))


def family_of(config) -> Family:
    """The family that writes this config's graph, or a refusal naming the field."""
    from specrt.exporter.families.gemma import Gemma2, Gemma3

    families = {kind: cls for cls in (Family, Gemma2, Gemma3) for kind in cls.model_types}
    if config.model_type not in families:
        raise SpecrtError(
            f"config.model_type {config.model_type!r} is not supported yet (supported: "
            f"{', '.join(families)})"
        )
    return families[config.model_type](config)
