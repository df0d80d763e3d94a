"""Every mistake on the `tokenkeep` command line is one line on stderr that says what is wrong
and what to do, exit status 2, never a traceback: run through the installed console script,
as a newcomer runs it."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from session_server.app import build_service, create_app
from session_server.settings import Settings
from tests.api.stack import qwen3
from tests.engine_double import EngineDouble
from tests.live_server import serving
from tests.real_tokenizers import qwen3_dir

TOKENKEEP = str(Path(sys.executable).parent / "tokenkeep")
KEY = secrets.token_urlsafe(16)
ENGINE = "http://127.0.0.1:9"


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This machine's environment without any TOKENKEEP_* setting (they would change what a
    command is told), plus `extra`."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TOKENKEEP_")} | (extra or {})


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TOKENKEEP, *args], capture_output=True, text=True, timeout=120, env=_environment(env)
    )


def assert_one_line_mistake(result: subprocess.CompletedProcess[str], phrase: str) -> None:
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tokenkeep"), lines[0]
    assert phrase in lines[0], lines[0]


@pytest.fixture(scope="module")
def keyed_url() -> Iterator[str]:
    """A live server with an admin key."""
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


@pytest.fixture
def closed_url() -> str:
    """A loopback URL that nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def serve(*args: str) -> list[str]:
    return ["serve", "--engine-url", ENGINE, "--tokenizer", str(qwen3_dir()), *args]


CASES = [
    # (command line, extra environment, the phrase that says what to do)
    ([], {}, "required: command"),
    (["frobnicate"], {}, "invalid choice: 'frobnicate'"),
    (["serve", "--engine-url", ENGINE], {}, "required: --tokenizer"),
    (["serve", "--tokenizer", str(qwen3_dir())], {}, "required: --engine-url"),
    (["serve", "--tokenizer", str(qwen3_dir())], {"TOKENKEEP_ENGINE_URLS": " "}, "--engine-url"),
    (
        ["serve", "--engine-url", ENGINE, "--tokenizer", "/no/such/tokenizer"],
        {},
        "/no/such/tokenizer: no such directory",
    ),
    (
        ["serve", "--engine-url", ENGINE, "--tokenizer", str(qwen3_dir() / "tokenizer.json")],
        {},
        "not a directory (give the folder that holds it)",
    ),
    (
        ["serve", "--engine-url", "localhost:8001", "--tokenizer", str(qwen3_dir())],
        {},
        "'localhost:8001' is not an http:// or https:// URL",
    ),
    (serve("--port", "eighty"), {}, "argument --port: invalid int value"),
    (serve("--port", "70000"), {}, "pass --port a number from 1 to 65535"),
    (serve("--host", "no-such-host.invalid", "--insecure"), {}, "pass --host an address"),
    (serve("--host", "0.0.0.0"), {}, "set an admin key (--admin-key / TOKENKEEP_ADMIN_KEY)"),
    (serve("--log-level", "loud"), {}, "argument --log-level: invalid choice: 'loud'"),
    (serve(), {"TOKENKEEP_LOG_LEVEL": "loud"}, "log level 'loud': use one of"),
    (serve(), {"TOKENKEEP_MAX_BODY_BYTES": "10"}, "TOKENKEEP_MAX_BODY_BYTES: Input should be"),
    (serve("--renderer", "no-such-renderer"), {}, "renderer 'no-such-renderer'"),
    (serve("--redis-url", "mysql://db"), {}, "Redis URL must specify one of the following"),
    (["check"], {}, "required: --tokenizer"),
    (["check", "--tokenizer", "/no/such/tokenizer"], {}, "not a directory"),
    (["sessions", "frob"], {}, "invalid choice: 'frob'"),
    (["sessions", "--url", "localhost:8000", "list"], {}, "not an http:// or https:// URL"),
    (["sessions", "list"], {"TOKENKEEP_URL": "ftp://host"}, "not an http:// or https:// URL"),
    (["export", "--session", "s"], {}, "required: -o/--output"),
    (["export", "-o", "/no/such/dir/batch.jsonl"], {}, "cannot write"),
]


@pytest.mark.parametrize(("args", "env", "phrase"), CASES, ids=[c[2][:48] for c in CASES])
def test_a_mistake_is_one_line_and_exit_2(
    args: list[str], env: dict[str, str], phrase: str
) -> None:
    assert_one_line_mistake(run(*args, env=env), phrase)


def test_a_port_in_use_is_found_before_the_model_loads(busy_port: int) -> None:
    result = run(*serve("--port", str(busy_port)))
    assert_one_line_mistake(result, f"port {busy_port} on 127.0.0.1 is already in use")
    assert "pass another --port" in result.stderr


@pytest.mark.parametrize("command", [["sessions", "list"], ["export", "-o", "batch.jsonl"]])
def test_an_unreachable_server_says_which_url_to_pass(
    command: list[str], closed_url: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [TOKENKEEP, *command],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_environment({"TOKENKEEP_URL": closed_url}),
    )
    assert_one_line_mistake(result, f"cannot reach {closed_url}")
    assert "--url or TOKENKEEP_URL" in result.stderr
    assert not (tmp_path / "batch.jsonl").exists()


