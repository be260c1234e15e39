"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's decoder with two projections stored fused.

transformers' Phi3 keeps q/k/v as one `qkv_proj` ([q; k; v] rows) and gate/up as one
`gate_up_proj` ([gate; up] rows); llama.cpp's converter keeps them fused too (attn_qkv, and an
ffn_up of both halves with no ffn_gate). The exporter reads each part as a band of the fused
tensor's rows (`exporter.tensors.Unfused`). Their longrope is data of the config
(`Family.check_capacity`).
"""

from __future__ import annotations

from specrt.exporter.families import Family


class Phi3(Family):
    model_types = ("phi3",)
    fused = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
