"""Drafters: the n-gram lookup finds what it should, every drafter keeps greedy output equal to
the target alone, and bundles without a draft model build and run everywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import openai
import pytest
from servers import client, serving

from specrt.bundle import Bundle
from specrt.errors import SpecrtError
from specrt.exporter.build import build_bundle
from specrt.runtime import SpeculativeRuntime
from specrt.runtime.drafters import HybridDrafter, ModelDrafter, NgramDrafter, Offer, lookup
from specrt.runtime.drafting import DraftJob, draft_together
from specrt.runtime.sampling import SamplingParams
from specrt.serve import ServeSettings
from specrt.tools.bench import run_bench

# A prompt whose continuation repeats what it already holds, so lookups find matches.
REPEATING = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("


@pytest.mark.parametrize(
    "seq, min_n, max_n, limit, want",
    [
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 3, 8, [7, 5, 1, 2, 3]),  # most recent match
        ([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 3, 2, [7, 5]),  # at most limit tokens
        ([5, 6, 7, 1, 8, 6, 7, 2, 5, 6, 7], 2, 3, 4, [1, 8, 6, 7]),  # the longer n wins
        ([5, 6, 7, 1, 8, 6, 7, 2, 5, 6, 7], 2, 2, 4, [2, 5, 6, 7]),  # ...over a recent 2-gram
        ([1, 2, 3, 4, 5], 1, 3, 4, []),  # nothing repeats
        ([4, 4, 4, 4], 1, 2, 4, [4]),  # the match may run into the suffix itself
        ([1, 2], 2, 4, 4, []),  # too short to hold an earlier match
        ([1, 2, 1], 1, 4, 0, []),  # no room
    ],
)
def test_lookup(seq, min_n, max_n, limit, want):
    assert lookup(seq, min_n, max_n, limit) == want


@pytest.fixture(scope="module")
def runtimes(bundles):
    return {arch: SpeculativeRuntime.load(path) for arch, path in bundles.items()}


def drafters(rt: SpeculativeRuntime, name: str):
    """Tiny random models never copy their context, so 2-gram lookups would never propose;
    1-grams do (and are mostly rejected), which is what exactness needs to be tested."""
    unigrams = NgramDrafter(min_n=1, max_n=3)
    return unigrams if name == "ngram" else HybridDrafter(ModelDrafter(rt.draft), unigrams)


class Oracle(NgramDrafter):
    """A lookup that is always right where it offers (on every other round): the target's own
    continuation, as a perfect prediction would be. Accepted lookups are the path that tiny
    random models cannot reach by themselves."""

    def __init__(self, prompt_length: int, continuation: list[int]):
        super().__init__()
        self.prompt_length, self.continuation, self.rounds = prompt_length, continuation, 0

    def offer(self, seq, limit):
        self.rounds += 1
        done = len(seq) - self.prompt_length
        self._found = self.continuation[done : done + limit] if self.rounds % 2 else []
        return Offer("ngram", len(self._found))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_greedy_equals_target_alone_with_every_drafter(runtimes, arch, drafter):
    rt = runtimes[arch]
    drafted = {}
    for prompt in (REPEATING, "The quick brown fox"):
        alone = rt.generate(prompt, max_new_tokens=40, speculate=False, ignore_eos=True)
        for controller in ("fixed:3", "heuristic", "adaptive"):
            spec = rt.generate(
                prompt,
                max_new_tokens=40,
                drafter=drafters(rt, drafter),
                controller=controller,
                ignore_eos=True,
            )
            assert spec.token_ids == alone.token_ids, (prompt, controller)
            for source, count in zip(spec.stats.sources, spec.stats.drafted_counts, strict=True):
                drafted[source] = drafted.get(source, 0) + count
            assert spec.stats.drafter == drafter
    assert drafted.get("ngram", 0) > 0  # lookups really proposed
    if drafter == "hybrid":
        assert drafted.get("model", 0) > 0  # and the model filled in where they found nothing


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_accepted_lookups_and_the_model_catching_up_after_them(runtimes, arch):
    """Hybrid with a lookup that is right on every other round: long accepted blocks, then the
    draft model catches up over them; the output stays the target's own."""
    rt = runtimes[arch]
    ids = rt.encode(REPEATING)
    alone = rt.generate(ids, max_new_tokens=50, speculate=False, ignore_eos=True)
    oracle = Oracle(len(ids), alone.token_ids)
    spec = rt.generate(
        ids,
        max_new_tokens=50,
        drafter=HybridDrafter(ModelDrafter(rt.draft), oracle),
        controller="fixed:6",
        ignore_eos=True,
    )
    assert spec.token_ids == alone.token_ids
    s = spec.stats
    rounds = list(zip(s.sources, s.drafted_counts, s.accepted_counts, strict=True))
    assert {s for s, _, _ in rounds} - {"none"} == {"ngram", "model"}  # none: the last round
    assert all(d == a for s, d, a in rounds if s == "ngram")  # every lookup accepted in full
    assert max(d for s, d, _ in rounds if s == "ngram") == 6


