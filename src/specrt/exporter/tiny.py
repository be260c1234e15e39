"""Tiny draft/target model pairs for tests and the offline demo.

Real models cannot be fetched from a hub on every machine, but the export and runtime paths must
be exercised end to end on real transformers models with a real tokenizer. These pairs are built
from a config with a fixed seed, save as ordinary Hugging Face folders and load in milliseconds.

The draft is the target's first layers (same embeddings, norm and head), so the two agree often
enough for speculation to accept tokens, yet not always: both code paths of the loop get exercised.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = Path(__file__).with_name("data") / "corpus.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (  # ChatML, with tools and tool calls written as Qwen2.5 writes them (Hermes)
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each function call, return a JSON object with function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# What each tiny architecture sets beyond the shared shape, as its family's published models do.
ARCHITECTURES = {
    "llama": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
}
# What every tiny model shares (tests of other families build theirs from it too).
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # peaked distributions: greedy choices are not near-ties
    bos_token_id=None,
)


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE trained on the corpus the package ships (deterministic, offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(arch: str, vocab_size: int, layers: int, eos_ids: list[int]):
    from transformers import AutoConfig

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {tuple(ARCHITECTURES)}")
    return AutoConfig.for_model(
        arch,
        **TINY_SHAPE,
        **ARCHITECTURES[arch],
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        eos_token_id=eos_ids,
    )


def make_tiny_pair(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    layers: tuple[int, int] = (2, 4),
    special_tokens: tuple[str, ...] = (),
):
    """Write `draft/` and `target/` HF folders (layers: draft, target) under out_dir.

    vocab_size, when given, skips the tokenizer and builds models over that many token ids: the
    statistical tests need a vocabulary small enough to enumerate exact distributions.
    special_tokens: more special tokens for the tokenizer, as a family's vocabulary has them
    (Mistral's [TOOL_CALLS]).
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    tokenizer = None if vocab_size else train_tokenizer()
    if tokenizer is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
        vocab_size = len(tokenizer)
        eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    else:
        eos_ids = [0]
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(_config(arch, vocab_size, layers[1], eos_ids))
    draft = AutoModelForCausalLM.from_config(_config(arch, vocab_size, layers[0], eos_ids))
    draft.load_state_dict(target.state_dict(), strict=False)  # shared prefix of layers
    paths = {}
    for role, model in (("draft", draft), ("target", target)):
        path = out / role
        model.eval().save_pretrained(path)
        model.generation_config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        paths[role] = path
    return paths["draft"], paths["target"]
