"""The Grafana dashboard the chart ships queries metrics the session server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.viewer.conftest import Live, drive_rich_session

DASHBOARD = Path(__file__).resolve().parents[2] / "charts/tokenkeep/dashboards/tokenkeep.json"


def queried_metrics(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return {name for expr in exprs for name in re.findall(r"\btokenkeep_[a-z_]+", expr)}


def test_every_queried_metric_exists(live: Live) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    drive_rich_session(live, "viewer-dashboard")  # turns of each kind, a break
    exposition = httpx.get(f"{live.url}/metrics").text
    # A labelled metric no request has touched yet (a publish, a fenced replica) has no
    # sample, only its HELP and TYPE lines: its family names it.
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    families = list(text_string_to_metric_families(exposition))
    exported = {sample.name for family in families for sample in family.samples}
    exported |= {f.name + suffix for f in families for suffix in suffixes.get(f.type, ("",))}
    wanted = queried_metrics(dashboard)
    assert {"tokenkeep_turns_total", "tokenkeep_segment_breaks_total"} <= wanted
    assert wanted - exported == set()
