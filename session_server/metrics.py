"""Prometheus metrics of one server process (a registry per app, so tests stay isolated)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenkeep_requests", "HTTP requests by API and status.", ["api", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "tokenkeep_request_seconds",
            "Whole request latency.",
            ["api"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.turns = Counter(
            "tokenkeep_turns", "Stored turns by classification.", ["kind"], registry=r
        )
        self.segment_breaks = Counter(
            "tokenkeep_segment_breaks",
            "New segments started inside a session (contiguity broken), by reason.",
            ["reason"],
            registry=r,
        )
        self.splice_seconds = Histogram(
            "tokenkeep_splice_seconds",
            "Per-turn overhead before generation: lookup, classify, splice.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_seconds = Histogram(
            "tokenkeep_engine_seconds",
            "Engine generation latency.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.proof_failures = Counter(
            "tokenkeep_proof_failures",
            "Engine-reported prompts that differed from the spliced prompt.",
            registry=r,
        )
        self.normalized_requests = Counter(
            "tokenkeep_normalized_requests",
            "Requests in which session normalisation rules ignored volatile text.",
            registry=r,
        )
        self.inflight = Gauge(
            "tokenkeep_inflight_requests", "Generation requests running now.", registry=r
        )
        self.queue_depth = Gauge(
            "tokenkeep_queued_requests", "Generation requests waiting for a slot.", registry=r
        )
        self.rejections = Counter(
            "tokenkeep_rejected_requests",
            "Generation requests refused before running, by reason "
            "(queue_full, queue_timeout, draining).",
            ["reason"],
            registry=r,
        )
