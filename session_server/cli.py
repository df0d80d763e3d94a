"""`tokenkeep` command line: serve, check, engine, demo, operator, sessions, export."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

# How long an idle client connection stays open. It must outlast the clients' own pool expiry
# (httpx and the OpenAI/Anthropic SDKs: 5 s, aiohttp: 15 s): with uvicorn's default of 5 s the
# server closed connections that a busy client was just reusing, and that request got no
# response at all.
KEEP_ALIVE_S = 75


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the session server")
    env = os.environ.get
    p.add_argument(
        "--engine-url",
        action="append",
        dest="engine_urls",
        help="engine base URL; repeat for replicas (TOKENKEEP_ENGINE_URLS)",
    )
    p.add_argument(
        "--engine",
        dest="engine_kind",
        choices=("vllm", "sglang"),
        help="the engine's wire format: vllm (default) or sglang (TOKENKEEP_ENGINE_KIND)",
    )
    p.add_argument("--model", help="served model name (TOKENKEEP_MODEL)")
    p.add_argument("--tokenizer", help="tokenizer directory or id (TOKENKEEP_TOKENIZER)")
    p.add_argument("--renderer", help="auto (default) or a renderer name (TOKENKEEP_RENDERER)")
    p.add_argument("--redis-url", help="Redis URL; absent: embedded store (TOKENKEEP_REDIS_URL)")
    p.add_argument("--host", help="bind address (TOKENKEEP_HOST)")
    p.add_argument("--port", type=int, help="port (TOKENKEEP_PORT)")
    p.add_argument("--context-length", type=int, help="max model length (TOKENKEEP_CONTEXT_LENGTH)")
    p.add_argument(
        "--engine-discovery",
        action="store_true",
        default=None,
        help="one replica per address of each engine host (TOKENKEEP_ENGINE_DISCOVERY)",
    )
    limits = (
        ("--max-inflight", int, "generation requests run at once (TOKENKEEP_MAX_INFLIGHT)"),
        ("--max-queue", int, "requests that may wait for a slot (TOKENKEEP_MAX_QUEUE)"),
        ("--queue-timeout-s", float, "longest wait for a slot (TOKENKEEP_QUEUE_TIMEOUT_S)"),
        (
            "--engine-max-inflight",
            int,
            "requests in flight per engine replica (TOKENKEEP_ENGINE_MAX_INFLIGHT)",
        ),
        (
            "--shutdown-grace-s",
            float,
            "on SIGTERM, time for in-flight requests to finish (TOKENKEEP_SHUTDOWN_GRACE_S)",
        ),
        ("--redis-retry-s", float, "retry Redis this long before 503 (TOKENKEEP_REDIS_RETRY_S)"),
        (
            "--redis-wait-replicas",
            int,
            "acknowledge a turn once N Redis replicas hold it (TOKENKEEP_REDIS_WAIT_REPLICAS)",
        ),
        (
            "--max-policy-lag",
            int,
            "refuse a turn (409) once the engine's version exceeds the rollout's first turn's "
            "by more than K (TOKENKEEP_MAX_POLICY_LAG)",
        ),
    )
    for flag, kind, help_text in limits:
        p.add_argument(flag, type=kind, help=help_text)
    p.add_argument(
        "--admin-key",
        help="key for management, export and POST /sessions (TOKENKEEP_ADMIN_KEY); "
        "unset: protected mode, loopback clients only",
    )
    p.add_argument(
        "--session-id-keys",
        action="store_true",
        default=None,
        help="accept tk-<session id> as a session key: derivable from the id, trusted setups "
        "only (TOKENKEEP_SESSION_ID_KEYS)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="with no admin key, answer every client, not only loopback (TOKENKEEP_INSECURE)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        help="largest request body; larger get 413 (TOKENKEEP_MAX_BODY_BYTES, default 8 MiB)",
    )
    p.add_argument(
        "--routed-experts",
        action="store_true",
        default=None,
        help="store MoE expert routes of every session by default; the engine needs "
        "--enable-return-routed-experts (TOKENKEEP_ROUTED_EXPERTS)",
    )
    p.add_argument("--log-level", default=env("TOKENKEEP_LOG_LEVEL", "info"))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from session_server.settings import Settings, listen_problem, log_mode

    overrides = {
        k: v for k, v in vars(args).items() if v is not None and k in Settings.model_fields
    }
    settings = Settings(**overrides)
    if not settings.engine_urls:
        print("tokenkeep serve: give --engine-url (or TOKENKEEP_ENGINE_URLS)", file=sys.stderr)
        return 2
    problem = listen_problem(settings)
    if problem:
        print(f"tokenkeep serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(message)s")
    # Lines are their message only: the thread and process names every LogRecord looks up
    # were half of each request's access-log line, for fields nobody prints.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    log_mode(settings)
    # httpx logs every engine request at INFO: a second line per turn, formatted on the
    # request path, next to tokenkeep's own access log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    from session_server.app import GracefulServer, create_app

    app = create_app(settings)
    if settings.startup_check:
        _start_check(app.state.turns, settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        import importlib

        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="tokenkeep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, (_module, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
