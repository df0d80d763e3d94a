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
    transfers: ClassVar[bool]
    """Whether it takes weights sent by the trainer (`transfer` sources)."""
    transfer_pause_modes: ClassVar[tuple[str, ...]]
    """The pause modes a transfer publish can honour."""

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
    transfers = True
    transfer_pause_modes = pause_modes
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

    # vLLM's weight transfer (`vllm/entrypoints/rl/online/api_router.py`): the engine side of
    # the trainer's `VLLMWeightSyncClient`, one replica at a time.

    @staticmethod
    def refusal(*, init_info: Any = None, update_info: Any = None) -> str | None:
        """Why tokenkeep refuses a trainer's transfer info before any engine sees it: never
        for vLLM, whose backend-specific info its workers check themselves."""
        return None

    async def world_size(self) -> int:
        """How many ranks this replica's workers take in a transfer group (TP x PP x DP)."""
        answer = await self._call("world size", "GET", "/get_world_size")
        size = (answer or {}).get("world_size")
        if not isinstance(size, int) or size < 1:
            raise ControlError(self.url, "world size", f"the engine answered {answer!r}")
        return size

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's group; blocks until every rank has (the trainer included)."""
        body = {"init_info": init_info}
        await self._call("init transfer", "POST", "/init_weight_transfer_engine", json_body=body)

    async def shutdown_transfer(self) -> None:
        await self._call("shutdown transfer", "POST", "/shutdown_weight_transfer_engine")

    async def start_update(self) -> None:
        await self._call("start update", "POST", "/start_weight_update")

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive the weights; blocks while the trainer broadcasts them."""
        body = {"update_info": update_info}
        await self._call("update", "POST", "/update_weights", json_body=body)

    async def finish_update(self, version: str | None) -> None:
        """Process the received weights (vLLM's layerwise reload) and take `version`;
        without a version and without an update in between, the old weights are put back."""
        body = None if version is None else {"weight_version": version}
        await self._call("finish update", "POST", "/finish_weight_update", json_body=body)


class SglangControl(_HttpControl):
    """One SGLang 0.5.23 replica, through SGLang's native HTTP endpoints as 0.5.23 defines
    them (`sglang/srt/entrypoints/http_server.py`; the bodies are `managers/io_struct.py`'s
    `PauseGenerationReqInput`, `ContinueGenerationReqInput`, `UpdateWeightFromDiskReqInput`
    and `UpdateWeightVersionReqInput`, each read as a required JSON body):

    - `POST /pause_generation {"mode": "abort" | "retract" | "in_place"}`: the tokenizer
      manager sets `is_pause` (new requests wait until `POST /continue_generation {}`).
      `abort` aborts every request in flight (`abort_request(abort_all=True)`); `retract`
      has the scheduler stop and move its running requests back to the waiting queue,
      freeing their KV (recomputed after continue); `in_place` stops the scheduler and
      keeps the running requests and their KV.
    - `POST /update_weights_from_disk {"model_path", "abort_all_requests": false,
      "weight_version"}`: answers 200 `{"success": true, "message", "num_paused_requests"}`,
      or 400 with `"success": false` (a folder it cannot read: "Failed to get weights
      iterator: ..."; a load that fails midway is rolled back by SGLang itself). Not paused,
      it takes the model-update writer lock: it waits for the generations in flight (which
      hold the reader lock) to finish on the old weights and holds new ones until the new
      weights are in; paused, it updates at once. On success the scheduler records the
      version change on every live request (running and waiting: the spans of
      `meta_info.weight_versions`) and flushes its cache, which succeeds only on an engine
      with nothing running (waiting requests count unless paused): otherwise the update
      answers `success: false` ("Weights were updated, but the cache was not flushed").
    - `POST /flush_cache`: 200, or 400 while requests run (waiting ones too, unless paused).
    - `POST /update_weight_version {"new_version", "abort_all_requests"}`: its
      `abort_all_requests` defaults to true (every request on the engine aborted: the
      cause of Miles #2589), so it is always sent as false.
    - `GET /get_weight_version` -> `{"weight_version"}` (`"default"` at start).

    Pause modes: `abort` -> `/pause_generation {"mode": "abort"}` (the turns in flight end
    with `finish_reason: abort`); `wait` -> no pause call, the reload's own writer lock lets
    the turns in flight finish on the old weights first; `keep` -> `{"mode": "retract"}`:
    the turns in flight are frozen, their old-weight KV freed, and after the reload they are
    recomputed and continued by the new weights, their `weight_versions` spanning both
    versions (tokenkeep's contract for `keep`, as vLLM's `keep` pause with the running
    requests' cache reset). Not `in_place`: it would resume on KV the old weights computed
    (a mix of policies in one sample that `weight_versions` does not show), and SGLang
    itself refuses the reload's cache flush while its requests are running.

    Requires SGLang 0.5.23 (the version the engine client honours): older servers (commit
    0025436) ignore the mode and abort on every pause, so a `keep` there would silently be
    an `abort`.

    `transfer` sources: SGLang's update from distributed (`InitWeightsUpdateGroupReqInput`,
    `UpdateWeightsFromDistributedReqInput`, `DestroyWeightsUpdateGroupReqInput`), mapped onto
    the fleet's four transfer phases (`policy/transfer.py`): init -> `POST
    /init_weights_update_group {master_address, master_port, rank_offset, world_size,
    group_name, backend}` (answers once the group has met; 400 with `success: false`); start
    -> the pause only (SGLang has no start step); update -> one `POST
    /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache: true,
    abort_all_requests: false}` per chunk the trainer sends (it receives each named tensor
    from rank 0's broadcast, in order, and loads it at once: no staging, so a failed update
    leaves a mix and its replica is fenced); finish -> the version (`/update_weight_version`,
    still paused, so every token after the update is stamped with it); shutdown -> `POST
    /destroy_weights_update_group`. An SGLang worker's rank is `rank_offset + tp_rank`, so a
    replica takes `tp_size` ranks; SGLang refuses the update with data parallelism, and
    pipeline stages would share ranks, so both are refused here (`world_size`). The group
    name is SGLang's default, `weight_update_group` (the trainer's process group must use the
    same name: it prefixes the rendezvous keys). `wait` is refused for transfers: between two
    chunks an unpaused SGLang would sample with half-loaded weights.

    No checksum: SGLang has no whole-model weight checker (only `/get_weights_by_name`,
    the first values of one named parameter), so `checksum()` is None, the fleet compares
    nothing and a publish's `checksum` is null on SGLang. A failed reload is still fenced.
    """

    kind = "sglang"
    # tokenkeep's pause mode -> SGLang's (None: no pause call).
    PAUSE_AS: ClassVar[dict[str, str | None]] = {"keep": "retract", "wait": None, "abort": "abort"}
    pause_modes = tuple(PAUSE_AS)
    transfers = True
    transfer_pause_modes = ("keep", "abort")
    GROUP_NAME = "weight_update_group"  # SGLang's default for every update-group request
    missing_hint = "is it an SGLang 0.5.23 server (`python -m sglang.launch_server`)?"

    def __init__(self, http: httpx.AsyncClient, url: str, timeout_s: float = STEP_TIMEOUT_S):
        super().__init__(http, url, timeout_s)
        self._paused = False

    async def pause(self, mode: str) -> None:
        if mode not in self.PAUSE_AS:
            raise ControlError(self.url, "pause", f"SGLang cannot pause with {mode!r}", status=501)
        sglang_mode = self.PAUSE_AS[mode]
        if sglang_mode is not None:
            body = {"mode": sglang_mode}
            await self._call("pause", "POST", "/pause_generation", json_body=body)
            self._paused = True

    async def resume(self) -> None:
        await self._call("resume", "POST", "/continue_generation", json_body={})
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
        paused engine runs nothing (an `abort` pause ended its requests, a `retract` one
        moved them to the waiting queue, which a paused flush ignores), so the flush is
        asked for again and must succeed; an engine
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

    @classmethod
    def refusal(cls, *, init_info: Any = None, update_info: Any = None) -> str | None:
        """What SGLang would refuse (or tokenkeep cannot honour) in the trainer's info, said
        before any engine is touched."""
        if init_info is not None:
            for name, kind in (("master_address", str), ("master_port", int)):
                if not isinstance(init_info.get(name), kind):
                    return f"init_info.{name} is required for SGLang ({kind.__name__})"
            if init_info.get("group_name", cls.GROUP_NAME) != cls.GROUP_NAME:
                return f"init_info.group_name must be SGLang's default {cls.GROUP_NAME!r}"
        chunks = update_info if isinstance(update_info, list) else [update_info]
        for chunk in chunks if update_info is not None else []:
            fields = [chunk.get(name) for name in ("names", "dtypes", "shapes")]
            if not all(isinstance(f, list) for f in fields) or len({len(f) for f in fields}) != 1:
                return "update_info for SGLang is {names, dtypes, shapes}: lists of one length"
            if chunk.get("group_name", cls.GROUP_NAME) != cls.GROUP_NAME:
                return f"update_info.group_name must be SGLang's default {cls.GROUP_NAME!r}"
        return None

    async def world_size(self) -> int:
        """The ranks this replica takes in a transfer group: one per tensor-parallel worker."""
        info = await self._call("world size", "GET", "/server_info")
        sizes = {name: (info or {}).get(name, 1) for name in ("tp_size", "pp_size", "dp_size")}
        if not all(isinstance(size, int) and size >= 1 for size in sizes.values()):
            raise ControlError(self.url, "world size", f"the engine answered {sizes!r}")
        if sizes["pp_size"] > 1 or sizes["dp_size"] > 1:
            raise ControlError(
                self.url,
                "world size",
                "SGLang's update from distributed takes tensor parallelism only "
                f"(pp_size {sizes['pp_size']}, dp_size {sizes['dp_size']})",
                status=501,
            )
        return int(sizes["tp_size"])

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's group; answers once every rank has (the trainer included)."""
        body = {
            "master_address": init_info["master_address"],
            "master_port": init_info["master_port"],
            "rank_offset": init_info["rank_offset"],
            "world_size": init_info["world_size"],
            "group_name": self.GROUP_NAME,
            "backend": init_info.get("backend", "nccl"),
        }
        await self._call("init transfer", "POST", "/init_weights_update_group", json_body=body)

    async def shutdown_transfer(self) -> None:
        body = {"group_name": self.GROUP_NAME}
        await self._call(
            "shutdown transfer", "POST", "/destroy_weights_update_group", json_body=body
        )

    async def start_update(self) -> None:
        """Nothing to start: SGLang loads each tensor as it arrives (the pause came first)."""

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Receive the weights, chunk by chunk; each call blocks while the trainer
        broadcasts that chunk's tensors."""
        for chunk in update_info if isinstance(update_info, list) else [update_info]:
            body = {
                "names": chunk["names"],
                "dtypes": chunk["dtypes"],
                "shapes": chunk["shapes"],
                "group_name": self.GROUP_NAME,
                "flush_cache": True,
                "abort_all_requests": False,
            }
            await self._call("update", "POST", "/update_weights_from_distributed", json_body=body)

    async def finish_update(self, version: str | None) -> None:
        """The version, the engine still paused; without one nothing came and nothing
        changed (no staging to put back)."""
        if version is not None:
            await self.set_version(version)


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
