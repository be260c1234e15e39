"""Speculative sampling keeps the target's distribution exactly: a chi-square test.

Real ONNX Runtime engines run tiny models over an 8-token vocabulary, so the exact distribution
of the next 4 tokens (8^4 sequences) is computable from the target alone. 20,000 seeded samples
through the speculative loop (the first token from the prefill, then rounds of up to K = 2
drafts, so acceptance, residual and bonus draws all occur) must fit it, for a good draft and a
bad one, under temperature, top-k and top-p, and for lookup (n-gram) drafts, which are point
masses, for a prediction that is half right (point masses too), and for a request sampled
inside a batch beside another request, and for a constrained request (a grammar whose mask
changes row by row, logit_bias and both penalties), whose exact distribution is worked out by
hand. The same test must
fail when the residual rule is broken, when a lookup draft is taken for certain, or when the
verify rows' penalties ignore the drafts before them, or it would prove nothing.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specrt.runtime.acceptance as acceptance
import specrt.runtime.speculative as speculative
from specrt.bundle import CACHE_MARGIN
from specrt.engines.onnxruntime import OrtEngine
from specrt.exporter.graph import write_graph
from specrt.exporter.tensors import open_weights
from specrt.exporter.tiny import make_tiny_pair
from specrt.runtime.constraints import Constraints
from specrt.runtime.controller import Adaptive, Fixed
from specrt.runtime.costs import StepCosts
from specrt.runtime.drafters import ConstrainedDrafter, ModelDrafter, NgramDrafter
from specrt.runtime.grammar import Grammars, Structure
from specrt.runtime.prediction import PredictionDrafter
from specrt.runtime.sampling import SamplingParams, probabilities
from specrt.runtime.sequence import Sequence
from specrt.runtime.speculative import prefill, speculate, start
from specrt.runtime.stops import StopRules
from specrt.runtime.text import TextTokenizer
from specrt.sources import Source

VOCAB, NEW, SAMPLES, CAPACITY = 8, 4, 20_000, 16
PROMPT = [1, 5, 3]
PARAMS = {
    "temperature": SamplingParams(temperature=1.5),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=0.8, top_p=0.7),
    "min_p": SamplingParams(temperature=1.2, min_p=0.3),
}


def _engine(folder, out, head_scale: float = 1.0, vocab: int = VOCAB) -> OrtEngine:
    """An engine over a tiny model; head_scale < 1 softens its distribution (same ranking).
    vocab other than VOCAB pads its logits (new rows from the seed) or cuts them short, as real
    pairs' logits are padded differently past their shared tokenizer's ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    model.lm_head.weight.data *= head_scale
    if vocab != VOCAB:
        torch.manual_seed(1)
        model.resize_token_embeddings(vocab, mean_resizing=False)
    scaled = out.with_name(f"{out.name}-model")
    model.save_pretrained(scaled)
    out.mkdir()
    shape = write_graph(open_weights(Source.parse(str(scaled))), out, CAPACITY + CACHE_MARGIN)
    return OrtEngine(
        out / "model.onnx",
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=vocab,
        capacity=CAPACITY,
        margin=CACHE_MARGIN,
        slots=2,
        threads=1,
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The target; a good draft (the target, softened); a bad one (an unrelated model)."""
    root = tmp_path_factory.mktemp("vocab8")
    _, target = make_tiny_pair(root / "pair", "llama", vocab_size=VOCAB, layers=(1, 2))
    _, unrelated = make_tiny_pair(root / "other", "qwen2", seed=5, vocab_size=VOCAB, layers=(1, 1))
    return {
        "target": _engine(target, root / "target_graph"),
        "good": _engine(target, root / "good_graph", head_scale=0.7),
        "bad": _engine(unrelated, root / "bad_graph"),
        "padded": _engine(target, root / "padded_graph", head_scale=0.7, vocab=VOCAB + 3),
        "short": _engine(target, root / "short_graph", head_scale=0.7, vocab=VOCAB - 2),
    }


def exact_distribution(
    target: OrtEngine, params: SamplingParams, process=None, prompt=PROMPT
) -> np.ndarray:
    """P(t1..t4 | prompt) for every one of the 8^4 sequences, by the chain rule; process(logits,
    output so far) is what a constrained request does to the target's logits."""
    process = process or (lambda logits, output: logits)
    target.reset()
    first = probabilities(process(target.forward(prompt, last=1)[0], ()), params)
    joint = np.zeros([VOCAB] * NEW)
    for prefix in itertools.product(range(VOCAB), repeat=NEW - 1):
        if not first[prefix[0]]:
            continue  # a first token that never occurs (a constraint forbids it)
        target.rollback(len(prompt))
        logits = target.forward(list(prefix))
        rows = [probabilities(process(logits[i], prefix[: i + 1]), params) for i in range(NEW - 1)]
        chain = first[prefix[0]] * np.prod([rows[i][prefix[i + 1]] for i in range(NEW - 2)])
        joint[prefix] = chain * rows[NEW - 2]
    return joint.ravel()


def _sequence(prompt, params, new, rng, policy, drafter, slot, constraints=None) -> Sequence:
    """A sequence in its slot, driven round by round below the scheduler (no text: no
    tokenizer for its stop rules)."""
    stops = StopRules(None, (), frozenset(), new)
    sequence = Sequence(
        prompt, params, rng, stops, policy=policy, drafter=drafter, constraints=constraints
    )
    sequence.slot = slot
    return sequence


def sample_counts(
    drafter,
    target,
    params,
    controller_factory,
    seed=0,
    neighbour=None,
    constrain=None,
    prompt=PROMPT,
):
    """Histogram of SAMPLES speculative 4-token outputs, and the draft's acceptance rate.

    neighbour: a function of the rng giving another request that runs in the same rounds, in
    the slot before this one (its own parameters, drafts and K); constrain: a function giving
    each request its constraints (the drafter then drafts within them)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(VOCAB**NEW)
    weights = VOCAB ** np.arange(NEW - 1, -1, -1)
    costs, drafted, accepted = StepCosts(), 0, 0
    for _ in range(SAMPLES):
        constraints = constrain() if constrain else None
        source = ConstrainedDrafter(drafter, constraints) if constraints else drafter
        request = _sequence(prompt, params, NEW, rng, controller_factory(), source, 1, constraints)
        batch = [request] if neighbour is None else [neighbour(rng), request]
        for r in batch:
            start(r, target)
            prefill(r, target)
        while live := [r for r in batch if r.room(target.capacity) >= 0]:
            step = speculate(live, target, costs)
            if request in live:
                drafted += step.drafted[live.index(request)]
                accepted += step.accepted[live.index(request)]
        counts[int(np.dot(request.tokens[len(prompt) :][:NEW], weights))] += 1
    return counts, accepted / drafted


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test, cells with expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


@pytest.mark.parametrize("draft", ["good", "bad"])
@pytest.mark.parametrize("setting", list(PARAMS))
def test_speculative_sampling_matches_the_target(engines, draft, setting):
    params = PARAMS[setting]
    exact = exact_distribution(engines["target"], params)
    counts, acceptance_rate = sample_counts(
        ModelDrafter(engines[draft]), engines["target"], params, lambda: Fixed(2)
    )
    assert chi_square_p(counts, exact) > 1e-3
    # Both regimes really occur: a good draft is mostly accepted, a bad one mostly rejected.
    assert acceptance_rate > 0.7 if draft == "good" else acceptance_rate < 0.55


@pytest.mark.parametrize("draft", ["padded", "short"])
def test_a_draft_with_other_logit_padding_stays_lossless(engines, draft):
    """A draft with 3 logits past the target's (told the target's ids, it proposes none of
    them) or 2 short of them (it never proposes those, and is fed a placeholder when the target
    emits one) still gives the target's exact distribution."""
    params = PARAMS["temperature"]
    exact = exact_distribution(engines["target"], params)
    counts, acceptance_rate = sample_counts(
        ModelDrafter(engines[draft], ids=VOCAB), engines["target"], params, lambda: Fixed(2)
    )
    assert chi_square_p(counts, exact) > 1e-3 and acceptance_rate > 0.3