def test_the_default_url_is_where_serve_listens_by_default(tmp_path: Path) -> None:
    host, port = (Settings.model_fields[name].default for name in ("host", "port"))
    result = run("sessions", "list", env={"TOKENKEEP_CACHE_DIR": str(tmp_path)})
    if result.returncode == 0:
        pytest.skip("a server listens at serve's default address on this machine")
    assert f"cannot reach http://{host}:{port} " in result.stderr
    assert "`tokenkeep demo` (found without --url while it runs)" in result.stderr


def test_sessions_finds_a_running_demo_without_url(keyed_url: str, tmp_path: Path) -> None:
    """`tokenkeep demo` announces its server in the cache folder while it runs: `tokenkeep
    sessions` (no command: the listing) reads it; a file whose demo is gone is ignored."""
    env = {"TOKENKEEP_CACHE_DIR": str(tmp_path), "TOKENKEEP_ADMIN_KEY": KEY}
    announced = tmp_path / "local-stack.json"
    announced.write_text(json.dumps({"url": keyed_url, "pid": os.getpid()}))
    found = run("sessions", env=env)
    assert found.returncode == 0 and "sessions (offset 0)" in found.stdout, found.stderr
    ended = subprocess.Popen(["true"])  # a demo that was killed: its process is gone
    ended.wait()
    announced.write_text(json.dumps({"url": keyed_url, "pid": ended.pid}))
    assert_one_line_mistake(run("sessions", env=env), "cannot reach http://127.0.0.1:8000")


@pytest.mark.parametrize("command", [["sessions", "list"], ["export", "-o", "batch.jsonl"]])
def test_a_keyed_server_without_the_key_says_how_to_pass_it(
    command: list[str], keyed_url: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [TOKENKEEP, command[0], "--url", keyed_url, *command[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=_environment(),
    )
    assert_one_line_mistake(result, "HTTP 401")
    assert "pass it with --admin-key or TOKENKEEP_ADMIN_KEY" in result.stderr
    wrong = run("sessions", "--url", keyed_url, "--admin-key", "not-the-key", "list")
    assert_one_line_mistake(wrong, "the admin key given is not the server's")


def test_a_reader_that_goes_away_is_one_line_not_a_traceback(keyed_url: str) -> None:
    """`tokenkeep sessions list | head`: the reader closes the pipe before the output."""
    proc = subprocess.Popen(
        [TOKENKEEP, "sessions", "--url", keyed_url, "--admin-key", KEY, "list"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes: every write it makes breaks the pipe
    stderr = proc.stderr.read()
    assert proc.wait(60) == 2
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert stderr.splitlines() == [
        "tokenkeep: the output was closed before it was complete (broken pipe)"
    ]


def test_version_is_the_installed_package_version() -> None:
    from importlib import metadata

    result = run("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"tokenkeep {metadata.version('tokenkeep')}"


def test_serve_help_describes_itself_marks_required_flags_and_shows_defaults() -> None:
    result = run("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines at the terminal's width
    assert "Run the session server in front of vLLM engines" in text
    assert "--engine-url ENGINE_URLS engine base URL; repeat for replicas (required;" in text
    assert "--tokenizer TOKENIZER" in text and "(required; TOKENKEEP_TOKENIZER)" in text
    assert "--port PORT port (TOKENKEEP_PORT; default: 8000)" in text
    assert "--host HOST bind address (TOKENKEEP_HOST; default: 127.0.0.1)" in text
    assert "(TOKENKEEP_MAX_INFLIGHT; default: 256)" in text
    assert "--log-level {critical,error,warning,info,debug,trace}" in text
    assert "(TOKENKEEP_LOG_LEVEL; default: info)" in text
    # Set in the environment, the flag is no longer required (the operator sets variables).
    configured = run("serve", "--help", env={"TOKENKEEP_TOKENIZER": str(qwen3_dir())})
    assert "(required; TOKENKEEP_TOKENIZER)" not in " ".join(configured.stdout.split())


@pytest.mark.parametrize("command", ["check", "sessions", "export"])
def test_the_other_commands_describe_themselves_and_show_defaults(
    command: str, tmp_path: Path
) -> None:
    # An empty cache folder: no running demo to take the default URL from.
    result = run(command, "--help", env={"TOKENKEEP_ADMIN_KEY": KEY,
                                         "TOKENKEEP_CACHE_DIR": str(tmp_path)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert result.stdout.splitlines()[0].startswith(f"usage: tokenkeep {command}")
    assert KEY not in text  # the key from the environment is no default to print
    expected = {
        "check": "(required)",
        "sessions": "(TOKENKEEP_URL; else a running `tokenkeep demo`; else where `tokenkeep "
        "serve` listens by default) (default: http://127.0.0.1:8000)",
        "export": "--limit LIMIT most sessions a selector picks (default: 1000)",
    }[command]
    assert expected in text
