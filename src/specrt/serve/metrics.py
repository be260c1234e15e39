"""Prometheus metrics of one server, named the way vLLM and llama.cpp name theirs.

Each app has its own registry, so several servers in one process (tests, an embedding app)
never share counters. Per-request figures are recorded when a request ends, from the stats
the runtime already keeps; the queue gauges move as requests come and go.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specrt.runtime import Result

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
P = "specrt:"


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, k_max: int = 8):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            P + "requests",
            "Requests by outcome: stop, length, timeout, cancelled, "
            "rejected (429), invalid (4xx), unavailable (503), error (500)",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter(P + "requests_rejected", "Requests refused with 429", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests in the queue", registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests on the engines", registry=r)
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "From arrival to the first token (queue included)",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            P + "time_per_output_token_seconds",
            "Seconds per token after the first (a round's "
            "block shares the time since the previous block)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Seconds waiting for the engines",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "From arrival to the last token",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.drafts = Counter(
            P + "spec_decode_num_drafts", "Rounds that verified at least one draft", registry=r
        )
        self.draft_tokens = Counter(
            P + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.accepted_tokens = Counter(
            P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first)",
            ["position"],
            registry=r,
        )
        self.k_chosen = Histogram(
            P + "spec_decode_k",
            "Speculation length K chosen per round",
            buckets=tuple(range(k_max + 1)),
            registry=r,
        )
        self.batch_size = Histogram(
            P + "batch_size",
            "Requests advanced together per round",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.no_speculation = Counter(
            P + "spec_decode_rounds_without_speculation",
            "Rounds run without a draft (K = 0, or speculation off)",
            registry=r,
        )

    def outcome(self, name: str) -> None:
        self.requests.labels(name).inc()

    def record(self, result: Result, queue_seconds: float) -> None:
        """Everything one finished (or cut short) request contributes."""
        s = result.stats
        self.outcome(
            {"eos": "stop", "context": "length"}.get(result.finish_reason, result.finish_reason)
        )
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        self.queue_time.observe(queue_seconds)
        self.e2e.observe(queue_seconds + s.total_seconds)
        if result.token_ids:
            self.ttft.observe(queue_seconds + s.ttft_seconds)
        for latency in s.token_latencies():
            self.per_token.observe(latency)
        for k, drafted, accepted in zip(s.ks, s.drafted_counts, s.accepted_counts, strict=True):
            self.k_chosen.observe(k)
            if drafted == 0:
                self.no_speculation.inc()
                continue
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(str(position)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
