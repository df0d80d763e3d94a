"""What a policy publish says to one vLLM replica: its development endpoints (vLLM 0.32,
`VLLM_SERVER_DEV_MODE=1`), through the engine client's HTTP client (engine key included).
Every call answers or raises `ControlError` naming the replica, the step and the reason."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx

# A reload of the tiny model takes 0.1-0.3 s, a 7B one from local disk tens of seconds; a
# `wait` pause lasts as long as the longest turn in flight.
STEP_TIMEOUT_S = 600.0
RELOAD_METHOD = "reload_weights_tied"  # session_server/vllm_extension.py


class ControlError(Exception):
    def __init__(self, engine: str, step: str, reason: str, *, status: int = 502) -> None:
        super().__init__(f"engine {engine}: {step} failed: {reason}")
        self.engine = engine
        self.step = step
        self.reason = reason
        self.status = status


class VllmControl:
    """One replica's pause, reload, version, checksum and resume."""

    def __init__(self, http: httpx.AsyncClient, url: str, timeout_s: float = STEP_TIMEOUT_S):
        self.http = http
        self.url = url
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)

    async def _call(
        self, step: str, method: str, path: str, *, json_body: Any = None, params: Any = None
    ) -> Any:
        try:
            response = await self.http.request(
                method, self.url + path, json=json_body, params=params, timeout=self.timeout
            )
        except httpx.TimeoutException as exc:
            raise ControlError(self.url, step, f"timed out: {exc!r}", status=504) from exc
        except httpx.HTTPError as exc:
            raise ControlError(self.url, step, f"unreachable: {exc!r}", status=503) from exc
        if response.status_code == 404:
            raise ControlError(
                self.url,
                step,
                f"the engine has no {path}: start it for publishing (VLLM_SERVER_DEV_MODE=1 and "
                "the tokenkeep_vllm extension; `tokenkeep engine start` and ModelServer do)",
            )
        if response.status_code == 401:
            raise ControlError(self.url, step, "the engine refused tokenkeep's engine key")
        if response.status_code != 200:
            raise ControlError(
                self.url, step, f"answered {response.status_code}: {response.text[:300]}"
            )
        try:
            return response.json()
        except ValueError:
            return None

    async def pause(self, mode: str) -> None:
        await self._call("pause", "POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._call("resume", "POST", "/resume")

    async def reload(self, path: str) -> dict[str, Any]:
        """Reload the checkpoint in place, exact for tied embeddings."""
        body = {"method": RELOAD_METHOD, "args": [path]}
        answer = await self._call("reload", "POST", "/collective_rpc", json_body=body)
        results = (answer or {}).get("results") or [{}]
        return results[0] if isinstance(results[0], dict) else {}

    async def drop_prefix_cache(self, *, running: bool) -> None:
        """KV computed by the old weights must not serve a prompt of the new policy.
        `running`: also the blocks of requests frozen by a `keep` pause (they recompute)."""
        answer = await self._call(
            "reset prefix cache",
            "POST",
            "/reset_prefix_cache",
            params={"reset_running_requests": "true" if running else "false"},
        )
        if not (answer or {}).get("success"):
            raise ControlError(self.url, "reset prefix cache", "the engine kept its cache")

    async def set_version(self, version: str) -> None:
        await self._call(
            "set version", "POST", "/update_weight_version", json_body={"new_version": version}
        )

    async def version(self) -> str | None:
        answer = await self._call("weight info", "GET", "/weight_info")
        found = (answer or {}).get("weight_version")
        return None if found is None else str(found)

    async def checksum(self) -> str:
        """One digest of vLLM's per-parameter checksums (`/weight_checker`). Equal digests are
        necessary, not sufficient: on the CPU packed layers and a tied output layer are not
        in them; the exact reload is what `reload_weights_tied` and the tests establish."""
        answer = await self._call(
            "checksum", "POST", "/weight_checker", json_body={"action": "checksum"}
        )
        checksums = (answer or {}).get("checksums") or {}
        encoded = json.dumps(checksums, sort_keys=True).encode()
        return hashlib.sha256(encoded).hexdigest()[:16]