def test_a_windowed_draft_stays_lossless(engines):
    """A draft that reads only the prompt's first SINKS tokens and its last one (a window of
    5 over 9) proposes from another distribution, which is its q all the same."""
    params, prompt = PARAMS["temperature"], [1, 5, 3, 2, 6, 4, 7, 1, 2]
    exact = exact_distribution(engines["target"], params, prompt=prompt)
    counts, acceptance_rate = sample_counts(
        ModelDrafter(engines["good"], window=5),
        engines["target"],
        params,
        lambda: Fixed(2),
        prompt=prompt,
    )
    assert chi_square_p(counts, exact) > 1e-3 and 0.3 < acceptance_rate < 0.95


def test_adaptive_early_stopping_stays_lossless(engines):
    """K chosen from the draft's own confidence (and timings) must not bias the output."""
    params = PARAMS["temperature"]
    exact = exact_distribution(engines["target"], params)
    counts, _ = sample_counts(
        ModelDrafter(engines["good"]),
        engines["target"],
        params,
        lambda: Adaptive(confidence_threshold=0.5),
    )
    assert chi_square_p(counts, exact) > 1e-3


def test_the_test_catches_a_broken_residual(engines, monkeypatch):
    """Sampling the correction from p instead of normalize(max(0, p - q)) skews the output."""
    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)
    params = PARAMS["temperature"]
    exact = exact_distribution(engines["target"], params)
    counts, _ = sample_counts(
        ModelDrafter(engines["bad"]), engines["target"], params, lambda: Fixed(2)
    )
    assert chi_square_p(counts, exact) < 1e-6


