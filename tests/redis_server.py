"""Start a throwaway redis-server: used by the `redis_server` fixture and by bench/."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_redis_server(
    workdir: Path,
    attempts: int = 3,
    *,
    port: int | None = None,
    args: Sequence[str] = ("--save", "", "--appendonly", "no"),
) -> tuple[subprocess.Popen[bytes], str]:
    """Start redis-server (by default without persistence) on a free loopback port (never
    6379), or on `port` (a restart); returns the process and its URL. Retries on another
    free port if the chosen one was taken meanwhile. `args` are extra server options."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    log = workdir / "redis.log"
    for _ in range(attempts):
        chosen = port or _free_loopback_port()
        proc = subprocess.Popen(
            [
                binary,
                "--bind", "127.0.0.1",
                "--port", str(chosen),
                "--dir", str(workdir),
                "--logfile", str(log),
                *args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"redis://127.0.0.1:{chosen}/0"
        client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    if client.ping():
                        return proc, url
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        stop_redis_server(proc)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"redis-server did not start; its log ends with:\n{tail}")


def stop_redis_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
