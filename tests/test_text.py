"""Text without transformers: same chat prompts, streaming never splits a character, and the
sampling transform does what its parameters say."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from specrt.runtime.acceptance import residual
from specrt.runtime.sampling import SamplingParams, probabilities
from specrt.runtime.text import IncrementalDecoder, TextTokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a function that reverses a string."},
]


@pytest.fixture(scope="module")
def tokenizers(pairs):
    folder = pairs["qwen2"][1]
    reference = AutoTokenizer.from_pretrained(folder)
    return TextTokenizer(folder, reference.chat_template), reference


def test_chat_template_matches_transformers(tokenizers):
    lean, reference = tokenizers
    want = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert lean.render_chat(MESSAGES) == want


def test_encode_and_decode_match_transformers(tokenizers):
    lean, reference = tokenizers
    text = "def reverse(text: str) -> str:\n    return text[::-1]  # ünïcödé ✓"
    assert lean.encode(text) == reference(text).input_ids
    assert lean.decode(lean.encode(text)) == reference.decode(reference(text).input_ids)


def test_incremental_decoding_never_splits_characters(tokenizers):
    lean, _ = tokenizers
    text = "naïve café ✓ — 東京 🙂 end"
    decoder = IncrementalDecoder(lean)
    deltas = [decoder.push(token) for token in lean.encode(text)]
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_a_prompt_past_its_limit_is_counted_no_further(tokenizers):
    """count_past: a text far past the limit gets a count above the limit and never above its
    true count, from its first pieces; one that fits, however long in characters, gets None
    (it is tokenized whole), and encode_prompt with that limit gives its tokens."""
    from specrt.runtime.text import SCAN_PIECE, PastLimit

    lean, _ = tokenizers
    code = "def reverse(s):\n    return s[::-1]  # the whole string, backwards\n\n"
    for text in (code * 40_000, "word " * 300_000, "w" * 3 * SCAN_PIECE):
        past = lean.count_past(text, 2000)
        assert past is not None and 2000 < past <= len(lean.encode(text)), text[:20]
        with pytest.raises(PastLimit):
            lean.encode_prompt(text, limit=2000)
    fits = "return " * 1000  # seven characters a token in this vocabulary
    tokens = len(lean.encode(fits, add_special_tokens=False))
    assert len(fits) > 4 * tokens and lean.count_past(fits, tokens) is None
    assert lean.encode_prompt(fits, limit=tokens + 5) == lean.encode(fits)
    short = "word " * 100  # 200 tokens, but too short to scan: tokenized whole, refused then
    assert len(lean.encode(short)) > 150 and lean.count_past(short, 150) is None


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    plain = probabilities(logits, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(plain, [0.5, 0.2, 0.15, 0.1, 0.05])
    top2 = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(top2, [5 / 7, 2 / 7, 0, 0, 0])
    nucleus = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    np.testing.assert_allclose(nucleus, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    np.testing.assert_allclose(hot, np.sqrt(plain) / np.sqrt(plain).sum())
    floor = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.3))  # >= 0.15
    np.testing.assert_allclose(floor, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    both = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.3, top_p=0.6))
    np.testing.assert_allclose(both, [0.5 / 0.85 / (0.7 / 0.85), 0.2 / 0.7, 0, 0, 0])


def test_residual_is_what_the_target_still_owes():
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.6, 0.2])
    np.testing.assert_allclose(residual(p, q), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(residual(p, p), p)  # nothing owed: any draw from p is right
