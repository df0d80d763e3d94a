"""`tokenkeep` command line: serve, check, engine, demo, operator, sessions, export."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import metadata
from typing import Any

from tokenkeep.cli import Parser, fail, http_url

SERVE = """Run the session server in front of vLLM engines: every turn of a session is
stored token-exact and sent to the engine as token IDs.

Every flag is also a TOKENKEEP_* environment variable (how the operator configures pods); a
flag given wins over its variable.

    tokenkeep serve --engine-url http://127.0.0.1:8001 --model NAME --tokenizer DIR
"""
PROG = "tokenkeep serve"
# uvicorn's levels (it names TRACE itself, below DEBUG).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from session_server.settings import Settings

    p = sub.add_parser("serve", help="run the session server", description=SERVE)

    def flag(name: str, help_text: str, **kwargs: Any) -> None:
        # The flag's default stays None, so that its variable (read by Settings) applies;
        # the help shows that variable and Settings' own default.
        dest = kwargs.setdefault("dest", name[2:].replace("-", "_"))
        env = f"TOKENKEEP_{dest.upper()}"
        notes = [env]
        default = Settings.model_fields[dest].get_default(call_default_factory=True)
        if default not in (None, "", []) and default is not False:
            notes.append(f"default: {default}")
        if kwargs.pop("needed", False) and not os.environ.get(env):
            # Required unless its variable is set: argparse then names it as missing.
            kwargs["required"] = True
            notes.insert(0, "required")
        p.add_argument(name, help=f"{help_text} ({'; '.join(notes)})", **kwargs)

    flag(
        "--engine-url",
        "engine base URL; repeat for replicas",
        action="append",
        dest="engine_urls",
        type=http_url,
        needed=True,
    )
    flag(
        "--engine",
        "the engine's wire format: vllm or sglang",
        dest="engine_kind",
        choices=("vllm", "sglang"),
    )
    flag("--model", "served model name")
    flag("--tokenizer", "tokenizer directory, or a Hugging Face id in the local cache", needed=True)
    flag("--renderer", "auto or a renderer name")
    flag("--redis-url", "Redis URL; absent: the embedded store")
    flag("--host", "bind address")
    flag("--port", "port", type=int)
    flag("--context-length", "max model length; default: the tokenizer's", type=int)
    flag(
        "--engine-discovery",
        "one replica per address of each engine host",
        action="store_true",
        default=None,
    )
    flag("--max-inflight", "generation requests run at once", type=int)
    flag("--max-queue", "requests that may wait for a slot", type=int)
    flag("--queue-timeout-s", "longest wait for a slot", type=float)
    flag("--body-timeout-s", "longest read of a request body", type=float)
    flag("--header-timeout-s", "longest read of a request's headers", type=float)
    flag("--max-header-bytes", "largest request head", type=int)
    flag("--keep-alive-s", "idle client connections close after this", type=float)
    flag("--engine-max-inflight", "requests in flight per engine replica", type=int)
    flag(
        "--engine-key",
        "sent to every engine replica (Authorization: Bearer); engines started for "
        "publishing (tokenkeep engine start --engine-key, ModelServer) ask for it",
    )
    flag(
        "--engine-health-interval-s",
        "how often replicas are checked, and fenced or caught up to the published policy",
        type=float,
    )
    flag("--shutdown-grace-s", "on SIGTERM, time for in-flight requests to finish", type=float)
    flag("--redis-retry-s", "retry Redis this long before 503", type=float)
    flag("--redis-wait-replicas", "acknowledge a turn once N Redis replicas hold it", type=int)
    flag(
        "--max-policy-lag",
        "refuse a turn (409) once the engine's version exceeds the rollout's first turn's "
        "by more than K",
        type=int,
    )
    flag(
        "--admin-key",
        "key for management, export and POST /sessions; unset: protected mode, loopback "
        "clients only",
    )
    flag(
        "--session-id-keys",
        "accept tk-<session id> as a session key: derivable from the id, trusted setups only",
        action="store_true",
        default=None,
    )
    flag(
        "--insecure",
        "with no admin key, answer every client, not only loopback",
        action="store_true",
        default=None,
    )
    flag("--max-body-bytes", "largest request body; larger get 413", type=int)
    flag("--max-body-strings", "most JSON strings in a request body; more get 413", type=int)
    flag(
        "--routed-experts",
        "store MoE expert routes of every session by default; the engine needs "
        "--enable-return-routed-experts",
        action="store_true",
        default=None,
    )
    flag("--log-level", "log level", type=str.lower, choices=LOG_LEVELS)


def _bind_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on host:port, found before the model is loaded (uvicorn
    finds out after, and logs it among the start-up lines)."""
    import errno
    import socket

    if not 0 <= port <= 65535:
        return f"port {port} is not a TCP port: pass --port a number from 1 to 65535"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn picks it
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except (OSError, UnicodeError) as exc:
            if getattr(exc, "errno", None) == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is already in use: stop what listens there "
                    "or pass another --port"
                )
            reason = getattr(exc, "strerror", None) or exc
            return (
                f"cannot listen on {host}:{port} ({reason}): pass --host an address of this machine"
            )
    return None


