"""The start-up check of a server keyed as the operator keys it (TOKENKEEP_ADMIN_KEY in the
environment): its in-process requests must pass the server's own auth, so /metrics reports the
template's real verdict, not a 401 read as "every scenario breaks"."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.engine_double import EngineDouble
from tests.security.conftest import ADMIN_KEY, start_server, stop_server


def check_gauge(text: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == "tokenkeep_check_contiguous":
            return family.samples[0].value
    raise AssertionError("no tokenkeep_check_contiguous on /metrics")


def test_startup_check_passes_behind_the_admin_key_from_the_environment(
    tmp_path: Path, double: EngineDouble
) -> None:
    cache = tmp_path / "check-cache"  # empty: the check runs, no cached verdict is read
    server = start_server(
        tmp_path,
        double,
        env={
            "TOKENKEEP_ADMIN_KEY": ADMIN_KEY,
            "TOKENKEEP_CHECK_CACHE_DIR": str(cache),
            "TOKENKEEP_LOG_LEVEL": "info",
        },
    )
    try:
        with server.admin() as client:
            deadline = time.monotonic() + 120
            while (value := check_gauge(client.get("/metrics").text)) == -1:
                assert time.monotonic() < deadline, "the start-up check gave no verdict"
                time.sleep(0.2)
        with server.client() as anonymous:  # the key from the environment is in force
            assert anonymous.get("/sessions").status_code == 401
    finally:
        stop_server(server)
    log = server.log.read_text()
    assert value == 1, log[-3000:]
    assert "start-up check: token-exact on" in log
    assert len(list(cache.glob("*.json"))) == 1