@pytest.mark.parametrize("setting", ["temperature", "top_p"])
def test_lookup_drafts_are_point_masses_and_stay_lossless(engines, setting):
    """An n-gram draft is q = one-hot(x): accepted with probability p(x), and on rejection the
    next token comes from p without x. Over 8 tokens, 1-grams match nearly every round."""
    params = PARAMS[setting]
    exact = exact_distribution(engines["target"], params)
    counts, acceptance_rate = sample_counts(
        NgramDrafter(min_n=1, max_n=2), engines["target"], params, lambda: Fixed(2)
    )
    assert chi_square_p(counts, exact) > 1e-3
    assert 0.05 < acceptance_rate < 0.95  # both acceptance and rejection really occur


@pytest.fixture(scope="module")
def letters(tmp_path_factory) -> TextTokenizer:
    """A real tokenizer whose 8 tokens are the letters a..h, one character each, so that a
    prediction over this vocabulary is text like any other."""
    from tokenizers import Tokenizer, decoders, models

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    folder = tmp_path_factory.mktemp("letters")
    tokenizer.save(str(folder / "tokenizer.json"))
    return TextTokenizer(folder, None)


def test_a_half_right_prediction_stays_lossless(engines, letters):
    """The prediction is the likeliest 4-token output's first two tokens, then the two least
    likely: its drafts are point masses, accepted with probability p(x) and often rejected."""
    params = PARAMS["temperature"]
    exact = exact_distribution(engines["target"], params)
    likeliest = np.unravel_index(exact.argmax(), [VOCAB] * NEW)
    unlikeliest = np.unravel_index(exact.argmin(), [VOCAB] * NEW)
    guess = "".join("abcdefgh"[int(t)] for t in [*likeliest[:2], *unlikeliest[2:]])
    counts, acceptance_rate = sample_counts(
        PredictionDrafter(guess, letters, None), engines["target"], params, lambda: Fixed(2)
    )
    assert chi_square_p(counts, exact) > 1e-3
    assert 0.05 < acceptance_rate < 0.95  # both acceptance and rejection really occur


def test_the_test_catches_a_point_mass_taken_for_certain(engines, monkeypatch):
    """Control: accepting a lookup draft outright (as if p(x) were 1) skews the output."""
    real = acceptance.verify_sampled

    def accept_lookups(drafts, draft_probs, logits, params, rng):
        if drafts and all(q is None for q in draft_probs):
            return len(drafts), real([], [], logits[len(drafts) :], params, rng)[1]
        return real(drafts, draft_probs, logits, params, rng)

    monkeypatch.setattr(speculative, "verify_sampled", accept_lookups)
    params = PARAMS["temperature"]
    exact = exact_distribution(engines["target"], params)
    counts, _ = sample_counts(
        NgramDrafter(min_n=1, max_n=2), engines["target"], params, lambda: Fixed(2)
    )
    assert chi_square_p(counts, exact) < 1e-6


def test_a_request_sampled_inside_a_batch_keeps_the_target_distribution(engines):
    """Beside it, a request with other sampling parameters, a lookup drafter, its own K and
    budget shares every draft and verify call; the first request's output must not care."""
    params = PARAMS["top_k"]
    exact = exact_distribution(engines["target"], params)

    def neighbour(rng):
        other = SamplingParams(temperature=0.7)
        return _sequence([2, 6, 2, 6], other, 6, rng, Fixed(1), NgramDrafter(min_n=1), 0)

    counts, _ = sample_counts(
        ModelDrafter(engines["good"]),
        engines["target"],
        params,
        lambda: Fixed(2),
        neighbour=neighbour,
    )
    assert chi_square_p(counts, exact) > 1e-3


