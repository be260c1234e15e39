"""Model families against transformers' own forward, on tiny random configs: the build's export
check (logits within tolerance), greedy decoding identical for 64 tokens, and speculation
identical to the target alone. Each family's difference has a control: the graph without it
is refused by the build's check."""

from __future__ import annotations

import pytest
from row_checks import attention_paths_differ

import specrt.exporter.batched_attention as batched
import specrt.exporter.graph as graph
from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.exporter.build import build_bundle
from specrt.exporter.families import Family, family_of
from specrt.exporter.families.gemma import Gemma2, Gemma3
from specrt.exporter.families.phi3 import Phi3
from specrt.exporter.tiny import TINY_SHAPE, train_tokenizer
from specrt.runtime.api import SpeculativeRuntime

COMMON = {**TINY_SHAPE, "num_hidden_layers": 4}
WINDOW = 8  # shorter than the check's 12-token prefill: a missing window shows


def _config(family: str, vocab: int):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common = {**COMMON, "vocab_size": vocab}
    if family == "qwen3":  # q/k norms per head, head_dim not hidden / heads
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False)
    if family == "qwen2-sliding":  # windows on the layers from max_window_layers on
        return Qwen2Config(
            **common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
        )
    if family == "llama3":  # Llama 3.x rope scaling, tied embeddings as in 3.2 1B/3B
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        return LlamaConfig(
            **common, rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=True
        )
    if family in ("phi3", "phi4-mini"):  # fused qkv and gate/up
        extra = {}
        if family == "phi4-mini":  # half of each head turns (Phi-4-mini: 3/4); longrope
            extra["rope_parameters"] = {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
                "partial_rotary_factor": 0.5,
            }
            extra.update(original_max_position_embeddings=512, max_position_embeddings=2048)
        return Phi3Config(
            **{**common, **extra}, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False
        )
    if family == "gemma2":  # caps small enough to bite; scalar other than head_dim
        return Gemma2Config(
            **GEMMA, sliding_window=WINDOW, attn_logit_softcapping=1.0, final_logit_softcapping=3.0
        )
    if family == "gemma3":  # local layers with their own rope base, q/k norms
        return Gemma3TextConfig(**GEMMA, sliding_window=WINDOW, sliding_window_pattern=2)
    raise ValueError(family)


GEMMA = {
    **COMMON,
    "vocab_size": 384,
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "eos_token_id": 0,
    "pad_token_id": None,
}
FAMILIES = ("qwen3", "mistral", "qwen2-sliding", "llama3", "phi3", "phi4-mini", "gemma2", "gemma3")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """A Hugging Face folder per family: a tiny random model with the package's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    tokenizer = train_tokenizer()
    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(family, len(tokenizer))).eval()
        with torch.no_grad():  # norms away from their init (Gemma's are zeros: 1 + w)
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param += 0.1 * torch.randn_like(param)
        out[family] = root / family
        model.save_pretrained(out[family])
        tokenizer.save_pretrained(out[family])
    return out


def _build(folder, out):
    return build_bundle(None, str(folder), out, max_context=256, log=lambda _: None)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_for_64_tokens(folders, tmp_path, family):
    import torch
    from transformers import AutoModelForCausalLM

    rt = SpeculativeRuntime.load(_build(folders[family], tmp_path / "b"), threads=1)
    model = AutoModelForCausalLM.from_pretrained(folders[family]).eval()
    for text in ("def fibonacci(n):", "The quick brown fox jumps over the lazy dog"):
        prompt = rt.encode(text)
        alone = rt.generate(prompt, max_new_tokens=64, ignore_eos=True, speculate=False)
        with torch.no_grad():
            reference = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=64,
                min_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert alone.token_ids == reference[0, len(prompt) :].tolist()
        speculated = rt.generate(prompt, max_new_tokens=64, ignore_eos=True, drafter="ngram")
        assert speculated.token_ids == alone.token_ids  # verify calls of several rows


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen2-sliding", "phi4-mini"])
def test_in_place_and_row_by_row_attention_agree(folders, tmp_path, family):
    """Soft-caps, sliding windows and a partial rotary alike on both of attention's paths."""
    target = Bundle.load(_build(folders[family], tmp_path / "b")).role("target")
    assert attention_paths_differ(target) == 0.0


@pytest.mark.parametrize("form", batched.FORMS)
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "qwen2-sliding", "phi4-mini"])
def test_the_gpu_graph_keeps_each_familys_difference(folders, tmp_path, family, form):
    """The batched attention of a GPU build in the build's own check: an fp32 GPU graph must
    score as the CPU graph within the check's tolerance, or the build refuses it."""
    gpu = batched.GpuGraph(form, "fp32")
    out = build_bundle(None, str(folders[family]), tmp_path / "b", max_context=256, gpu=gpu)
    check = Bundle.load(out).manifest["roles"]["target"]["export_check"]
    assert check["gpu_graph_vs_float32"]["max_abs_logit_diff_vs_float32"] <= check["tolerance"]


