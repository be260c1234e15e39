"""Model families: what each decoder does differently from Llama, one class per family.

The graph writer asks its family for the few things that differ in kind: how a norm applies its
weight, what scales the embeddings and the attention scores, the MLP's activation, where the
norms sit around each block, soft-capping, which rotary table a layer uses, which layers slide
a window, how far its rope scaling reaches, which projections it stores fused, and how
llama.cpp's converter stores its weights in a GGUF file (q/k rows interleaved, norms offset).
What is data is read from the config and the weights for every family alike: biases, q/k norms,
rope scaling, tied heads.
"""

from __future__ import annotations

import math

from specrt.errors import SpecrtError


class Family:
    """Llama 2/3, Qwen2, Qwen3, Mistral: pre-norm blocks, RMSNorm scaled by its weight,
    SiLU-gated MLP, attention scaled by 1/sqrt(head_dim)."""

    model_types: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")
    activation_field = "hidden_act"
    activations: tuple[str, ...] = ("silu",)
    norm_offset = 0.0  # a norm's scale is offset + weight (a GGUF file stores the sum)
    # GGUF architectures whose q/k rows llama.cpp's converter interleaves for its rotary kernel
    gguf_interleaved_qk: tuple[str, ...] = ("llama",)
    sandwich = False  # norms after attention and the MLP as well as before (Gemma 2/3)
    # projections stored as one tensor -> its parts, in the order of their rows (Phi-3)
    fused: dict[str, tuple[str, ...]] = {}

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

    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it sees its whole prefix), as transformers
        applies them: per `layer_types` where the config lists them (Qwen2/Qwen3 with
        use_sliding_window, Gemma 2/3), else `sliding_window` on every layer (Mistral)."""
        config = self.config
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types:
            return [window if kind == "sliding_attention" else None for kind in types]
        return [window] * config.num_hidden_layers

    def max_capacity(self) -> int | None:
        """The most cache positions one rotary table covers (None: as many as the model has):
        longrope (Phi-3.5, Phi-4-mini) turns to its long factors for the whole sequence once it
        passes its original length, so a cache built once stops there."""
        config = self.config
        parameters = getattr(config, "rope_parameters", None) or {}
        original = parameters.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None
        )
        return original if parameters.get("rope_type") == "longrope" else None

    def check_capacity(self, capacity: int) -> None:
        """Refuse a cache its rotary cannot cover with one table (`max_capacity`)."""
        original = self.max_capacity()
        if original and capacity > original:
            raise SpecrtError(
                "config.rope_parameters: longrope turns to its long factors for the whole "
                f"sequence once it passes original_max_position_embeddings ({original}); a "
                f"cache of {capacity} positions cannot hold both: build with a smaller "
                "--max-context"
            )

    def activation(self, b, gate: str) -> str:
        """SiLU: gate * sigmoid(gate)."""
        return b.op("Mul", gate, b.op("Sigmoid", gate))


def family_of(config) -> Family:
    """The family that writes this config's graph, or a refusal naming the field."""
    from specrt.exporter.families.gemma import Gemma2, Gemma3
    from specrt.exporter.families.phi3 import Phi3

    families = {kind: cls for cls in (Family, Phi3, Gemma2, Gemma3) for kind in cls.model_types}
    if config.model_type not in families:
        raise SpecrtError(
            f"config.model_type {config.model_type!r} is not supported yet (supported: "
            f"{', '.join(families)})"
        )
    return families[config.model_type](config)