# Pairs of letters, each "a" then one of b..g, or one of b..g then one of a..d; "h" is EOS and
# the language needs 6 letters, so it is never allowed within 4 tokens. Which letters may come
# next depends on the position and the letter before: the mask changes row by row.
PAIRS = "(a[b-g]|[b-g][a-d]){3,}"
FORCED_PAIRS = "(ab|[c-g][a-d]){3,}"  # after "a", "b" is forced: drafted for free
BIAS = {2: 1.5, 4: -1.0}
PRESENCE, FREQUENCY = 0.8, 0.5


def _pairs_allowed(output, grammar: str) -> np.ndarray:
    """The letters a grammar allows after output, worked out by hand (not by the engine)."""
    allowed = np.zeros(VOCAB, dtype=bool)
    forced = grammar == FORCED_PAIRS
    if len(output) % 2 == 0:
        allowed[:7] = True  # a pair starts: any of a..g...
        allowed[1] = allowed[1] and not forced  # ...but b, in FORCED_PAIRS
    elif output[-1] == 0:
        allowed[1 : 2 if forced else 7] = True  # after "a": b..g, or b alone
    else:
        allowed[:4] = True  # after one of b..g: a..d
    return allowed


def _constrained(grammar: str):
    """The grammar, BIAS and the penalties applied to logits after output, by hand."""

    def process(logits: np.ndarray, output) -> np.ndarray:
        out = logits.astype(np.float64).copy()
        for token, bias in BIAS.items():
            out[token] += bias
        for token in set(output):
            out[token] -= FREQUENCY * list(output).count(token) + PRESENCE
        out[~_pairs_allowed(output, grammar)] = -np.inf
        return out

    return process


def _pair_constraints(grammars: Grammars, regex: str = PAIRS) -> Constraints:
    grammar = grammars.compile(Structure("regex", regex))
    return Constraints(
        grammar, logit_bias=BIAS, presence_penalty=PRESENCE, frequency_penalty=FREQUENCY
    )


@pytest.fixture(scope="module")
def pair_grammars(tmp_path_factory) -> Grammars:
    """The grammar engine over a byte-level tokenizer whose 8 tokens are the letters a..h."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    folder = tmp_path_factory.mktemp("pair-letters")
    tokenizer.save(str(folder / "tokenizer.json"))
    return Grammars(folder / "tokenizer.json", VOCAB, [7])


@pytest.mark.parametrize(
    ("draft", "regex"),
    [("good", PAIRS), ("bad", PAIRS), ("ngram", PAIRS), ("good", FORCED_PAIRS)],
)
def test_constrained_sampling_keeps_the_constrained_target_distribution(
    engines, pair_grammars, draft, regex
):
    """Under a grammar, logit_bias and both penalties, the target's distribution at each
    position is its processed one; speculation (model drafts within the grammar, lookups cut
    where it refuses them, forced tokens ahead of and among model drafts) must sample exactly
    that, computed here by hand."""
    params = PARAMS["temperature"]
    exact = exact_distribution(engines["target"], params, _constrained(regex))

    drafter = NgramDrafter(min_n=1, max_n=2) if draft == "ngram" else ModelDrafter(engines[draft])
    counts, acceptance_rate = sample_counts(
        drafter,
        engines["target"],
        params,
        lambda: Fixed(2),
        constrain=lambda: _pair_constraints(pair_grammars, regex),
    )
    assert chi_square_p(counts, exact) > 1e-3
    assert 0.05 < acceptance_rate < 0.98  # both acceptance and rejection really occur


def test_the_test_catches_penalties_blind_to_the_drafts(engines, pair_grammars, monkeypatch):
    """Control: verify rows whose penalties count only the emitted output, not the drafts
    before each row (each row still masked at its own position), must fail the same test."""

    def stale(self, rows, drafts):
        emitted, out = Counter(self.counts), np.empty(rows.shape, dtype=np.float32)
        for i, row in enumerate(rows):
            walked, self.counts = self.counts, emitted
            out[i] = self.apply(row)
            self.counts = walked
            self.advance(drafts[i : i + 1])
        return out

    monkeypatch.setattr(Constraints, "apply_rows", stale)
    params = PARAMS["temperature"]
    exact = exact_distribution(engines["target"], params, _constrained(PAIRS))
    counts, _ = sample_counts(
        ModelDrafter(engines["good"]),
        engines["target"],
        params,
        lambda: Fixed(2),
        constrain=lambda: _pair_constraints(pair_grammars),
    )
    assert chi_square_p(counts, exact) < 1e-6
