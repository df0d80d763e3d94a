"""`tokenkeep sessions` and `tokenkeep export` take the server's key the same way:
`--admin-key` or TOKENKEEP_ADMIN_KEY, with the older `--api-key` / TOKENKEEP_API_KEY still
accepted, against a live server that has an admin key."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from session_server.app import build_service, create_app
from session_server.cli import main
from session_server.settings import Settings
from tests.api.stack import qwen3
from tests.engine_double import EngineDouble
from tests.live_server import serving
from tests.real_tokenizers import qwen3_dir

KEY = secrets.token_urlsafe(16)


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    double = EngineDouble().start()
    config = Settings(
        engine_urls=[double.url], model=double.model, tokenizer=str(qwen3_dir()), admin_key=KEY
    )
    app = create_app(config, build_service(config, model=qwen3()))
    try:
        with serving(app) as url:
            yield url
    finally:
        double.stop()


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENKEEP_ADMIN_KEY", raising=False)
    monkeypatch.delenv("TOKENKEEP_API_KEY", raising=False)


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (["--admin-key", KEY], {}),
        (["--api-key", KEY], {}),
        ([], {"TOKENKEEP_ADMIN_KEY": KEY}),
        ([], {"TOKENKEEP_API_KEY": KEY}),
    ],
)
def test_sessions_and_export_take_the_key_the_same_way(
    keyed_url: str,
    flags: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["sessions", "--url", keyed_url, *flags, "list", "--json"]) == 0
    assert '"sessions": []' in capsys.readouterr().out
    out = tmp_path / "b.jsonl"
    code = main(["export", "--url", keyed_url, *flags, "--no-progress", "-o", str(out)])
    assert code == 1
    assert "no finished session matches" in capsys.readouterr().err


def test_without_the_key_both_say_the_server_refused_and_how_to_pass_it(
    keyed_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["sessions", "--url", keyed_url, "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenkeep sessions: HTTP 401: ")
    assert "--admin-key or TOKENKEEP_ADMIN_KEY" in err
    out = tmp_path / "b.jsonl"
    assert main(["export", "--url", keyed_url, "--no-progress", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenkeep export: the server refused: ")
    assert "--admin-key or TOKENKEEP_ADMIN_KEY" in err
    assert not out.exists()