class _StartError(Exception):
    """What stops `tokenkeep serve` from starting, in one line."""


def _service(settings: Any) -> Any:
    """The TurnService these settings describe; _StartError where the tokenizer, renderer or
    store cannot be had."""
    from session_server.app import build_service
    from session_server.check.scenarios import one_line
    from session_server.splice import ChatModel
    from session_server.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(
            settings.tokenizer, settings.shared_tokens_bytes, revision=settings.tokenizer_revision
        )
    except Exception as exc:  # whatever transformers raises on a folder or id it cannot load
        raise _StartError(
            f"cannot load the tokenizer {settings.tokenizer}: {one_line(exc)}"
        ) from None
    try:
        model = ChatModel(tokenizer, settings.renderer)
    except Exception as exc:
        raise _StartError(f"renderer {settings.renderer!r}: {one_line(exc)}") from None
    try:
        return build_service(settings, model=model)
    except ValueError as exc:  # a setting the store cannot use (a Redis URL's scheme), or
        # sampling overrides every turn would fail on
        raise _StartError(one_line(exc)) from None


class _HeldLogs:
    """Holds the start-up log lines until the server is sure to start: a start that fails
    prints its one line, not the lines of the steps that went well before it."""

    def __enter__(self) -> _HeldLogs:
        from logging.handlers import MemoryHandler

        self.root = logging.getLogger()
        self.handlers = self.root.handlers[:]
        # No target: it never flushes by itself, whatever the level.
        self.held = MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
        self.root.handlers = [self.held]
        return self

    def release(self) -> None:
        """The start went well: the held lines appear, in their order."""
        for record in self.held.buffer:
            for handler in self.handlers:
                if record.levelno >= handler.level:
                    handler.handle(record)

    def __exit__(self, *exc: object) -> None:
        self.root.handlers = self.handlers


def _tokenizer_problem(tokenizer: str) -> str | None:
    """A --tokenizer that names a path, and no directory is there. transformers would take it
    for a Hugging Face id and answer with an 80-line traceback about repo id syntax."""
    from pathlib import Path

    path = Path(tokenizer)
    if path.is_dir():
        return None
    if path.exists():
        return f"--tokenizer {tokenizer}: not a directory (give the folder that holds it)"
    if path.is_absolute() or tokenizer.startswith((".", "~")) or tokenizer.count("/") > 1:
        return (
            f"--tokenizer {tokenizer}: no such directory (give a tokenizer directory, or a "
            "Hugging Face id in the local cache)"
        )
    return None


def serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from session_server.settings import Settings, listen_problem, log_mode

    overrides = {
        k: v for k, v in vars(args).items() if v is not None and k in Settings.model_fields
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else "a setting"
        return fail(PROG, f"TOKENKEEP_{name.upper()}: {error['msg']}")
    if not settings.engine_urls:
        return fail(PROG, "give --engine-url (or TOKENKEEP_ENGINE_URLS)")
    for url in settings.engine_urls:  # from TOKENKEEP_ENGINE_URLS: argparse checked the flags
        try:
            http_url(url)
        except argparse.ArgumentTypeError as exc:
            return fail(PROG, f"engine URL {exc}")
    if not settings.tokenizer:
        return fail(PROG, "give --tokenizer (or TOKENKEEP_TOKENIZER): a tokenizer directory")
    if settings.log_level.lower() not in LOG_LEVELS:
        return fail(PROG, f"log level {settings.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    problem = (
        listen_problem(settings)
        or _bind_problem(settings.host, settings.port)
        or _tokenizer_problem(settings.tokenizer)
    )
    if problem:
        return fail(PROG, problem)
    import uvicorn

    from session_server.app import GracefulServer, create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s")
    # Lines are their message only: the thread and process names every LogRecord looks up
    # were half of each request's access-log line, for fields nobody prints.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    # httpx logs every engine request at INFO: a second line per turn, formatted on the
    # request path, next to tokenkeep's own access log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    from session_server.api.limits import TimedHttpProtocol

    with _HeldLogs() as held:
        log_mode(settings)
        try:
            service = _service(settings)
        except _StartError as exc:
            return fail(PROG, str(exc))
        held.release()
    app = create_app(settings, service)
    if settings.startup_check:
        _start_check(app.state.turns, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
        http=TimedHttpProtocol.configured(settings.header_timeout_s, settings.max_header_bytes),
        # A rollout burst connects all at once: uvicorn's 2048 backlog would leave the rest
        # to SYN retries (1 s, 3 s, ...). The kernel caps it at net.core.somaxconn.
        backlog=max(2048, settings.max_inflight + settings.max_queue),
        # After the drain (GracefulServer) little is left; this bounds what is.
        timeout_graceful_shutdown=5,
    )
    GracefulServer(config, app.state.admission, settings.shutdown_grace_s).run()
    return 0


def _start_check(service: Any, settings: Any) -> None:
    """The pre-flight check on the served model, off the request path: a daemon thread with
    its own event loop and its own in-process app, so /healthz never waits on it."""
    import threading
    from pathlib import Path

    from session_server.check import startup_check

    def run() -> None:
        try:
            startup_check(
                service.model,
                Path(settings.check_cache_dir).expanduser(),
                lambda ok: service.metrics.check_contiguous.set(1 if ok else 0),
                service.metrics.record_reply_check,
            )
        except Exception:  # a failed check must never take the server down
            logging.getLogger("tokenkeep.check").exception("start-up check failed to run")

    thread = threading.Thread(target=run, name="tokenkeep-check", daemon=True)
    quiet = logging.Filter()
    # The check's own in-process requests are not traffic: keep them out of the request log.
    quiet.filter = lambda record: record.threadName != thread.name  # type: ignore[method-assign]
    for name in ("tokenkeep", "tokenkeep.requests", "httpx"):
        logging.getLogger(name).addFilter(quiet)
    thread.start()


# Subcommands that own their argument parsing: the rest of the command line goes to them.
_DELEGATED = {
    "engine": ("session_server.devtools.localengine", "a real vLLM engine on this machine's CPU"),
    "operator": ("tokenkeep_operator.cli", "run the Kubernetes operator"),
    "demo": ("session_server.devtools.demo", "run the whole stack locally and drive a session"),
    "sessions": ("tokenkeep.cli.sessions", "list a running server's sessions, show one"),
    "check": ("session_server.check", "will this model's rollouts stay token-exact? (pre-flight)"),
    "export": ("tokenkeep.cli.export", "write finished rollouts to a Parquet or JSONL file"),
}


def main(argv: list[str] | None = None) -> int:
    try:
        status = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, not at exit, where a broken pipe is a traceback-like report
        return status
    except BrokenPipeError:
        # The reader went away (`tokenkeep sessions show ... | head`). Later writes, and the
        # interpreter's flush of stdout at exit, would raise again: stdout goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return fail("tokenkeep", "the output was closed before it was complete (broken pipe)")


def _main(argv: list[str]) -> int:
    if argv and argv[0] in _DELEGATED:
        import importlib

        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    if argv and argv[0] == "serve":
        from session_server.settings import unknown_variable

        # First: the settings would ignore a misspelt variable, and a required flag whose
        # variable is misspelt would be reported missing rather than misspelt.
        problem = unknown_variable(os.environ)
        if problem:
            return fail(PROG, problem)
    parser = Parser(prog="tokenkeep", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tokenkeep {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, (_module, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    return serve(args)


def _version() -> str:
    try:
        return metadata.version("tokenkeep")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())
