"""Admission control of one process: bounded slots, a bounded queue, refusals with a status
and a reason counted in the metrics, refusal of everything new while draining."""

from __future__ import annotations

import asyncio

import pytest

from session_server.admission import Admission, Rejected
from session_server.metrics import Metrics


def _rejections(metrics: Metrics, reason: str) -> float:
    return (
        metrics.registry.get_sample_value("tokenkeep_rejected_requests_total", {"reason": reason})
        or 0.0
    )


async def test_full_queue_is_refused_with_429_and_a_queued_request_runs_later() -> None:
    metrics = Metrics()
    admission = Admission(metrics, max_inflight=1, max_queue=1, queue_timeout_s=60)
    await admission.acquire()
    queued = asyncio.create_task(admission.acquire())
    await asyncio.sleep(0)
    assert admission.waiting == 1
    assert metrics.registry.get_sample_value("tokenkeep_queued_requests") == 1

    with pytest.raises(Rejected) as refused:
        await admission.acquire()
    assert (refused.value.status, refused.value.retry_after_s) == (429, 1)
    assert _rejections(metrics, "queue_full") == 1

    admission.release()
    await queued
    assert (admission.inflight, admission.waiting) == (1, 0)
    admission.release()
    assert admission.inflight == 0


async def test_a_request_that_waits_too_long_gets_503() -> None:
    metrics = Metrics()
    admission = Admission(metrics, max_inflight=1, max_queue=4, queue_timeout_s=0)
    await admission.acquire()
    with pytest.raises(Rejected) as refused:
        await admission.acquire()
    assert refused.value.status == 503
    assert _rejections(metrics, "queue_timeout") == 1
    assert admission.waiting == 0


async def test_draining_refuses_new_requests_and_lets_admitted_ones_finish() -> None:
    metrics = Metrics()
    admission = Admission(metrics, max_inflight=4, max_queue=4, queue_timeout_s=60)
    await admission.acquire()
    admission.draining = True
    with pytest.raises(Rejected) as refused:
        await admission.acquire()
    assert refused.value.status == 503
    assert _rejections(metrics, "draining") == 1
    admission.release()
    assert admission.inflight == 0
