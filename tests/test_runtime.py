"""The speculative loop: greedy output is the target's own, token for token; stops cut exactly."""

from __future__ import annotations

import pytest

from specrt.errors import SpecrtError
from specrt.runtime import SpeculativeRuntime

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "User: What is the capital"]
CONTROLLERS = ["fixed:1", "fixed:3", "fixed:8", "heuristic", "adaptive"]


@pytest.fixture(scope="module")
def runtimes(bundles):
    return {
        (arch, backend): SpeculativeRuntime.load(path, backend=backend)
        for arch, path in bundles.items()
        for backend in ("onnxruntime", "torch")
    }


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_target_alone(runtimes, arch, backend):
    rt = runtimes[arch, backend]
    accepted = 0
    for prompt in PROMPTS:
        alone = rt.generate(prompt, max_new_tokens=40, speculate=False, ignore_eos=True)
        assert alone.stats.drafted == 0
        for controller in CONTROLLERS:
            spec = rt.generate(prompt, max_new_tokens=40, controller=controller, ignore_eos=True)
            assert spec.token_ids == alone.token_ids, (prompt, controller)
            assert spec.text == alone.text
            accepted += spec.stats.accepted
    assert accepted > 0  # the rejection and the acceptance paths both ran


def test_always_accepting_draft_emits_k_plus_one_per_call(agree_bundle):
    rt = SpeculativeRuntime.load(agree_bundle)
    alone = rt.generate(PROMPTS[0], max_new_tokens=37, speculate=False, ignore_eos=True)
    spec = rt.generate(PROMPTS[0], max_new_tokens=37, controller="fixed:8", ignore_eos=True)
    assert spec.token_ids == alone.token_ids
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.target_calls == 1 + 4  # prefill, then 4 rounds of 9 tokens


@pytest.fixture(scope="module")
def agree_runtime(agree_bundle):
    return SpeculativeRuntime.load(agree_bundle)


@pytest.fixture(scope="module")
def reference(agree_runtime):
    """The target's own 60 greedy tokens; with fixed:8 they arrive in blocks of 9."""
    return agree_runtime.generate(PROMPTS[1], max_new_tokens=60, speculate=False, ignore_eos=True)


def test_max_new_tokens_inside_an_accepted_block(agree_runtime, reference):
    for limit in (1, 2, 7, 13, 23):
        result = agree_runtime.generate(
            PROMPTS[1], max_new_tokens=limit, controller="fixed:8", ignore_eos=True
        )
        assert result.token_ids == reference.token_ids[:limit]
        assert result.finish_reason == "length"


def test_eos_inside_an_accepted_block(agree_runtime, reference):
    ids = reference.token_ids
    position = next(i for i in range(5, 60) if ids[i] not in ids[:i] and i % 9 not in (0, 8))
    agree_runtime.eos_token_ids = frozenset({ids[position]})  # as if that token were EOS
    try:
        result = agree_runtime.generate(PROMPTS[1], max_new_tokens=60, controller="fixed:8")
    finally:
        agree_runtime.eos_token_ids = frozenset(agree_runtime.bundle.eos_token_ids)
    assert result.finish_reason == "eos"
    assert result.token_ids == ids[: position + 1]


def test_stop_string_inside_an_accepted_block(agree_runtime, reference):
    text = reference.text
    stop = text[20:24]
    assert stop and text.find(stop) == 20
    streamed = agree_runtime.stream(
        PROMPTS[1], max_new_tokens=60, controller="fixed:8", stop=[stop], ignore_eos=True
    )
    deltas = list(streamed)
    result = streamed.result
    assert result.finish_reason == "stop"
    assert result.text == text[:20]
    assert "".join(deltas) == text[:20]  # nothing of the stop string leaked into the stream
    assert len(result.token_ids) < len(reference.token_ids)
    assert result.token_ids == reference.token_ids[: len(result.token_ids)]


def test_stream_deltas_join_to_the_text(agree_runtime, reference):
    generation = agree_runtime.stream(PROMPTS[1], max_new_tokens=60, ignore_eos=True)
    assert "".join(generation) == reference.text == generation.result.text


def test_chat_messages_use_the_template(runtimes):
    rt = runtimes["qwen2", "onnxruntime"]
    messages = [{"role": "user", "content": "hi"}]
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert rt.encode(messages) == rt.tokenizer.encode(rendered, add_special_tokens=False)
    assert rt.generate(messages, max_new_tokens=5).stats.prompt_tokens == len(rt.encode(messages))


@pytest.mark.parametrize("controller", ["fixed:4", "heuristic"])
def test_sampling_is_reproducible_with_a_seed(runtimes, controller):
    """Reproducible wherever the sequence of K is (adaptive K follows wall-clock costs)."""
    rt = runtimes["llama", "onnxruntime"]
    options = dict(
        max_new_tokens=30,
        temperature=0.9,
        top_p=0.95,
        top_k=50,
        controller=controller,
        ignore_eos=True,
    )
    a = rt.generate(PROMPTS[0], seed=11, **options)
    b = rt.generate(PROMPTS[0], seed=11, **options)
    c = rt.generate(PROMPTS[0], seed=12, **options)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be a whole number >= 0"),
        (dict(controller="fixed:9"), r"K must be in 0..8 \(the bundle's K_max\)"),
        (dict(controller="greedy"), "unknown controller"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ],
)
def test_invalid_parameters_are_clear_errors(runtimes, options, message):
    with pytest.raises(SpecrtError, match=message):
        runtimes["llama", "onnxruntime"].generate("hello", **options)


def test_prompt_past_the_context_is_refused(runtimes):
    rt = runtimes["llama", "onnxruntime"]
    with pytest.raises(SpecrtError, match="max context is 128"):
        rt.generate(list(range(3, 3 + 128)))
    with pytest.raises(SpecrtError, match="prompt is empty"):
        rt.generate("")


def test_generation_stops_when_the_context_is_full(runtimes):
    rt = runtimes["llama", "onnxruntime"]
    result = rt.generate(list(range(3, 3 + 120)), max_new_tokens=50)
    assert result.finish_reason in ("context", "eos")
    assert len(result.token_ids) <= 128 - 120 + 1
