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
