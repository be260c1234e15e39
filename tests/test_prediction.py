"""Predicted Outputs: the prediction drafter follows, loses and finds its place again on text
(whatever the tokens split), greedy output stays the target's whatever the prediction, and the
prediction reaches the runtime from the Python API, the CLI and the server."""

from __future__ import annotations

import json
import random

import openai
import pytest
from click.testing import CliRunner
from fixed_costs import flat_costs
from servers import client, serving, wait_healthy

from specrt.cli import cli
from specrt.errors import SpecrtError
from specrt.runtime import Scheduler, SpeculativeRuntime
from specrt.runtime.drafters import Offer
from specrt.runtime.policy import Decision
from specrt.runtime.prediction import PredictionDrafter
from specrt.runtime.prompt_cache import PromptCache
from specrt.runtime.sampling import SamplingParams
from specrt.serve import ServeSettings

TEXT = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"
PROMPT = "def fibonacci(n):"
NEW = 40
WORDY = "import numpy as np\n"  # the tiny llama target writes 27 tokens before its EOS


@pytest.fixture(scope="module")
def rt(bundles) -> SpeculativeRuntime:
    return SpeculativeRuntime.load(bundles["llama"])


def _chars(tokenizer, text: str) -> list[int]:
    """text as one token per character: a split no tokenizer would choose for it."""
    return [tokenizer.encode(c, add_special_tokens=False)[0] for c in text]


def _offered_text(drafter: PredictionDrafter, seq: list[int], tokenizer) -> str:
    offer = drafter.offer(seq, 1000)
    assert offer.source == "prediction"
    proposal = drafter.propose(seq, offer.available, SamplingParams(), None, 0.0)
    assert proposal.probs == [None] * len(proposal.tokens)  # point masses
    return tokenizer.decode(proposal.tokens)


def test_the_drafter_follows_the_prediction_token_by_token(rt):
    tok = rt.tokenizer
    prompt = tok.encode("# geometry\n")
    drafter = PredictionDrafter(TEXT, tok, None)
    drafter.start(prompt, 0, PromptCache())
    ids = tok.encode_spans(TEXT)[0]
    assert drafter.offer(prompt, 1000) == Offer("prediction", len(ids))
    assert drafter.offer(prompt, 4) == Offer("prediction", 4)  # the round's room caps it
    seq = prompt + ids[:5]  # the output took five of them
    assert drafter.offer(seq, 1000) == Offer("prediction", len(ids) - 5)
    assert _offered_text(drafter, seq, tok) == tok.decode(ids[5:])
    used = drafter.offer(prompt + ids, 1000)  # all used: the context lookup's, or nothing
    assert used.source != "prediction" and used.free_ahead == 0


@pytest.mark.parametrize("cut", range(3, len(TEXT)))
def test_after_any_split_of_the_text_the_rest_of_the_prediction_is_offered(rt, cut):
    """The output spells the prediction's first `cut` characters one token per character, so
    it ends on a token boundary of the prediction or inside one of its tokens; either way the
    drafter offers exactly the rest of the text."""
    tok = rt.tokenizer
    prompt = tok.encode("# geometry\n")
    drafter = PredictionDrafter(TEXT, tok, None)
    drafter.start(prompt, 0, PromptCache())
    seq = prompt + _chars(tok, TEXT[:cut])
    assert _offered_text(drafter, seq, tok) == TEXT[cut:]


def test_after_an_edit_the_drafter_finds_its_place_again(rt):
    tok = rt.tokenizer
    prompt = tok.encode("# geometry\n")
    drafter = PredictionDrafter(TEXT, tok, None)
    drafter.start(prompt, 0, PromptCache())
    seq = prompt + tok.encode("def area(w, height):\n    return 0", add_special_tokens=False)
    assert drafter.offer(seq, 1000).source != "prediction"  # no text ending in "0" in it
    seq += tok.encode(" + w * h", add_special_tokens=False)  # back on the prediction's text
    assert _offered_text(drafter, seq, tok) == "eight\n\n\nprint(area(3, 4))\n"


class Fallback:
    """A request's own drafter that records being asked (the draft model's place)."""

    name, model = "fallback", None

    def __init__(self):
        self.asked = 0

    def start(self, prompt, slot, reuse):
        pass

    def offer(self, seq, limit):
        self.asked += 1
        return Offer("model", limit, lag=7)

    def rollback(self, length):
        pass


