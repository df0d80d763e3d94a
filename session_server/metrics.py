"""Prometheus metrics of one server process (a registry per app, so tests stay isolated)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# A publish: a tiny model's reload takes 0.1-0.3 s, a large one's minutes.
_PUBLISH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._replicas: Callable[[], list[Any]] | None = None
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
        self.turns_by_weight_version = Counter(
            "tokenkeep_turns_by_weight_version",
            "Stored turns by the policy version that sampled them (a turn sampled across a "
            "weight update counts once for each version).",
            ["version"],
            registry=r,
        )
        self.sampled_tokens_by_weight_version = Counter(
            "tokenkeep_sampled_tokens_by_weight_version",
            "Stored sampled tokens by the policy version that sampled them.",
            ["version"],
            registry=r,
        )
        self.publishes = Counter(
            "tokenkeep_policy_publishes",
            "POST /policy publishes by result (ok, partial: some replicas fenced, failed, "
            "refused: nothing touched).",
            ["result"],
            registry=r,
        )
        self.publish_replica_seconds = Histogram(
            "tokenkeep_policy_publish_replica_seconds",
            "One replica's share of a publish or catch-up: pause, reload, version, checksum.",
            ["replica"],
            buckets=_PUBLISH_BUCKETS,
            registry=r,
        )
        self.publish_pause_seconds = Histogram(
            "tokenkeep_policy_pause_seconds",
            "How long a publish kept the engines paused, by pause mode.",
            ["mode"],
            buckets=_PUBLISH_BUCKETS,
            registry=r,
        )
        self.publish_requests = Counter(
            "tokenkeep_policy_paused_requests",
            "This server's generations in flight on a replica when a publish paused it, by "
            "mode: kept (frozen, resumed on the new weights), waited for, aborted.",
            ["mode"],
            registry=r,
        )
        self.catch_ups = Counter(
            "tokenkeep_policy_catch_ups",
            "Replicas found behind the published policy and reloaded, by result.",
            ["result"],
            registry=r,
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
        self.engine_reply_faults = Counter(
            "tokenkeep_engine_reply_faults",
            "Engine replies refused (502, nothing stored): a token id outside the vocabulary, "
            "more tokens than max_tokens, a choice the request did not ask for.",
            ["reason"],
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
            "Generation requests refused before running, by reason (queue_full, "
            "queue_timeout, draining, policy_lag, session_finished: also counts a turn whose "
            "generation was cut by its session's finish, stored nowhere).",
            ["reason"],
            registry=r,
        )
        for reason in ("queue_full", "queue_timeout", "draining", "policy_lag", "session_finished"):
            self.rejections.labels(reason=reason)  # a series from the start, at 0
        self.retry_races = Counter(
            "tokenkeep_retry_races",
            "Turns stored as retries because an identical request stored its turns while this "
            "one generated (concurrent resends; without this they would be second roots).",
            registry=r,
        )
        self.idempotent_replays = Counter(
            "tokenkeep_idempotent_replays",
            "Requests answered with the reply stored under their Idempotency-Key (no "
            "engine call, no new turn).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tokenkeep_prompt_tokens",
            "Prompt tokens of turns whose engine reported prefix-cache hits (the hit ratio is "
            "tokenkeep_cached_prompt_tokens_total / tokenkeep_prompt_tokens_total).",
            registry=r,
        )
        self.cached_prompt_tokens = Counter(
            "tokenkeep_cached_prompt_tokens",
            "Prompt tokens the engine served from its prefix cache (vLLM "
            "--enable-prompt-tokens-details).",
            registry=r,
        )
        self.stale_cache_turns = Counter(
            "tokenkeep_stale_cache_turns",
            "Turns whose cached prefix holds positions of earlier turns sampled under another "
            "policy version than this turn's (KV computed by an older policy may be reused).",
            registry=r,
        )
        self.aborted_requests = Counter(
            "tokenkeep_aborted_requests",
            "Generations cut by POST /sessions/{id}/abort.",
            registry=r,
        )
        self.generic_splice = Gauge(
            "tokenkeep_generic_splice_families",
            "Served model families on the generic end-of-turn splice (no hand-written "
            "renderer); above 0 is a warning: run `tokenkeep check` on the model.",
            registry=r,
        )
        self.check_contiguous = Gauge(
            "tokenkeep_check_contiguous",
            "Start-up check verdict: 1 token-exact, 0 breaks, -1 not (yet) run.",
            registry=r,
        )
        self.check_contiguous.set(-1)
        self.check_tool_calls_parsed = Gauge(
            "tokenkeep_check_tool_calls_parsed",
            "Start-up check: 1 scripted tool calls reached the harness as calls, 0 as text, "
            "-1 not run or no tool-call syntax.",
            registry=r,
        )
        self.check_stream_equal = Gauge(
            "tokenkeep_check_stream_equal",
            "Start-up check: 1 streamed replies equal the non-streamed ones, 0 they differ, "
            "-1 not run.",
            registry=r,
        )
        self.check_tool_calls_parsed.set(-1)
        self.check_stream_equal.set(-1)
        self.model_path = Gauge(
            "tokenkeep_model_path_info",
            "The served model's path (1 on the chosen series): `renderer` the `renderers` "
            "family renderer that parses replies, or generic; `bridge` who renders new "
            "messages (renderer or template); `reason` why auto chose it.",
            ["renderer", "bridge", "reason"],
            registry=r,
        )

        self.store_used_memory = Gauge(
            "tokenkeep_store_used_memory_bytes",
            "Redis used_memory (INFO memory), read at each scrape; -1: not known (the "
            "embedded store, or Redis did not answer).",
            registry=r,
        )
        self.store_max_memory = Gauge(
            "tokenkeep_store_max_memory_bytes",
            "Redis maxmemory (0: unbounded). Turns are refused (503) once used reaches it.",
            registry=r,
        )
        self.store_full_refusals = Counter(
            "tokenkeep_store_full_refusals",
            "Store writes refused because Redis is full (OOM, maxmemory with noeviction): "
            "each one a 503, nothing stored.",
            registry=r,
        )
        self._full_refusals_seen = 0

    def record_store_memory(self, memory: tuple[int, int] | None, full_refusals: int) -> None:
        """What the store said at a scrape: (used, max) bytes or None, and its refusals."""
        used, most = memory if memory is not None else (-1, -1)
        self.store_used_memory.set(used)
        self.store_max_memory.set(most)
        if full_refusals > self._full_refusals_seen:
            self.store_full_refusals.inc(full_refusals - self._full_refusals_seen)
            self._full_refusals_seen = full_refusals

    def record_reply_check(self, parsed: bool | None, stream_equal: bool | None) -> None:
        """The start-up check's reply verdicts (None: not measured)."""
        self.check_tool_calls_parsed.set(-1 if parsed is None else int(parsed))
        self.check_stream_equal.set(-1 if stream_equal is None else int(stream_equal))

    def watch_engine(self, replicas: Callable[[], list[Any]]) -> None:
        """Report each engine replica (`.url`, `.healthy`, `.weight_version`, as the engine
        client last saw them) at every scrape: whether it is up, and the policy version it
        serves."""
        if self._replicas is None:
            self.registry.register(_EngineReplicas(self))
        self._replicas = replicas

    def watch_shared_tokens(self, shared: Any) -> None:
        """Report a `shared_tokens.SharedTokens` cache (read at each scrape)."""
        self.registry.register(_SharedTokens(shared))


