"""The Grafana dashboard the chart ships queries metrics the session server exports, and its
engine panels metrics the engines export: a real vLLM's /metrics, SGLang's by its source."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.viewer.conftest import Live, drive_rich_session
from tests.vllm_fixture import RunningEngine, vllm_engine

__all__ = ["vllm_engine"]

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts/tokenkeep/dashboards/tokenkeep.json"
# SGLang 0.5.23's sample names, read from its source (tests/fixtures/sglang/README.md).
SGLANG_METRICS = REPO / "tests/fixtures/sglang/metric_names.txt"


def queried_metrics(dashboard: dict, prefix: str = "tokenkeep_") -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {name for expr in exprs for name in re.findall(rf"\b{prefix}[a-z_]+", expr)}


def exported_metrics(exposition: str) -> set[str]:
    """Every sample name of a Prometheus exposition. A labelled metric no request has
    touched yet (a publish, a fenced replica) has no sample, only its HELP and TYPE lines: its
    family names it."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    families = list(text_string_to_metric_families(exposition))
    exported = {sample.name for family in families for sample in family.samples}
    return exported | {f.name + suffix for f in families for suffix in suffixes.get(f.type, ("",))}


def test_every_queried_metric_exists(live: Live) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    drive_rich_session(live, "viewer-dashboard")  # turns of each kind, a break
    exported = exported_metrics(httpx.get(f"{live.url}/metrics").text)
    wanted = queried_metrics(dashboard)
    assert {"tokenkeep_turns_total", "tokenkeep_segment_breaks_total"} <= wanted
    assert wanted - exported == set()


@pytest.mark.vllm
def test_engine_panels_query_what_a_real_vllm_exports(vllm_engine: RunningEngine) -> None:
    """KV-cache usage, requests running and waiting, preemptions, prefix-cache hit rate and
    generated tokens, by the names vLLM 0.32's /metrics (the tier's engine) gives them."""
    wanted = queried_metrics(json.loads(DASHBOARD.read_text()), "vllm:")
    assert {
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:generation_tokens_total",
    } <= wanted
    exported = exported_metrics(httpx.get(f"{vllm_engine.url}/metrics").text)
    assert wanted - exported == set()


def test_engine_panels_query_what_sglang_defines() -> None:
    """The same panels' SGLang queries, by the names SGLang 0.5.23's source gives them (no
    SGLang runs here)."""
    wanted = queried_metrics(json.loads(DASHBOARD.read_text()), "sglang:")
    defined = {line for line in SGLANG_METRICS.read_text().splitlines() if line[:1] != "#"}
    assert len(wanted) == 6
    assert wanted - defined == set()
