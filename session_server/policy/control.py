"""What a policy publish says to one engine replica, through the engine client's HTTP client
(engine key included): `VllmControl` (vLLM 0.32's development endpoints,
`VLLM_SERVER_DEV_MODE=1`) or `SglangControl` (SGLang's native endpoints), one `EngineControl`
interface, chosen by the wire's kind (`control_for`). Every call answers or raises
`ControlError` naming the replica, the step and the reason."""

from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, Protocol

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


class EngineControl(Protocol):
    """One replica's pause, reload, prefix-cache drop, version, checksum and resume: what
    `policy/fleet.py` drives, engine-neutral."""

    kind: ClassVar[str]
    pause_modes: ClassVar[tuple[str, ...]]
    """The `POST /policy` pause modes this engine can honour (others are refused, 501,
    before any engine is touched)."""

    async def pause(self, mode: str) -> None: ...
    async def reload(self, path: str, version: str | None = None) -> dict[str, Any]: ...
    async def drop_prefix_cache(self, *, running: bool) -> None: ...
    async def set_version(self, version: str) -> None: ...
    async def version(self) -> str | None: ...
    async def checksum(self) -> str | None: ...
    async def resume(self) -> None: ...


class _HttpControl:
    """The HTTP plumbing both engines' controls share."""

    kind: ClassVar[str] = ""
    missing_hint: ClassVar[str] = ""

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
            raise ControlError(self.url, step, f"the engine has no {path}: {self.missing_hint}")
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


class VllmControl(_HttpControl):
    """One vLLM replica's pause, reload, version, checksum and resume."""

    kind = "vllm"
    pause_modes = ("keep", "wait", "abort")
    missing_hint = (
        "start it for publishing (VLLM_SERVER_DEV_MODE=1 and the tokenkeep_vllm extension; "
        "`tokenkeep engine start` and ModelServer do)"
    )

    async def pause(self, mode: str) -> None:
        await self._call("pause", "POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._call("resume", "POST", "/resume")

    async def reload(self, path: str, version: str | None = None) -> dict[str, Any]:
        """Reload the checkpoint in place, exact for tied embeddings (the version is set
        by `set_version`, the engine still paused)."""
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


class SglangControl(_HttpControl):
    """One SGLang replica, through SGLang's native HTTP endpoints as sgl-project/sglang
    defines them at commit 0025436 (`python/sglang/srt/entrypoints/http_server.py`; the
    request bodies are `io_struct.py`'s `UpdateWeightFromDiskReqInput` and
    `UpdateWeightVersionReqInput`):

    - `POST /pause_generation` takes no body there: the tokenizer manager sets `is_pause`
      and aborts every request in flight (`abort_request(abort_all=True)`); new requests
      wait until `POST /continue_generation`. The `mode` field (`abort | retract |
      in_place`, `PauseGenerationReqInput`) came later; at 0025436 a body is ignored, so
      none is sent.
    - `POST /update_weights_from_disk {"model_path", "abort_all_requests": false,
      "weight_version"}`: answers 200 `{"success": true, "message", "num_paused_requests"}`,
      or 400 with `"success": false` (a folder it cannot read: "Failed to get weights
      iterator: ..."; a load that fails midway is rolled back to the old weights by SGLang
      itself). Without a pause it takes the model-update writer lock: it waits for the
      generations in flight (which hold the reader lock) to finish on the old weights and
      holds new ones until the new weights are in. On success the scheduler flushes its
      radix cache itself (and asserts the flush: the engine must be idle) and the HTTP
      handler sets `weight_version`, before any held request runs.
    - `POST /flush_cache` (GET or POST): 200, or 400 "when there are running or waiting
      requests".
    - `POST /update_weight_version {"new_version", "abort_all_requests"}`: its
      `abort_all_requests` defaults to true (every request on the engine aborted: the
      cause of Miles #2589), so it is always sent as false.
    - `GET /get_weight_version` -> `{"weight_version"}` (also in `/get_model_info` and
      `/get_server_info`, from `server_args.weight_version`, `"default"` at start).

    Pause modes: `abort` -> `/pause_generation` (SGLang's pause is abort-all: the turns in
    flight end with `finish_reason: abort`); `wait` -> no pause call, the reload's own
    writer lock lets the turns in flight finish on the old weights first; `keep` (freeze
    the turns in flight and resume them on the new weights) cannot be honoured: 0025436's
    pause has no mode (later SGLang's `retract` would be it), so a `keep` publish to SGLang
    engines is refused with 501 before any engine is touched.

    No checksum: 0025436 has no whole-model weight checker (only `/get_weights_by_name`,
    the first values of one named parameter), so `checksum()` is None, the fleet compares
    nothing and a publish's `checksum` is null on SGLang. A failed reload is still fenced.
    """

    kind = "sglang"
    pause_modes = ("wait", "abort")
    missing_hint = "is it an SGLang server (0.5.x, `python -m sglang.launch_server`)?"

    def __init__(self, http: httpx.AsyncClient, url: str, timeout_s: float = STEP_TIMEOUT_S):
        super().__init__(http, url, timeout_s)
        self._paused = False

    async def pause(self, mode: str) -> None:
        if mode not in self.pause_modes:
            raise ControlError(self.url, "pause", f"SGLang cannot pause with {mode!r}", status=501)
        if mode == "abort":
            await self._call("pause", "POST", "/pause_generation")
            self._paused = True

    async def resume(self) -> None:
        await self._call("resume", "POST", "/continue_generation")
        self._paused = False

    async def reload(self, path: str, version: str | None = None) -> dict[str, Any]:
        """The weights and (SGLang sets it in the same step, before a held request runs)
        the version: under `wait` no turn can be sampled by the new weights and stamped
        with the old version."""
        body: dict[str, Any] = {"model_path": path, "abort_all_requests": False}
        if version is not None:
            body["weight_version"] = version
        answer = await self._call("reload", "POST", "/update_weights_from_disk", json_body=body)
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise ControlError(self.url, "reload", f"the engine answered {answer!r}")
        return {}

    async def drop_prefix_cache(self, *, running: bool) -> None:
        """The reload flushed the radix cache already (SGLang's scheduler, on success). A
        paused engine is idle, so the flush is asked for again and must succeed; an engine
        that was not paused (`wait`) may be serving the held requests on the new weights
        by now, whose cache SGLang's `/flush_cache` would refuse to drop (400), and whose
        entries were computed by the new weights anyway."""
        if self._paused:
            await self._call("reset prefix cache", "POST", "/flush_cache")

    async def set_version(self, version: str) -> None:
        body = {"new_version": version, "abort_all_requests": False}
        await self._call("set version", "POST", "/update_weight_version", json_body=body)

    async def version(self) -> str | None:
        answer = await self._call("weight info", "GET", "/get_weight_version")
        found = (answer or {}).get("weight_version")
        return None if found is None else str(found)

    async def checksum(self) -> str | None:
        return None


_CONTROLS: dict[str, type[VllmControl] | type[SglangControl]] = {
    "vllm": VllmControl,
    "sglang": SglangControl,
}


def control_class(wire_kind: str) -> type[VllmControl] | type[SglangControl]:
    try:
        return _CONTROLS[wire_kind]
    except KeyError:
        raise ValueError(f"no policy control for {wire_kind!r} engines") from None


def control_for(
    wire_kind: str, http: httpx.AsyncClient, url: str, timeout_s: float = STEP_TIMEOUT_S
) -> EngineControl:
    """The control for one replica of an engine speaking `wire_kind` (the `Wire.kind`)."""
    return control_class(wire_kind)(http, url, timeout_s)
