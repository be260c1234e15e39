"""One level of the load benchmark (`specrt bench --concurrency`): a closed loop of clients,
each sending its next request as soon as its last one ends, on specrt's scheduler in process or
on a llama-server over HTTP, and the figures both report alike (throughput, TTFT, per-token
latency, mean K, outputs against each prompt run alone)."""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from specrt.runtime import Scheduler, SpeculativeRuntime
from specrt.runtime import Sequence as Running
from specrt.runtime.sequence import per_token_latencies
from specrt.tools import llamacpp


@dataclass(frozen=True)
class Served:
    """One finished request, as any engine's closed loop records it (perf_counter seconds)."""

    index: int  # the prompt's
    sent: float
    first: float  # when its first token arrived
    end: float
    tokens: list[int]
    latencies: list[float]  # seconds per token after the first
    ks: tuple[int, ...] = ()  # the K of each speculative round (specrt's)
    kept: tuple[int, ...] = ()  # the drafts each round kept
    reasons: tuple[str, ...] = ()  # the controller's reason for each round's K


def run_level(
    rt: SpeculativeRuntime,
    prompts: list[list[int]],
    options: dict,
    concurrency: int,
    max_new_tokens: int,
    alone: dict[int, list[int]],
) -> dict:
    """Serve one level; return its figures."""
    scheduler = Scheduler(rt.target, rt.costs, concurrency, rt.prefill_chunk)
    count = max(4, 2 * concurrency)
    todo = deque((i % len(prompts)) for i in range(count))
    sent: dict[Running, tuple[int, float]] = {}
    first: dict[Running, float] = {}
    done: list[Served] = []
    start = time.perf_counter()
    while todo or scheduler.busy:
        while todo and scheduler.has_room:
            index = todo.popleft()
            generation = rt.sequence(
                prompts[index], max_new_tokens=max_new_tokens, ignore_eos=True, **options
            )
            scheduler.add(generation)
            sent[generation] = (index, time.perf_counter())
        step = scheduler.step()
        now = time.perf_counter()
        for generation in step.moved:
            if generation.stops.length:
                first.setdefault(generation, now)
            if generation.result is not None:
                index, at = sent[generation]
                stats = generation.result.stats
                done.append(
                    Served(
                        index,
                        at,
                        first[generation],
                        now,
                        generation.result.token_ids,
                        stats.token_latencies(),
                        tuple(stats.ks),
                        tuple(stats.accepted_counts),
                        tuple(stats.reasons),
                    )
                )
    return _figures(done, alone, time.perf_counter() - start)


def llama_level(
    base: str,
    prompts: list[list[int]],
    concurrency: int,
    max_new_tokens: int,
    alone: dict[int, list[int]],
) -> dict:
    """llama-server under the same closed loop: `concurrency` clients, each sending its next
    request as soon as its last one ends, the same count of requests as specrt's levels."""
    todo = deque((i % len(prompts)) for i in range(max(4, 2 * concurrency)))
    done: list[Served] = []

    def client() -> None:
        while todo:
            try:
                index = todo.popleft()
            except IndexError:  # another client took the last one
                return
            sent = time.perf_counter()
            tokens, times = llamacpp.complete(base, prompts[index], max_new_tokens)
            latencies = per_token_latencies(times, times[0])
            done.append(Served(index, sent, sent + times[0], sent + times[-1], tokens, latencies))

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client) for _ in range(concurrency)]:
            future.result()
    return _figures(done, alone, time.perf_counter() - start)


def _turns(served: Served) -> dict[int, str]:
    """The controller's reasons at the rounds where K changed and at the round before each (a
    course's last price beside the one that turned it), and at the first, by round: every
    round's reason is ~150 bytes, 8 requests' turns at 4 levels half a megabyte a run."""
    ks = served.ks
    turned = {i for i in range(1, len(ks)) if ks[i] != ks[i - 1]}
    keep = sorted({0, *turned, *(i - 1 for i in turned)})
    return {i: served.reasons[i] for i in keep if i < len(served.reasons)}


def _figures(done: list[Served], alone: dict[int, list[int]], seconds: float) -> dict:
    tokens = sum(len(s.tokens) for s in done)
    per_request = [len(s.tokens) / (s.end - s.sent) for s in done]
    latencies = [x for s in done for x in s.latencies]
    ks = [k for s in done for k in s.ks]
    same = [s.tokens == alone[s.index] for s in done]
    rounds = [
        {"prompt": s.index, "k_by_round": s.ks, "kept_by_round": s.kept, "why": _turns(s)}
        for s in done
        if s.reasons
    ]
    return {
        "requests": len(done),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "aggregate_tokens_per_s": tokens / seconds,
        "per_request_tokens_per_s": float(np.mean(per_request)),
        "ttft_p50_ms": 1000 * float(np.percentile([s.first - s.sent for s in done], 50)),
        "per_token_p50_ms": 1000 * float(np.percentile(latencies, 50)),
        "per_token_p99_ms": 1000 * float(np.percentile(latencies, 99)),
        "mean_k": float(np.mean(ks)) if ks else 0.0,
        "identical_to_alone": all(same),
        "mismatches": same.count(False),
        **({"by_request": rounds} if rounds else {}),
    }