def test_off_the_prediction_the_context_drafts_before_the_model(rt):
    """Where the prediction has nothing, a lookup in the context proposes for free (the prompt
    quotes the text being edited); the request's own drafter only where that fails too, told
    how much of the prediction lies ahead, so the controller prices its catch-up against the
    few rounds it will draft."""
    tok = rt.tokenizer
    quoted = tok.encode("Edit this:\n```\nx = compute(1, 2)\n```\n", add_special_tokens=False)
    fallback = Fallback()
    drafter = PredictionDrafter(TEXT, tok, fallback)
    drafter.start(quoted, 0, PromptCache())
    seq = quoted + tok.encode("```\nx = compute", add_special_tokens=False)  # not in TEXT
    offer = drafter.offer(seq, 1000)
    assert offer.source == "ngram" and fallback.asked == 0
    proposal = drafter.propose(seq, offer.available, SamplingParams(), None, 0.0)
    assert tok.decode(proposal.tokens).startswith("(1, 2)")
    ahead = len(tok.encode_spans(TEXT)[0])
    assert offer.free_ahead == ahead  # the whole prediction: the output never followed it
    unknown = seq + tok.encode(" zebra", add_special_tokens=False)  # in neither
    assert drafter.offer(unknown, 1000) == Offer("model", 1000, lag=7, free_ahead=ahead)
    assert fallback.asked == 1


def test_a_free_source_ahead_shortens_the_remaining_tokens_the_controller_sees(bundles):
    """The request's RoundContext.remaining is its room less the prediction ahead: a draft
    model's catch-up pays off over the rounds it will draft, not over the whole budget."""
    runtime = SpeculativeRuntime.load(bundles["llama"], calibrate=False)
    seen = []

    class Recording:
        together = False
        confidence_threshold = 0.0

        def decide(self, ctx):
            seen.append(ctx)
            return Decision(0, "recording")

        def observe(self, k, accepted, source):
            pass

    runtime.generate(
        PROMPT, max_new_tokens=8, ignore_eos=True, controller=Recording(), prediction="zebra " * 5
    )
    assert seen and all(ctx.remaining == 1 for ctx in seen)  # 30 tokens ahead, 8 of budget
    seen.clear()
    runtime.generate(PROMPT, max_new_tokens=8, ignore_eos=True, controller=Recording())
    assert [ctx.remaining for ctx in seen] == list(range(7, 0, -1))


