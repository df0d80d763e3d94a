"""The chart's optional Grafana dashboard ConfigMap, ServiceMonitor and PodMonitor: off by
default, and when on, aimed at what the operator actually deploys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.operator.conftest import load_example
from tests.operator.helm_binary import helm_binary
from tests.operator.test_chart import CHART, VALUES, render
from tests.operator.test_manifests import render_modelserver, render_sessionserver

OBSERVABILITY = next(v for v in VALUES if v.stem == "observability")
DEFAULTS = next(v for v in VALUES if v.stem == "defaults")


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_binary()


def test_off_by_default(helm: Path) -> None:
    kinds = {doc["kind"] for doc in render(helm, DEFAULTS)}
    assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
    assert not any(
        doc["kind"] == "ConfigMap" and "grafana_dashboard" in doc["metadata"].get("labels", {})
        for doc in render(helm, DEFAULTS)
    )


def test_dashboard_config_map_carries_the_dashboard(helm: Path) -> None:
    documents = render(helm, OBSERVABILITY)
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "tokenkeep.json").read_text())
    assert json.loads(config_map["data"]["tokenkeep.json"]) == shipped


def test_service_monitor_selects_the_session_server_service(helm: Path) -> None:
    (monitor,) = [d for d in render(helm, OBSERVABILITY) if d["kind"] == "ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    children = render_sessionserver(
        load_example("sessionserver.yaml"), load_example("modelserver-qwen3-8b.yaml")
    )
    services = [c for c in children if c["kind"] == "Service"]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in services if wanted.items() <= s["metadata"]["labels"].items()]
    assert len(selected) == 1, [s["metadata"]["name"] for s in services]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}


def test_pod_monitor_scrapes_every_engine_pod_and_nothing_else(helm: Path) -> None:
    """vLLM's and SGLang's engine pods (both serve /metrics on their `http` port), not the
    session servers (the ServiceMonitor's) nor Redis."""
    (monitor,) = [d for d in render(helm, OBSERVABILITY) if d["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    wanted = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    sglang = load_example("gpu/sglang-moe-dp8-ep.yaml")
    children = [
        *render_modelserver(load_example("modelserver-qwen3-8b.yaml")),
        *render_modelserver(sglang),
        *render_sessionserver(load_example("sessionserver.yaml"), sglang),
    ]
    pods = [c["spec"]["template"] for c in children if c["kind"] in ("Deployment", "StatefulSet")]
    scraped = [p for p in pods if wanted.items() <= p["metadata"]["labels"].items()]
    assert sorted(p["spec"]["containers"][0]["name"] for p in scraped) == ["sglang", "vllm"]
    for pod in scraped:
        (container,) = pod["spec"]["containers"]
        assert endpoint["port"] in {port["name"] for port in container["ports"]}
        if container["name"] == "sglang":
            assert "--enable-metrics" in container["args"]