def test_a_batched_draft_reports_each_step_by_its_rows(bundles):
    """The draft's cost curve is refined per batched step by the rows it carried: the first
    step feeds each request what the draft model has not read (two tokens after a round that
    kept every draft) and is padded to the widest, the later ones one token a request."""
    rt = SpeculativeRuntime.load(bundles["llama"], slots=2, threads=1, calibrate=False)
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    jobs = []
    for slot, (seq, behind) in enumerate(zip(seqs, (2, 1), strict=True)):
        drafter = ModelDrafter(rt.draft)
        drafter.start(seq, slot, None)
        rt.draft.forward_rows([(slot, seq[:-behind])], last=1)
        assert drafter.offer(seq, 8).lag == behind
        jobs.append(DraftJob(drafter, seq, 3, SamplingParams(), np.random.default_rng(0)))
    proposals, steps = draft_together(jobs)
    assert [len(p.tokens) for p in proposals] == [3, 3]
    assert [rows for rows, _ in steps] == [4, 2, 2]
    assert all(seconds > 0 for _, seconds in steps)
    # A request far behind catches up in a call of its own, reported first by its rows, so
    # that a catch-up is priced on measured calls of its size, not extrapolated from 33.
    rt.draft.reset(0)
    jobs[1].drafter.rollback(len(seqs[1]) - 1)  # one token behind again
    far = [*range(20, 60), 7]
    jobs = [
        DraftJob(job.drafter, seq, 2, SamplingParams(), np.random.default_rng(0))
        for job, seq in zip(jobs, (far, seqs[1]), strict=True)
    ]
    _, steps = draft_together(jobs)
    assert [rows for rows, _ in steps] == [len(far) - 1, 2, 2]
    # Alone, it reads them all in its first step: a call of its own would pad no other row,
    # and cost a call (a resume after a stop: 44 ms in two calls, 30 ms in one).
    rt.draft.reset(0)
    alone = DraftJob(jobs[0].drafter, far, 2, SamplingParams(), np.random.default_rng(0))
    _, steps = draft_together([alone])
    assert [rows for rows, _ in steps] == [len(far), 1]


def test_lookup_drafters_by_name(runtimes):
    rt = runtimes["llama"]
    result = rt.generate(REPEATING, max_new_tokens=12, drafter="hybrid")
    assert result.stats.drafter == "hybrid"
    with pytest.raises(SpecrtError, match="unknown drafter"):
        rt.generate(REPEATING, drafter="psychic")


