"""`tokenkeep export` against a live server: Parquet and JSONL files, deletion only after a
complete file, and clear failures that leave the sessions alone."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from session_server.cli import main
from tests.session.conftest import Stack
from tests.trainer.test_client import rollout
from tokenkeep import Client


def export(stack: Stack, *args: str) -> int:
    return main(["export", "--url", stack.url, "--no-progress", *args])


def test_parquet_columns_and_delete_after_export(memory_stack: Stack, tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    with Client(memory_stack.url) as client:
        ids = [rollout(memory_stack, client, run, r) for r in (1.0, 0.0)]
        expected = {t.session_id: t for t in client.trajectories(ids)}
        out = tmp_path / "batch.parquet"
        assert export(memory_stack, "--selector", f"run={run}", "-o", str(out), "--delete") == 0
        table = pq.read_table(out).to_pylist()
        assert sorted(r["session_id"] for r in table) == sorted(ids)
        for row in table:
            segment = expected[row["session_id"]].branches[0].segments[0]
            assert row["token_ids"] == segment.token_ids
            assert row["loss_mask"] == segment.loss_mask
            assert row["weight_versions"] == [
                {"version": s.version, "start": s.start, "end": s.end}
                for s in segment.weight_versions
            ]
            assert json.loads(row["metadata"]) == {"run": run}
        assert {r["session_id"]: r["reward"] for r in table} == dict(
            zip(ids, (1.0, 0.0), strict=True)
        )
        assert client.list_finished(selector=f"run={run}") == []  # deleted once written


def test_jsonl_by_suffix(memory_stack: Stack, tmp_path: Path) -> None:
    run = uuid.uuid4().hex
    with Client(memory_stack.url) as client:
        sid = rollout(memory_stack, client, run, 1.0)
    out = tmp_path / "batch.jsonl"
    assert export(memory_stack, "--session", sid, "-o", str(out)) == 0
    [line] = out.read_text().splitlines()
    assert json.loads(line)["session_id"] == sid


def test_failures_write_and_delete_nothing(
    memory_stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = uuid.uuid4().hex
    with Client(memory_stack.url) as client:
        finished = rollout(memory_stack, client, run, 1.0)
        running = client.create_session(metadata={"run": run}).id
        out = tmp_path / "batch.parquet"

        code = export(memory_stack, "--session", finished, "--session", running, "-o", str(out))
        assert code == 1 and "not finished" in capsys.readouterr().err

        code = export(memory_stack, "--selector", "run=nothing-like-this", "-o", str(out))
        assert code == 1 and "no finished session matches" in capsys.readouterr().err

        missing = tmp_path / "no-such-dir" / "b.parquet"
        code = export(memory_stack, "--session", finished, "-o", str(missing), "--delete")
        assert code == 2 and "cannot write" in capsys.readouterr().err

        code = export(memory_stack, "--session", finished, "-o", str(tmp_path), "--delete")
        assert code == 2 and "is a directory" in capsys.readouterr().err

        assert not out.exists()
        assert [s.id for s in client.list_finished(selector=f"run={run}")] == [finished]
        client.trajectory(running)


def test_parquet_without_pyarrow_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed
    code = main(["export", "--url", "http://127.0.0.1:9", "-o", str(tmp_path / "b.parquet")])
    assert code == 2 and "pip install 'tokenkeep[parquet]'" in capsys.readouterr().err