ELSEWHERE = "Le renard brun saute par-dessus le chien. 敏捷的棕色狐狸跳过了懒狗。"
PREDICTIONS = {
    "right": lambda text: text,
    "edited": lambda text: text[: len(text) // 2] + " banana " + text[len(text) // 2 :],
    "shuffled": lambda text: " ".join(random.Random(0).sample(text.split(), len(text.split()))),
    "other language": lambda _: (
        "Le renard brun saute par-dessus le chien. 敏捷的棕色狐狸跳过了懒狗。"
    ),
    "empty": lambda _: "",
}


@pytest.mark.parametrize("kind", list(PREDICTIONS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_is_the_targets_whatever_the_prediction(bundles, arch, kind):
    rt = SpeculativeRuntime.load(bundles[arch], calibrate=False)
    rt.costs = flat_costs()  # what adaptive chooses depends on acceptance alone, not the CPU
    alone = rt.generate(PROMPT, max_new_tokens=NEW, speculate=False, ignore_eos=True)
    prediction = PREDICTIONS[kind](alone.text)
    for controller in ("fixed:3", "adaptive"):
        for drafter in ("model", "ngram"):
            spec = rt.generate(
                PROMPT,
                max_new_tokens=NEW,
                prediction=prediction,
                controller=controller,
                drafter=drafter,
                ignore_eos=True,
            )
            assert spec.token_ids == alone.token_ids, (controller, drafter)
            s = spec.stats
            assert s.drafter == "prediction"
            assert len(s.token_origins) == len(spec.token_ids)
            assert s.token_origins.count("prediction") == s.accepted_prediction_tokens
    if kind == "right":
        # Only part of it: a random model's bytes often decode to broken characters that do not
        # tokenize back the same, which real text does (see the benchmark for real models).
        assert s.accepted_prediction_tokens > 0
    if kind in ("other language", "empty"):
        assert s.accepted_prediction_tokens == 0


def test_requests_with_and_without_predictions_share_a_batch(bundles):
    """Each brings its own drafter: the output of each equals it run alone."""
    rt = SpeculativeRuntime.load(bundles["qwen2"], slots=3, calibrate=False)
    rt.costs = flat_costs()
    prompts = [PROMPT, "The quick brown fox", "import numpy as np\n"]
    alone = [rt.generate(p, max_new_tokens=NEW, speculate=False, ignore_eos=True) for p in prompts]
    predictions = [alone[0].text, None, PREDICTIONS["edited"](alone[2].text)]
    scheduler = Scheduler(rt.target, rt.costs, 3)
    generations = [
        rt.sequence(p, max_new_tokens=NEW, ignore_eos=True, prediction=pred)
        for p, pred in zip(prompts, predictions, strict=True)
    ]
    for generation in generations:
        scheduler.add(generation)
    while scheduler.busy:
        scheduler.step()
    for generation, one in zip(generations, alone, strict=True):
        assert generation.result.token_ids == one.token_ids
    assert max(generations[0].result.stats.batch_sizes) == 3
    assert generations[0].result.stats.accepted_prediction_tokens > 0
    assert generations[1].result.stats.drafter == "model"


def test_bad_predictions_are_refused(rt):
    with pytest.raises(SpecrtError, match="prediction must be text"):
        rt.stream(PROMPT, prediction=["not", "text"])
    with pytest.raises(SpecrtError, match="the prediction has .* tokens") as caught:
        rt.stream(PROMPT, prediction="word " * 200)
    assert caught.value.param == "prediction"


def test_the_cli_shows_what_the_prediction_supplied(bundles, tmp_path):
    rt = SpeculativeRuntime.load(bundles["llama"], calibrate=False)
    prompt = WORDY
    alone = rt.generate(prompt, max_new_tokens=NEW, speculate=False)
    guess = tmp_path / "guess.txt"
    guess.write_text(alone.text, encoding="utf-8")
    base = ["generate", str(bundles["llama"]), prompt, "--max-new-tokens", str(NEW)]
    runner = CliRunner()
    out = runner.invoke(cli, [*base, "--prediction-file", str(guess), "--json"])
    assert out.exit_code == 0, out.output
    body = json.loads(out.output)
    assert body["text"] == alone.text
    assert set(body["token_origins"]) <= {"draft", "prediction", "target"}
    assert "prediction" in body["token_origins"]
    assert len(body["token_origins"]) == len(body["token_ids"])
    shown = runner.invoke(cli, [*base, "--prediction-file", str(guess), "--show-accepted"])
    assert shown.exit_code == 0, shown.output
    assert alone.text in shown.stdout  # plain text: the runner is not a terminal
    coloured = runner.invoke(
        cli, [*base, "--prediction-file", str(guess), "--show-accepted"], color=True
    )
    assert "\x1b[36m" in coloured.stdout  # cyan: what the prediction supplied


@pytest.fixture(scope="module")
def server(bundles):
    settings = ServeSettings(bundle=bundles["llama"], model_name="tiny")
    with serving(settings) as (base, _):
        assert wait_healthy(base)["status"] == "ok"
        yield base


def test_the_server_takes_predictions_plain_and_streamed(server, rt):
    api = client(server, timeout=60)
    messages = [{"role": "user", "content": "Say something."}]
    alone = rt.generate(messages, max_new_tokens=NEW, speculate=False)
    guess = {"type": "content", "content": [{"type": "text", "text": alone.text}]}
    reply = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=NEW, temperature=0, prediction=guess
    )
    assert reply.choices[0].message.content == alone.text
    details = reply.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    chunks = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        prediction={"type": "content", "content": "Nothing like it at all."},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone.text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == 0
    plain = rt.generate(WORDY, max_new_tokens=NEW, speculate=False)
    completion = api.completions.create(
        model="tiny",
        prompt=WORDY,
        max_tokens=NEW,
        temperature=0,
        extra_body={"prediction": {"type": "content", "content": plain.text}},
    )
    assert completion.choices[0].text == plain.text
    assert completion.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize(
    "prediction, words",
    [
        ({"type": "content", "content": "word " * 200}, "the prediction has"),
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"content": "x"}, "prediction.type"),
        ("just text", "prediction"),
    ],
)
def test_a_bad_prediction_gets_a_400(server, prediction, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"prediction": prediction},
        )
    error = caught.value.body
    assert error["param"].startswith("prediction") and words in error["message"], error
