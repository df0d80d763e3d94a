"""The session server of the local stack, in a thread of this process (`demo`, `demo --train`)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from session_server.devtools import localengine


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def waiting(what: str, every_s: float = 5.0) -> Iterator[None]:
    """A progress line every `every_s` seconds while the block runs, none if it is quicker:
    a wait the user cannot see the end of (the first turn, a model loading) is not silent."""
    done = threading.Event()
    started = time.monotonic()

    def report() -> None:
        while not done.wait(every_s):
            progress(f"{what}… {time.monotonic() - started:.0f}s")

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


@contextmanager
def local_server(
    engine_url: str, model: str, model_dir: Path, redis_url: str | None, port: int
) -> Iterator[str]:
    """The session server on a loopback port, in a thread of this process."""
    import uvicorn

    from session_server.app import create_app
    from session_server.settings import Settings

    settings = Settings(
        engine_urls=[engine_url],
        model=model,
        tokenizer=str(model_dir),
        context_length=localengine.DEFAULT_MAX_MODEL_LEN,
        redis_url=redis_url,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    with waiting("[server] starting the session server (loading the tokenizer)"):
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the session server did not start")
            time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