@pytest.fixture(scope="module")
def short_target(pairs, tmp_path_factory):
    """The tiny llama target with a 512-position limit."""
    folder = tmp_path_factory.mktemp("short") / "target"
    shutil.copytree(pairs["llama"][1], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    return folder


@pytest.fixture(scope="module")
def target_only(short_target, tmp_path_factory):
    """Built without --draft and without --max-context."""
    out = tmp_path_factory.mktemp("target_only") / "bundle"
    done = subprocess.run(
        [sys.executable, "-m", "specrt.cli", "build", "--target", str(short_target)]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return out


def test_a_target_only_bundle_builds_inspects_and_generates(target_only):
    bundle = Bundle.load(target_only)
    assert not bundle.has_draft and bundle.roles == ["target"]
    assert bundle.max_context == 512  # the model's own limit, under the 2048 default
    assert bundle.precision_label == "t-fp32"
    shown = subprocess.run(
        [sys.executable, "-m", "specrt.cli", "inspect", str(target_only)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "lookup (n-gram) drafts" in shown.stdout and "max context 512" in shown.stdout

    common = ["generate", str(target_only), REPEATING, "--max-new-tokens", "24", "--json"]
    run = [sys.executable, "-m", "specrt.cli", *common]
    spec = json.loads(subprocess.run(run, capture_output=True, text=True, timeout=120).stdout)
    alone = subprocess.run([*run, "--no-speculation"], capture_output=True, text=True, timeout=120)
    assert spec["token_ids"] == json.loads(alone.stdout)["token_ids"]
    assert spec["stats"]["drafter"] == "ngram"

    rt = SpeculativeRuntime.load(target_only)
    with pytest.raises(SpecrtError, match="needs a draft model"):
        rt.generate("hi", drafter="hybrid")


def test_bench_and_serve_take_a_target_only_bundle(target_only):
    prompts = [{"prompt": REPEATING, "set": "code", "category": "code"}]
    result = run_bench(target_only, prompts, max_new_tokens=8, log=lambda _: None)
    rows = {row["name"]: row for row in result["configs"]}
    # no hf_assisted and no draft-model rows: there is no draft model
    assert list(rows) == ["pytorch_baseline", "specrt_target_only_t-fp32", "specrt_ngram_t-fp32"]
    assert rows["specrt_ngram_t-fp32"]["identical_to_target_alone"]
    assert result["costs"]["t-fp32"]["draft_step_ms"] is None

    runtime = SpeculativeRuntime.load(target_only)
    want = runtime.generate(REPEATING, max_new_tokens=12, speculate=False).text
    with serving(ServeSettings(bundle=target_only, model_name="t"), runtime) as (base, _):
        api = client(base)
        got = api.completions.create(model="t", prompt=REPEATING, max_tokens=12, temperature=0)
        assert got.choices[0].text == want and got.speculation["drafter"] == "ngram"
        assert api.models.retrieve("t").drafters == ["ngram"]
        with pytest.raises(openai.BadRequestError, match="needs a draft model"):
            api.completions.create(
                model="t", prompt="x", extra_body={"speculation": {"drafter": "hybrid"}}
            )


def test_a_killed_build_leaves_a_folder_the_next_build_removes(short_target, tmp_path):
    out = tmp_path / "bundle"
    dead = tmp_path / ".bundle.building-999999999-x"  # no such process
    alive = tmp_path / f".bundle.building-{os.getpid()}-y"  # a build still running
    dead.mkdir()
    alive.mkdir()
    build_bundle(None, str(short_target), out, log=lambda _: None)
    assert not dead.exists() and alive.exists()
    assert Bundle.load(out).max_context == 512


def test_an_unsure_row_drafts_on_beside_a_sure_one_and_counts_only_its_sure_drafts(bundles):
    """In a batched draft a row whose draft is unsure (a threshold above any probability)
    drafts on while another row is sure (threshold 0): the step and the verify call's width
    are paid anyway. Its policy counts only its first draft, the one it would have drafted
    alone. Control: alone, the unsure row stops after its first draft."""
    rt = SpeculativeRuntime.load(bundles["llama"], slots=2, threads=1, calibrate=False)
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]

    def draft(thresholds):
        jobs = []
        for slot, (seq, threshold) in enumerate(zip(seqs, thresholds, strict=False)):
            rt.draft.reset(slot)
            drafter = ModelDrafter(rt.draft)
            drafter.start(seq, slot, None)
            rng = np.random.default_rng(0)
            jobs.append(DraftJob(drafter, seq, 3, SamplingParams(), rng, threshold))
        return draft_together(jobs)[0]

    unsure, sure = draft([1.01, 0.0])
    assert len(unsure.tokens) == len(sure.tokens) == 3
    assert (unsure.counted, sure.counted) == (1, 3)
    (alone,) = draft([1.01])
    assert len(alone.tokens) == alone.counted == 1
