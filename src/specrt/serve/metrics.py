"""The server's metrics, named the way vLLM and llama.cpp name theirs.

The metrics are declared once, here, over a small `Instruments` factory: `specrt serve`'s
factory makes Prometheus objects in a registry of the app's own (several servers in one
process, as in tests or an embedding app, never share counters; `/metrics` exposes it), and
the Ray Serve application's factory (`specrt.serve.ray`) makes Ray's, which every replica
exports through its node's metrics agent, labelled by replica. Per-request figures are
recorded when a request ends, from the stats the runtime already keeps; the queue gauges move
as requests come and go.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specrt.runtime import Result
from specrt.serve.render import finish_reason

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class Instrument(Protocol):
    """What the server does with a metric: prometheus_client's calls, which Ray's adapter
    mirrors. `labels` binds label values, in the order they were declared."""

    def labels(self, *values: str) -> Instrument: ...
    def inc(self, amount: float = 1) -> None: ...
    def set(self, value: float) -> None: ...
    def observe(self, value: float) -> None: ...


class Instruments(Protocol):
    """Makes the metrics; `exposition` is the text a scrape of this process reads, or None
    where another process exports them (Ray's metrics agent), and `where` says where."""

    where: str

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Instrument: ...
    def gauge(self, name: str, doc: str) -> Instrument: ...
    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Instrument: ...
    def exposition(self) -> bytes | None: ...


class PrometheusInstruments:
    """A registry of this app's own, exposed at its `/metrics`."""

    prefix = "specrt:"
    where = "/metrics on this server"

    def __init__(self):
        self.registry = CollectorRegistry()

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Instrument:
        return Counter(self.prefix + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str) -> Instrument:
        return Gauge(self.prefix + name, doc, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Instrument:
        return Histogram(self.prefix + name, doc, buckets=buckets, registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, k_max: int = 8, instruments: Instruments | None = None):
        m = self.instruments = instruments or PrometheusInstruments()
        self.requests = m.counter(
            "requests",
            "Requests by outcome: stop, length, timeout, cancelled, "
            "rejected (429), invalid (4xx), unavailable (503), error (500)",
            ("outcome",),
        )
        self.rejected = m.counter("requests_rejected", "Requests refused with 429")
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens processed")
        self.cached_tokens = m.counter(
            "prompt_tokens_cached", "Prompt tokens a slot already held (reused, not computed)"
        )
        self.generation_tokens = m.counter("generation_tokens", "Tokens generated")
        self.waiting = m.gauge("num_requests_waiting", "Requests in the queue")
        self.running = m.gauge("num_requests_running", "Requests on the engines")
        self.ttft = m.histogram(
            "time_to_first_token_seconds",
            "From arrival to the first token (queue included)",
            TTFT_BUCKETS,
        )
        self.per_token = m.histogram(
            "time_per_output_token_seconds",
            "Seconds per token after the first (a round's "
            "block shares the time since the previous block)",
            LATENCY_BUCKETS,
        )
        self.queue_time = m.histogram(
            "request_queue_time_seconds", "Seconds waiting for the engines", REQUEST_BUCKETS
        )
        self.e2e = m.histogram(
            "e2e_request_latency_seconds", "From arrival to the last token", REQUEST_BUCKETS
        )
        self.drafts = m.counter("spec_decode_num_drafts", "Rounds that verified at least one draft")
        self.draft_tokens = m.counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted_tokens = m.counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = m.counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first)",
            ("position",),
        )
        # K is whole, so each bucket's bound sits half-way to the next: le="0.5" counts K = 0
        # (Ray's histograms take positive bounds only).
        self.k_chosen = m.histogram(
            "spec_decode_k",
            "Speculation length K chosen per round",
            tuple(k + 0.5 for k in range(k_max + 1)),
        )
        self.batch_size = m.histogram(
            "batch_size", "Requests advanced together per round", (1, 2, 4, 8, 16, 32, 64)
        )
        self.no_speculation = m.counter(
            "spec_decode_rounds_without_speculation",
            "Rounds run without a draft (K = 0, or speculation off)",
        )

    def outcome(self, name: str) -> None:
        self.requests.labels(name).inc()

    def record(self, result: Result, queue_seconds: float) -> None:
        """Everything one finished (or cut short) request contributes."""
        s = result.stats
        self.outcome(finish_reason(result))
        self.prompt_tokens.inc(s.prompt_tokens)
        self.cached_tokens.inc(s.cached_tokens)
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

    def exposition(self) -> bytes | None:
        return self.instruments.exposition()
