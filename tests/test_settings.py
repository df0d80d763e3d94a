"""`tokenkeep serve` refuses a TOKENKEEP_* variable it does not know (the settings would
ignore it, and a misspelt setting would be lost without a word), and leaves alone the ones
other parts of tokenkeep read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from session_server.settings import (
    ENV_NAMES,
    OTHER_VARIABLES,
    READ_VARIABLES,
    Settings,
    unknown_variable,
)


def test_a_misspelt_setting_is_named_with_the_closest_real_one() -> None:
    environ = {"PATH": "/bin", "TOKENKEEP_MODEL": "m", "TOKENKEEP_MAX_INFLIGT": "4"}
    assert unknown_variable(environ) == (
        "unknown setting TOKENKEEP_MAX_INFLIGT; did you mean TOKENKEEP_MAX_INFLIGHT?"
    )
    assert "TOKENKEEP_ADMIN_KEY?" in (unknown_variable({"TOKENKEEP_ADMINKEY": "k"}) or "")


def test_every_setting_and_the_other_parts_variables_are_accepted() -> None:
    environ = dict.fromkeys(READ_VARIABLES | OTHER_VARIABLES, "1")
    # Lower case too: pydantic-settings reads names case-insensitively.
    environ["tokenkeep_port"] = "8000"
    assert unknown_variable(environ) is None
    # The older name of the admin key still sets it.
    assert "TOKENKEEP_API_KEY" in READ_VARIABLES


def test_every_variable_the_repository_reads_is_a_setting_or_another_parts() -> None:
    """A TOKENKEEP_* variable read elsewhere (os.environ, $NAME in the Makefile or docs) but
    missing from OTHER_VARIABLES would stop `serve` wherever it is exported."""
    root = Path(__file__).parents[1]
    files = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    read = re.compile(r"""(?:environ(?:\.get\(|\[)|getenv\(|\$\{?)["']?(TOKENKEEP_[A-Z0-9_]+)""")
    names = set()
    for name in files:
        path = root / name
        if path.suffix in {".py", ".md", ".sh", ".yaml", ".toml", ""} and path.is_file():
            names |= set(read.findall(path.read_text(errors="replace")))
    assert "TOKENKEEP_CACHE_DIR" in names  # the pattern finds what it is meant to
    assert names - READ_VARIABLES - OTHER_VARIABLES == set()


def test_kubernetes_service_links_of_a_tokenkeep_service_are_accepted() -> None:
    """A pod with service links on, in a namespace with a Service named tokenkeep-sessions."""
    environ = {
        "TOKENKEEP_SESSIONS_SERVICE_HOST": "10.0.0.7",
        "TOKENKEEP_SESSIONS_SERVICE_PORT": "8000",
        "TOKENKEEP_SESSIONS_SERVICE_PORT_HTTP": "8000",
        "TOKENKEEP_SESSIONS_PORT": "tcp://10.0.0.7:8000",
        "TOKENKEEP_SESSIONS_PORT_8000_TCP": "tcp://10.0.0.7:8000",
        "TOKENKEEP_SESSIONS_PORT_8000_TCP_ADDR": "10.0.0.7",
    }
    assert unknown_variable(environ) is None
    # The same shape of name with a plain value is a setting's typo, not a service link.
    assert unknown_variable({"TOKENKEEP_POLICY_PORT": "9000"}) is not None


def test_env_names_are_the_variables_the_settings_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator renders ENV_NAMES: each one must set its field."""
    for name in os.environ:
        if name.startswith("TOKENKEEP_"):
            monkeypatch.delenv(name)
    defaults = Settings().model_dump()
    values = dict.fromkeys(ENV_NAMES, "4096")
    values |= {"engine_urls": "http://engine:8000", "sampling_overrides": '{"top_p": 0.5}'}
    values |= {"engine_kind": "sglang"}
    switches = ("engine_discovery", "routed_experts", "insecure", "session_id_keys")
    values |= dict.fromkeys(switches, "true")
    values |= dict.fromkeys(("create_sessions_on_first_use", "startup_check"), "false")
    for field, value in values.items():
        monkeypatch.setenv(ENV_NAMES[field], value)
    configured = Settings().model_dump()
    assert [field for field in ENV_NAMES if configured[field] == defaults[field]] == []


def test_serve_refuses_an_unknown_variable_in_one_line_with_exit_code_2() -> None:
    """The real command, before anything is loaded or bound."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENKEEP_")}
    env["TOKENKEEP_SESION_TTL_SECONDS"] = "60"
    result = subprocess.run(
        [sys.executable, "-m", "session_server.cli", "serve", "--engine-url", "http://127.0.0.1:9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "tokenkeep serve: unknown setting TOKENKEEP_SESION_TTL_SECONDS; "
        "did you mean TOKENKEEP_SESSION_TTL_SECONDS?"
    ]
    assert result.stdout == ""
