"""Replay controllers on recorded acceptance: what a policy's choices earn, without a clock.

A controller's quality is hard to see through wall-clock benchmarks: on a shared 2-core machine
a level's runs differ by several percent, so one run of adaptive beside fixed K cannot tell the
policy's error from noise, and every try of a change costs half an hour. Greedy decoding makes
acceptance replayable: a draft at position t is accepted when the drafts before it were (so it
too was drafted after the target's own prefix) and the draft model's greedy token there is the
target's. One pass of the draft model over a target-alone answer therefore records, per
position, whether a draft there is accepted and how sure the draft was (its confidence cut).

Replaying a policy on those records, with one cost curve standing for the machine, is
arithmetic: the same tokens per second on every machine, every time. It runs the real
controllers (`decide_round`, `observe`, a shared `PooledAcceptance`) and prices each round as
the loop runs it: the draft model's catch-ups and steps (padded to the widest feed), the verify
call padded to the widest request, requests in lockstep groups of `clients`. After a long
prompt the draft model starts from the prompt's scout (drafters.py's `ModelDrafter.start`),
reads on from the sequence's last tokens where it fell behind (`resume_length`), and a
look-back judges the recorded agreement at the tokens it reads, in a draft call of its own.
What it leaves out: prefill, host work between calls, the clock's noise, the curves'
refinement by the rounds (the policy sees the true curve, or one in error where `replay` is
given the truth apart), the draft's window (it reads the scout throughout) and what it
guesses after it skipped tokens (it guesses as if it had read them); the benchmarks measure
those. On the policy before 9688d3f, after 4,000 tokens at 4 clients and replayed on the costs
the benchmark's runs measured, the grid's cells came within 0.01-0.04 of their measured ratios
(a question 0.93x fixed K = 1 replayed, 0.89x measured; a summary 0.95x, 0.95x; after 1,000
tokens of system prompt 0.96x, 0.96x).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.files import write_json_atomic
from specrt.runtime.controller import make_controller
from specrt.runtime.costs import StepCosts
from specrt.runtime.drafters import (
    DRAFT_WINDOW,
    LOOK_BACK,
    ModelDrafter,
    prompt_skips,
    resume_length,
)
from specrt.runtime.drafting import CATCH_UP, draft_seconds
from specrt.runtime.joint import decide_round
from specrt.runtime.policy import RoundContext
from specrt.runtime.pool import PooledAcceptance


@dataclass(frozen=True)
class Trace:
    """One prompt's target-alone answer, as the draft model saw it (greedy)."""

    prompt_tokens: int
    agrees: list[bool]  # per answer token: the draft's greedy token there is the target's
    confidence: list[float]  # per answer token: the draft's top probability there


@dataclass
class Replay:
    tokens_per_s: float  # decoding only: prefill is left out
    ks: list[list[int]]  # per request, its K each round
    accepted: list[list[int]]  # per request, its drafts accepted each round
    looks: list[list[list[bool]]]  # per request, each look-back's guesses: kept or not


def record(runtime, prompts: Sequence, max_new_tokens: int) -> list[Trace]:
    """Each prompt's trace: the target alone answers (greedy, exactly max_new_tokens), then the
    draft model reads prompt and answer in one call."""
    if runtime.draft is None:
        raise SpecrtError("replaying needs a bundle with a draft model; this one has none")
    traces = []
    for prompt in prompts:
        ids = runtime.encode(prompt)
        answer = runtime.generate(
            ids, max_new_tokens=max_new_tokens, ignore_eos=True, speculate=False
        ).token_ids
        traces.append(_trace(runtime.draft, ids, answer, runtime.target.vocab_size))
    return traces


def _trace(draft, ids: list[int], answer: list[int], vocab: int) -> Trace:
    """The draft model reads the prompt as the loop's does (a long prompt as its scout: its
    sinks and last tokens, `ModelDrafter.start`), then the answer."""
    drafter = ModelDrafter(draft, window=DRAFT_WINDOW)
    drafter.start(ids, 0, None)
    read = drafter.unread([*ids, *answer[:-1]], 0)
    draft.reset(0)
    logits = draft.forward_rows([(0, read)], last=len(answer))[0]
    draft.reset(0)
    logits = logits[:, : min(vocab, draft.vocab_size)].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    confidence = 1.0 / np.exp(logits - top).sum(axis=1)
    agrees = logits.argmax(axis=1) == np.asarray(answer)
    return Trace(len(ids), agrees.tolist(), np.round(confidence, 4).tolist())


