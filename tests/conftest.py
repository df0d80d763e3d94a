"""Fixtures shared by every test package, and the CI rule on skips."""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator

import pytest
from hypothesis import HealthCheck, settings

from session_server.store import memory as memory_store
from session_server.store import redis as redis_store
from session_server.store.base import TurnRecord
from tests.redis_server import start_redis_server, stop_redis_server

# Hypothesis times each example (a 200 ms deadline) and fails slow input generation: both are
# wall-clock assertions, and flaky on a loaded two-core machine. Correctness only here.
settings.register_profile("tokenkeep", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("tokenkeep")


def ci_forbids_skips() -> bool:
    """CI runs every tier (`make test` installs what each needs), so there a skip means a
    missing prerequisite, not a choice: `CI=true` turns every skip into a failure."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail") and ci_forbids_skips():
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every tier must run: {reason}"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server started once for the test run. Tests share it: each test's
    store gets its own key prefix (tests/session/conftest.py, tests/store/conftest.py), so
    the suite passes in any order (`pytest --random-order-seed=N`)."""
    proc, url = start_redis_server(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop_redis_server(proc)


@pytest.fixture
def decoded_ids(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The turn ids every store decodes from now on, in call order."""
    calls: list[int] = []

    def counting(real: Callable[[int, bytes], TurnRecord]) -> Callable[[int, bytes], TurnRecord]:
        def decode_turn(turn_id: int, blob: bytes) -> TurnRecord:
            calls.append(turn_id)
            return real(turn_id, blob)

        return decode_turn

    for module in (memory_store, redis_store):
        monkeypatch.setattr(module, "decode_turn", counting(module.decode_turn))
    return calls


# Seconds each tier (tests/<tier>/, or tests/ itself) spent in setup, call and teardown: the
# per-tier times the README's test section records come from this summary of a `make test`.
_TIER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    parts = report.nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "tests"
    _TIER_SECONDS[tier] = _TIER_SECONDS.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _TIER_SECONDS:
        return
    terminalreporter.section("seconds per tier")
    for tier, seconds in sorted(_TIER_SECONDS.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  tests/{tier if tier != 'tests' else ''}")