class _SharedTokens(Collector):
    def __init__(self, shared: Any) -> None:
        self._shared = shared

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        shared = self._shared
        yield CounterMetricFamily(
            "tokenkeep_shared_tokens_hits",
            "Long texts (a group's shared first message, a system prompt and tool list) "
            "whose token ids were taken from the shared-tokens cache or from a tokenization "
            "of the same text already under way.",
            value=shared.hits,
        )
        yield CounterMetricFamily(
            "tokenkeep_shared_tokens_misses",
            "Long texts tokenized because no tokenization of them was kept or under way.",
            value=shared.misses,
        )
        yield GaugeMetricFamily(
            "tokenkeep_shared_tokens_bytes",
            "Bytes the shared-tokens cache holds (ids and the texts they are kept under); "
            "at most --shared-tokens-bytes.",
            value=shared.bytes_held,
        )


class _EngineReplicas(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            "tokenkeep_engine_replica_up",
            "1 while an engine replica is healthy (health check and recent requests), else 0.",
            labels=["replica"],
        )
        versions = GaugeMetricFamily(
            "tokenkeep_engine_weight_version",
            "1 for the policy version each engine replica serves (as last read from it).",
            labels=["replica", "version"],
        )
        fenced = GaugeMetricFamily(
            "tokenkeep_engine_replica_fenced",
            "1 while an engine replica gets no turns because it does not serve the published "
            "policy (reason: behind, update_failed, checksum, new).",
            labels=["replica", "reason"],
        )
        tokenizer = GaugeMetricFamily(
            "tokenkeep_engine_tokenizer_mismatch",
            "1 while an engine replica gets no turns because its tokenizer gives other ids "
            "than this server's for the same text (tokenizer_match.py).",
            labels=["replica"],
        )
        replicas = self._metrics._replicas
        for replica in replicas() if replicas else []:
            up.add_metric([replica.url], 1 if replica.healthy else 0)
            if replica.weight_version is not None:
                versions.add_metric([replica.url, replica.weight_version], 1)
            if replica.fenced is not None:
                fenced.add_metric([replica.url, replica.fenced.split(":", 1)[0]], 1)
            tokenizer.add_metric(
                [replica.url], 1 if (replica.tokenizer_differs or "").startswith("mismatch") else 0
            )
        yield up
        yield versions
        yield fenced
        yield tokenizer