def save(traces: Sequence[Trace], path: Path) -> None:
    write_json_atomic(path, {"traces": [asdict(trace) for trace in traces]})


def load(path: Path) -> list[Trace]:
    try:
        return [Trace(**trace) for trace in json.loads(Path(path).read_text())["traces"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SpecrtError(f"{path}: not a file of acceptance traces ({error})") from None


def replay(
    traces: Sequence[Trace],
    controller: str,
    clients: int,
    costs: StepCosts,
    k_max: int = 8,
    pool: PooledAcceptance | None = None,
    truth: StepCosts | None = None,
) -> Replay:
    """Tokens per second of `controller` serving the traces `clients` at a time. pool: the
    acceptance the runtime has seen (default: none yet, so a batch first drafts to learn it).
    truth: what the rounds take, where the policy prices them by `costs` (default: the same):
    a calibration's error, replayed (benchmarks/price_error.py)."""
    pool = PooledAcceptance() if pool is None else pool
    truth = costs if truth is None else truth
    seconds, tokens, requests = 0.0, 0, []
    for start in range(0, len(traces), clients):
        group = [
            _Request(trace, make_controller(controller, k_max, costs, pool=pool))
            for trace in traces[start : start + clients]
        ]
        while live := [r for r in group if r.pos < len(r.trace.agrees)]:
            seconds += _round(live, costs, truth)
        tokens += sum(len(r.trace.agrees) - 1 for r in group)  # the first is the prefill's
        requests += group
    if not seconds:
        raise SpecrtError("nothing to replay: each answer needs at least 2 tokens")
    return Replay(
        tokens / seconds,
        [r.ks for r in requests],
        [r.accepted for r in requests],
        [r.looks for r in requests],
    )


@dataclass
class _Request:
    trace: Trace
    policy: object
    pos: int = 1  # the answer's next token; prefill drew the first
    lag: int = field(init=False)  # tokens the draft model has not read
    scouted: bool = field(init=False)  # its long prompt read as a scout: it may skip tokens...
    skips: bool = field(init=False)  # ...once it read them (ModelDrafter: its cache holds some)
    ks: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    looks: list[list[bool]] = field(default_factory=list)  # each look-back's guesses, kept or not

    def __post_init__(self):
        # at first what it reads of the prompt (ModelDrafter.start), and prefill's token
        prompt = self.trace.prompt_tokens
        skip = prompt_skips(prompt, DRAFT_WINDOW)[1]
        self.lag, self.scouted, self.skips = prompt - skip + 1, skip > 0, False

    def reads(self, most: int) -> int:
        """Tokens the draft model reads to catch up: its lag, or, where a long prompt let it
        skip and it read since, its last `most` (ModelDrafter's resume, and its look-back's
        LOOK_BACK): the rest it skips."""
        return min(self.lag, most) if self.skips else self.lag

    @property
    def room(self) -> int:
        return len(self.trace.agrees) - self.pos - 1

    def context(self, resume: int) -> RoundContext:
        position = self.trace.prompt_tokens + self.pos
        room, remaining = self.room, max(1, self.room + 1)
        lag = self.reads(resume)
        return RoundContext(room, position, remaining, "model", lag, self.unjudged, True, self.pos)

    @property
    def unjudged(self) -> int:
        """Emitted tokens a look-back would judge: those after the last the draft model read,
        its last LOOK_BACK at most (as `ModelDrafter.look_back` reads them)."""
        return max(0, min(self.pos, self.lag - 1, LOOK_BACK - 1))

    def look_back(self, costs: StepCosts) -> float:
        """Judge the draft's guesses at the unjudged tokens, as its look-back reads them in one
        call (the first after the prompt also reads its scout); the draft model is then caught
        up. Returns the call's seconds."""
        judged = self.unjudged
        read = max(self.reads(LOOK_BACK), judged + 1)
        self.lag, self.skips = 1, self.scouted
        self.looks.append(list(self.trace.agrees[self.pos - judged : self.pos]))
        return costs.draft_cost("model", 1, read)

    def draft(self, k: int) -> tuple[int, int]:
        """Drafts proposed and draft-model steps taken for K = k, alone (see `_drafts`)."""
        return _drafts([self], [k])[0][:2]

    def sure(self, j: int) -> bool:
        """Whether its draft is sure of its j-th token (the first always is)."""
        return not j or self.trace.confidence[self.pos + j] >= self.policy.confidence_threshold

    def advance(self, k: int, drafted: int, steps: int, counted: int) -> None:
        """Emit the accepted drafts and the target's token (its policy told of the `counted`
        first drafts); the draft model keeps what it read of them (it never reads its last
        proposal unless a cut step did)."""
        accepted = 0
        while accepted < drafted and self.trace.agrees[self.pos + accepted]:
            accepted += 1
        self.policy.observe(counted, min(accepted, counted), "model")
        self.ks.append(k)
        self.accepted.append(accepted)
        if drafted:  # it read `steps - 1` drafts, then was rolled back to the accepted ones
            self.lag = accepted + 1 - min(accepted, steps - 1)
            self.skips = self.scouted
        else:
            self.lag += 1
        self.pos += accepted + 1


def _drafts(live: list[_Request], ks: list[int]) -> list[tuple[int, int, int]]:
    """Drafts proposed, draft-model steps taken and drafts its policy counts, per request at
    its K, as `draft_together` takes them: after the first, the drafts end where every row of
    a step is unsure (that step is paid, its tokens dropped); an unsure row drafts on beside a
    sure one, counted only up to its first unsure draft (`Proposal.counted`)."""
    taken = [[min(k, 1), min(k, 1), None] for k in ks]  # drafted, steps, counted
    for j in range(1, max(ks, default=0)):
        rows = [i for i, k in enumerate(ks) if k > j]  # each has drafted j: none stopped yet
        for i in rows:
            taken[i][1] += 1
        if not any(live[i].sure(j) for i in rows):
            break
        for i in rows:
            if not live[i].sure(j) and taken[i][2] is None:
                taken[i][2] = j
            taken[i][0] += 1
    return [(drafted, steps, drafted if sure is None else sure) for drafted, steps, sure in taken]


def _round(live: list[_Request], costs: StepCosts, truth: StepCosts) -> float:
    """One round's seconds on `truth`, its K chosen on `costs`; a draft model that fell
    behind reads on from the last tokens the runtime would tell it (`resume_length`)."""
    resume = resume_length(costs, len(live))
    contexts = [r.context(resume) for r in live]
    decisions = decide_round([r.policy for r in live], contexts, costs)
    drafts = _drafts(live, [d.k for d in decisions])
    feeds = [
        (c.lag, steps) for c, (drafted, steps, _) in zip(contexts, drafts, strict=True) if drafted
    ]
    seconds = draft_seconds(feeds, truth)
    looking = [r for r, d in zip(live, decisions, strict=True) if d.look_back and not d.k]
    seconds += sum(r.look_back(truth) for r in looking)
    widest = max(drafted for drafted, _, _ in drafts)
    seconds += truth.verify_cost(len(live) * (widest + 1), len(live))
    for r, c, d, (drafted, steps, counted) in zip(live, contexts, decisions, drafts, strict=True):
        if drafted and 1 < c.lag <= CATCH_UP and hasattr(r.policy, "bonus"):
            r.policy.bonus(r.trace.agrees[r.pos - 1], "model")  # as draft_together judges it
        r.advance(d.k, drafted, steps, counted)
    for r in looking:
        r.policy.looked_back(r.looks[-1], "model")
    return seconds


def report(traces: Sequence[Trace], levels: Sequence[int], costs: StepCosts, k_max: int) -> str:
    """A Markdown table: tokens/s of fixed K = 0..k_max and adaptive at each client count, and
    adaptive's ratio to the best fixed K (the goal is >= 0.95). As in `specrt bench`, the
    levels share one runtime's pool in turn, so only the first starts cold."""
    names = [f"fixed:{k}" for k in range(k_max + 1)] + ["adaptive"]
    pool = PooledAcceptance()
    lines = [
        "| clients | " + " | ".join(names) + " | adaptive / best fixed |",
        "|---" * (len(names) + 2) + "|",
    ]
    for clients in levels:
        rates = [replay(traces, name, clients, costs, k_max, pool).tokens_per_s for name in names]
        cells = " | ".join(f"{rate:.1f}" for rate in rates)
        lines.append(f"| {clients} | {cells} | {rates[-1] / max(rates[:-1]):.2f} |")
    return "\n".join(lines)