def test_the_check_refuses_a_gpu_graph_without_the_softcap(folders, tmp_path, monkeypatch):
    """The control: Gemma 2's batched attention without its score softcap is refused."""
    monkeypatch.setattr(batched, "softcap", lambda b, scores, cap: scores)
    gpu = batched.GpuGraph("matmul", "fp32")
    with pytest.raises(SpecrtError, match="GPU graph differs"):
        build_bundle(None, str(folders["gemma2"]), tmp_path / "b", max_context=256, gpu=gpu)


def test_windows_follow_the_config(folders):
    from transformers import AutoConfig

    def windows(folder):
        return family_of(AutoConfig.from_pretrained(folder)).windows()

    assert windows(folders["qwen2-sliding"]) == [None, None, WINDOW, WINDOW]
    assert windows(folders["mistral"]) == [WINDOW] * 4
    assert windows(folders["qwen3"]) == [None] * 4


CONTROLS = {
    "qwen3": ("_head_norm", lambda b, x, *rest: x),  # no q/k norm
    "mistral": ("windows", lambda self: [None] * self.config.num_hidden_layers),
    "qwen2-sliding": ("windows", lambda self: [None] * self.config.num_hidden_layers),
    "llama3": ("rope_tables", None),  # set below: the rotary without llama3's scaling
    "phi3": ("fused", {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("up", "gate")}),
    "phi4-mini": ("rope_tables", None),  # set below: every dim of a head turned
    "gemma2": ("windows", lambda self: [None] * self.config.num_hidden_layers),
    "gemma3": ("_head_norm", lambda b, x, *rest: x),  # no q/k norm
}


def _unscaled_rope(config, capacity, layer_type=None):
    """llama3: the default rotary of the same base; phi4-mini: longrope over whole heads."""
    import copy

    plain = copy.deepcopy(config)
    if config.model_type == "phi3":
        plain.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 1.0}
        plain.rope_parameters["short_factor"] = [1.0, 1.2, 1.5, 2.0] * 2
        plain.rope_parameters["long_factor"] = [1.0, 2.0, 4.0, 8.0] * 2
    else:
        plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    return ORIGINAL_ROPE(plain, capacity, layer_type)


ORIGINAL_ROPE = graph.rope_tables


GEMMA_CONTROLS = {  # Gemma's differences, each removed in turn: (attribute, Llama's value)
    "norm_offset": 0.0,
    "sandwich": False,
    "embed_scale": lambda self: None,
    "attention_scale": Family.attention_scale,
    "attention_softcap": lambda self: None,
    "final_softcap": lambda self: None,
    "activation": Family.activation,
}


@pytest.mark.parametrize("difference", list(GEMMA_CONTROLS))
def test_the_check_refuses_gemma2_without_each_difference(
    folders, tmp_path, monkeypatch, difference
):
    monkeypatch.setattr(Gemma2, difference, GEMMA_CONTROLS[difference])
    with pytest.raises(SpecrtError, match="differ from PyTorch"):
        _build(folders["gemma2"], tmp_path / "b")


def test_the_check_refuses_gemma3_with_one_rope_for_every_layer(folders, tmp_path, monkeypatch):
    monkeypatch.setattr(Gemma3, "rope_key", lambda self, layer: "full_attention")
    with pytest.raises(SpecrtError, match="differ from PyTorch"):
        _build(folders["gemma3"], tmp_path / "b")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_check_refuses_a_graph_without_the_familys_difference(
    folders, tmp_path, monkeypatch, family
):
    name, replacement = CONTROLS[family]
    module = {"fused": Phi3, "windows": Family}.get(name, graph)
    monkeypatch.setattr(module, name, replacement or _unscaled_rope)
    with pytest.raises(SpecrtError, match="differ from PyTorch"):
        _build(folders[family], tmp_path / "b")


def test_an_unsupported_family_names_its_config_field(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, GemmaConfig

    torch.manual_seed(0)
    config = GemmaConfig(**GEMMA)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gemma")
    train_tokenizer().save_pretrained(tmp_path / "gemma")
    with pytest.raises(SpecrtError, match="config.model_type 'gemma' is not supported"):
        _build(tmp_path / "gemma", tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_longrope_past_its_original_length_is_refused(folders, tmp_path):
    """Past original_max_position_embeddings (512 here) longrope switches to its long factors
    for the whole sequence, which a cache built once cannot follow: refused, naming the field."""
    with pytest.raises(SpecrtError, match="rope_parameters: longrope"):
        build_bundle(None, str(folders["phi4-mini"]), tmp_path / "b", max_context=600, log=print)
