"""Clients for the tokenkeep session server's management and export API (sync and async).

A rollout driver creates a session per rollout, points its harness at the session's base URL
(any OpenAI or Anthropic client, unmodified), and finishes the session with a reward. A
trainer then fetches trajectories, or exports a batch of finished sessions as rows or arrays.

    from tokenkeep import Client

    with Client("http://127.0.0.1:8000") as tk:
        session = tk.create_session(sampling={"temperature": 1.0}, metadata={"group": "q1"})
        ...  # openai.OpenAI(base_url=session.openai_base_url, api_key=session.api_key)
        tk.finish(session.id, reward=1.0)
        batch = tk.export_batch(selector="group=q1")
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypedDict, Unpack

import httpx

from tokenkeep.types import (
    Aborted,
    Batch,
    Finish,
    FinishedSession,
    Policy,
    Row,
    SessionInfo,
    Trajectory,
)

Stale = Literal["mask", "drop"]
Branches = Literal["all", "last"]
"""`last`: only the path to a session's most recently stored turn (one leaf per rollout)."""


class TokenkeepError(Exception):
    """The server refused a request; `status` is its HTTP status, `message` its reason."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class _Call:
    """One API request, built the same way for both clients."""

    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None


def _without_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _create(
    id: str | None,
    sampling: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    ttl_seconds: int | None,
    routed_experts: bool | None,
    group: str | None = None,
    group_size: int | None = None,
) -> _Call:
    body = _without_none(
        {
            "id": id,
            "sampling": sampling,
            "metadata": metadata,
            "ttl_seconds": ttl_seconds,
            "routed_experts": routed_experts,
            "group": group,
            "group_size": group_size,
        }
    )
    return _Call("POST", "/sessions", json=body)


def _finish(
    session_id: str, reward: float | None, metadata: dict[str, Any] | None, status: str = "ok"
) -> _Call:
    return _Call(
        "POST",
        f"/sessions/{session_id}/finish",
        json=_without_none({"reward": reward, "metadata": metadata, "status": status}),
    )


def _abort(session_id: str, finish: bool) -> _Call:
    return _Call("POST", f"/sessions/{session_id}/abort", json={"finish": finish})


def _trajectory(
    session_id: str, min_weight_version: float | None, stale: Stale, branches: Branches
) -> _Call:
    params: dict[str, Any] = {"branches": branches}
    if min_weight_version is not None:
        params |= {"min_weight_version": min_weight_version, "stale": stale}
    return _Call("GET", f"/sessions/{session_id}/trajectory", params=params)


Pause = Literal["keep", "wait", "abort"]
# A publish lasts as long as the engines' reload (and, with pause "wait", the longest turn).
PUBLISH_TIMEOUT_S = 900.0


def _publish(version: str | int, path: str, pause: Pause, force: bool) -> _Call:
    body = {"version": version, "source": {"path": path}, "pause": pause, "force": force}
    return _Call("POST", "/policy", json=body)


class TrainerEngine(Protocol):
    """vLLM's trainer-side weight transfer engine (`NCCLTrainerWeightTransferEngine` and
    the others `WeightTransferTrainerFactory` builds), made with `client=` a
    `PolicyTransfer`."""

    client: Any

    def send_weights(self) -> None: ...


class PolicyTransfer:
    """vLLM's `VLLMWeightSyncClient` (the four calls its trainer-side engines make:
    `vllm/distributed/weight_transfer/base.py`) spoken to tokenkeep, which makes each on
    every engine replica at once: the trainer's one group spans the whole fleet (each
    replica's ranks assigned by tokenkeep), and a publish moves every replica.

        transfer = tk.policy_transfer()
        engine = NCCLTrainerWeightTransferEngine.trainer_init(
            NCCLTrainerInitInfo(master_address=ADDR, master_port=PORT,
                                world_size=transfer.world_size(), rank=0),
            client=transfer, source=ModuleSource(model))
        tk.publish_policy(step, transfer=engine)  # each step

    The engine calls `start_weight_update` (every replica paused and ready: only then does
    it broadcast), `update_weights` concurrently with its broadcast, `finish_weight_update`
    (the version, checksums, resume). Its own calls go to one session server (a publish's
    calls must reach the same one)."""

    def __init__(self, base_url: str | httpx.URL, headers: httpx.Headers) -> None:
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=PUBLISH_TIMEOUT_S)
        self._next: dict[str, Any] | None = None
        self._published: Policy | None = None

    def __enter__(self) -> PolicyTransfer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self._http.post(path, json=body)
        return _answer(response)

    def world_size(self) -> int:
        """The trainer's rank 0 plus every engine replica's workers: the group's size."""
        response = self._http.get("/policy/transfer")
        answer = _answer(response)
        if answer["world_size"] is None:
            reasons = [answer.get("reason")] + [r.get("reason") for r in answer["replicas"]]
            raise TokenkeepError(409, "; ".join(r for r in reasons if r))
        size: int = answer["world_size"]
        return size

    def publish(
        self, version: str | int, pause: Pause, force: bool, send: Callable[[], None]
    ) -> Policy:
        """Run `send` (the trainer engine's `send_weights`) as the publish of `version`."""
        self._next = {"version": version, "pause": pause, "force": force}
        self._published = None
        try:
            send()
        finally:
            self._next = None
        if self._published is None:
            raise TokenkeepError(500, "send_weights returned without finishing the update")
        return self._published

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/policy/transfer/init", {"init_info": init_info})

    def start_weight_update(self) -> None:
        if self._next is None:
            raise TokenkeepError(
                400, "no version to publish: call publish_policy(version, transfer=engine)"
            )
        body = {**self._next, "source": {"transfer": {}}}
        self._post("/policy", body)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("/policy/transfer/update", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """`weight_version` is ignored: the version is the one `publish_policy` was given."""
        self._published = Policy.from_json(self._post("/policy/transfer/finish"))


def _engine_transfer(engine: TrainerEngine) -> PolicyTransfer:
    if not isinstance(engine.client, PolicyTransfer):
        raise TypeError(
            "transfer= takes vLLM's trainer engine made with client=tk.policy_transfer()"
        )
    return engine.client


def _list(
    selector: str | None,
    since: float | None,
    until: float | None,
    limit: int,
    status: list[str] | None = None,
) -> _Call:
    params = _without_none(
        {
            "selector": selector,
            "since": since,
            "until": until,
            "status": ",".join(status) if status is not None else None,
        }
    )
    return _Call("GET", "/sessions", params={"finished": "true", "limit": limit, **params})


class ExportSelection(TypedDict, total=False):
    """What `export` selects (every key optional; defaults as in `_export`)."""

    session_ids: list[str] | None
    selector: str | None
    since: float | None
    until: float | None
    limit: int
    min_weight_version: float | None
    stale: Stale
    group: str | None
    status: list[str] | None
    failed_members: str
    branches: Branches


def _export(
    *,
    session_ids: list[str] | None = None,
    selector: str | None = None,
    since: float | None = None,
    until: float | None = None,
    limit: int = 1000,
    min_weight_version: float | None = None,
    stale: Stale = "mask",
    group: str | None = None,
    status: list[str] | None = None,
    failed_members: str = "hold",
    branches: Branches = "all",
) -> _Call:
    body = _without_none(
        {
            "session_ids": session_ids,
            "selector": selector,
            "since": since,
            "until": until,
            "min_weight_version": min_weight_version,
            "group": group,
            "status": status,
        }
    )
    fixed = {
        "limit": limit,
        "stale": stale,
        "failed_members": failed_members,
        "branches": branches,
    }
    return _Call("POST", "/sessions/export", json={**fixed, **body})


def _viewer_sessions(limit: int, offset: int, metadata: str | None, state: str | None) -> _Call:
    params = _without_none({"metadata": metadata, "state": state})
    return _Call("GET", "/ui/api/sessions", params={"limit": limit, "offset": offset, **params})


def _finished(data: dict[str, Any]) -> list[FinishedSession]:
    return [
        FinishedSession(
            s["id"],
            s["metadata"],
            Finish.from_json(s["finish"]),
            s.get("first_weight_version"),
            bool(s.get("policy_lag_exceeded")),
        )
        for s in data["sessions"]
    ]


def _answer(response: httpx.Response) -> Any:
    """A reply's JSON body (None if it has none), or its error as a TokenkeepError."""
    _raise_for(response.status_code, response.content)
    return response.json() if response.content else None


def _raise_for(status: int, body: bytes) -> None:
    if status < 400:
        return
    try:
        error = json.loads(body)["error"]
        message, param = str(error.get("message")), error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = body.decode(errors="replace")[:500], None
    raise TokenkeepError(status, message, param)


def _row(line: str) -> Row | None:
    if not line.strip():
        return None
    data = json.loads(line)
    if "error" in data:
        raise TokenkeepError(500, data["error"].get("message", "export failed"))
    return Row.from_json(data)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Client:
    """Blocking client. `base_url` is the session server's root (`http://host:port`);
    `api_key` is the server's key when it has one."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        http: httpx.Client | None = None,
    ) -> None:
        self._http = http or httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=_headers(api_key)
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: _Call, timeout: float | None = None) -> Any:
        response = self._http.request(
            call.method,
            call.path,
            json=call.json,
            params=call.params,
            timeout=timeout or self._http.timeout,
        )
        return _answer(response)

    def publish_policy(
        self,
        version: str | int,
        *,
        path: str | None = None,
        transfer: TrainerEngine | None = None,
        pause: Pause = "keep",
        force: bool = False,
    ) -> Policy:
        """Publish policy `version` to every engine replica (admin key), from the checkpoint
        folder `path` (Hugging Face layout, readable at that path by every engine and the
        server) or sent by `transfer`, vLLM's trainer-side engine made with
        `client=self.policy_transfer()` (its `send_weights` runs here). `pause`: in-flight
        generations are frozen and resumed on the new weights (keep), finished on the old
        ones first (wait) or ended (abort). TokenkeepError: 409 (not newer than the
        published version, without `force`; another publish running; a transfer group
        broken or missing), 400/422 (unreadable checkpoint; one that does not fit the served
        model: no engine touched), 502/504 (a replica failed: the others serve `version`, it
        is fenced)."""
        if (path is None) == (transfer is None):
            raise TypeError("publish_policy takes one of path= and transfer=")
        if transfer is not None:
            return _engine_transfer(transfer).publish(version, pause, force, transfer.send_weights)
        assert path is not None
        return Policy.from_json(
            self._send(_publish(version, path, pause, force), timeout=PUBLISH_TIMEOUT_S)
        )

    def policy_transfer(self) -> PolicyTransfer:
        """vLLM's `VLLMWeightSyncClient` for its trainer-side engine (see `PolicyTransfer`)."""
        return PolicyTransfer(self._http.base_url, self._http.headers)

    def policy(self) -> Policy:
        """The published policy and what each engine replica serves."""
        return Policy.from_json(self._send(_Call("GET", "/policy")))

    def create_session(
        self,
        *,
        id: str | None = None,
        sampling: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        ttl_seconds: int | None = None,
        routed_experts: bool | None = None,
        group: str | None = None,
        group_size: int | None = None,
    ) -> SessionInfo:
        """A new session. `sampling` overrides what the harness sends (vLLM parameter
        names); `metadata` is what `list_finished`/`export` selectors match;
        `routed_experts` turns MoE routing replay on or off (default: the server's)."""
        call = _create(id, sampling, metadata, ttl_seconds, routed_experts, group, group_size)
        return SessionInfo.from_json(self._send(call))

    def finish(
        self,
        session_id: str,
        *,
        reward: float | None = None,
        metadata: dict[str, Any] | None = None,
        status: str = "ok",
    ) -> Finish:
        """Mark the rollout finished (once); it is then listed and exportable. `status`:
        `ok`, or why it failed (`env_error`, `model_error`, `aborted`)."""
        return Finish.from_json(self._send(_finish(session_id, reward, metadata, status))["finish"])

    def abort(self, session_id: str, *, finish: bool = False) -> Aborted:
        """Cut the session's generations in flight, on every server sharing its store: each
        is stored with finish_reason "abort" and its request answered with an `aborted`
        error. `finish=True` also finishes the session with status `aborted`; otherwise it
        stays usable. TokenkeepError 404 (unknown session), 409 (finished)."""
        return Aborted.from_json(self._send(_abort(session_id, finish)))

    def trajectory(
        self,
        session_id: str,
        *,
        min_weight_version: float | None = None,
        stale: Stale = "mask",
        branches: Branches = "all",
    ) -> Trajectory:
        call = _trajectory(session_id, min_weight_version, stale, branches)
        return Trajectory.from_json(self._send(call))

    def trajectories(
        self,
        session_ids: list[str],
        *,
        min_weight_version: float | None = None,
        stale: Stale = "mask",
        branches: Branches = "all",
    ) -> list[Trajectory]:
        return [
            self.trajectory(
                s, min_weight_version=min_weight_version, stale=stale, branches=branches
            )
            for s in session_ids
        ]

    def list_finished(
        self,
        *,
        selector: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 1000,
        status: list[str] | None = None,
    ) -> list[FinishedSession]:
        """Finished sessions, oldest finish first; `status` keeps those finished with one of
        these statuses."""
        return _finished(self._send(_list(selector, since, until, limit, status)))

    def export(self, **selection: Unpack[ExportSelection]) -> Iterator[Row]:
        """Rows (one per segment) of finished sessions, streamed as the server sends them:
        named by `session_ids`, or every finished session matching `selector` (metadata
        `key=value,...`), `since`/`until` (finish time) and `group`/`status`, at most `limit`;
        `min_weight_version` with `stale` (`mask` or `drop`) for the staleness filter;
        `failed_members` (`hold` or `drop`) for groups with failed rollouts; `branches`
        `last` for only the path to each session's newest turn (default `all`). Raises
        TokenkeepError before the first row for a batch that cannot be exported (an unknown
        or unfinished session, nothing matching)."""
        call = _export(**selection)
        with self._http.stream(call.method, call.path, json=call.json) as response:
            if response.status_code >= 400:
                _raise_for(response.status_code, response.read())
            for line in response.iter_lines():
                row = _row(line)
                if row is not None:
                    yield row

    def export_batch(self, *, pad_id: int = 0, **selection: Any) -> Batch:
        """`export(**selection)` stacked into padded NumPy arrays."""
        return Batch.from_rows(self.export(**selection), pad_id=pad_id)

    def viewer_sessions(
        self,
        *,
        limit: int = 50,
        offset: int = 0,
        metadata: str | None = None,
        state: Literal["running", "finished"] | None = None,
    ) -> dict[str, Any]:
        """A page of sessions as the rollout viewer lists them, newest first (its JSON:
        `sessions`, `total`, `offset`). `metadata` filters by `key=value[,key=value]`."""
        data: dict[str, Any] = self._send(_viewer_sessions(limit, offset, metadata, state))
        return data

    def viewer_session(self, session_id: str) -> dict[str, Any]:
        """One session as the rollout viewer shows it (its JSON): each branch's segments
        with token ids, decoded pieces, loss mask, special-token flags and break reasons."""
        data: dict[str, Any] = self._send(_Call("GET", f"/ui/api/sessions/{session_id}"))
        return data

    def delete(self, session_id: str) -> None:
        self._send(_Call("DELETE", f"/sessions/{session_id}"))


class AsyncClient:
    """The same API for asyncio (one per event loop)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 60.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self._http = http or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout, headers=_headers(api_key)
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _send(self, call: _Call, timeout: float | None = None) -> Any:
        response = await self._http.request(
            call.method,
            call.path,
            json=call.json,
            params=call.params,
            timeout=timeout or self._http.timeout,
        )
        return _answer(response)

    async def publish_policy(
        self,
        version: str | int,
        *,
        path: str | None = None,
        transfer: TrainerEngine | None = None,
        pause: Pause = "keep",
        force: bool = False,
    ) -> Policy:
        """`Client.publish_policy` (a transfer's `send_weights` runs in a thread)."""
        if (path is None) == (transfer is None):
            raise TypeError("publish_policy takes one of path= and transfer=")
        if transfer is not None:
            sync = _engine_transfer(transfer)
            return await asyncio.to_thread(
                sync.publish, version, pause, force, transfer.send_weights
            )
        assert path is not None
        call = _publish(version, path, pause, force)
        return Policy.from_json(await self._send(call, timeout=PUBLISH_TIMEOUT_S))

    def policy_transfer(self) -> PolicyTransfer:
        """`Client.policy_transfer` (blocking: vLLM's trainer engines call it from threads)."""
        return PolicyTransfer(self._http.base_url, self._http.headers)

    async def policy(self) -> Policy:
        return Policy.from_json(await self._send(_Call("GET", "/policy")))

    async def create_session(
        self,
        *,
        id: str | None = None,
        sampling: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        ttl_seconds: int | None = None,
        routed_experts: bool | None = None,
        group: str | None = None,
        group_size: int | None = None,
    ) -> SessionInfo:
        call = _create(id, sampling, metadata, ttl_seconds, routed_experts, group, group_size)
        return SessionInfo.from_json(await self._send(call))

    async def finish(
        self,
        session_id: str,
        *,
        reward: float | None = None,
        metadata: dict[str, Any] | None = None,
        status: str = "ok",
    ) -> Finish:
        data = await self._send(_finish(session_id, reward, metadata, status))
        return Finish.from_json(data["finish"])

    async def abort(self, session_id: str, *, finish: bool = False) -> Aborted:
        return Aborted.from_json(await self._send(_abort(session_id, finish)))

    async def trajectory(
        self,
        session_id: str,
        *,
        min_weight_version: float | None = None,
        stale: Stale = "mask",
        branches: Branches = "all",
    ) -> Trajectory:
        call = _trajectory(session_id, min_weight_version, stale, branches)
        return Trajectory.from_json(await self._send(call))

    async def trajectories(
        self,
        session_ids: list[str],
        *,
        min_weight_version: float | None = None,
        stale: Stale = "mask",
        branches: Branches = "all",
    ) -> list[Trajectory]:
        return list(
            await asyncio.gather(
                *(
                    self.trajectory(
                        s, min_weight_version=min_weight_version, stale=stale, branches=branches
                    )
                    for s in session_ids
                )
            )
        )

    async def list_finished(
        self,
        *,
        selector: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 1000,
        status: list[str] | None = None,
    ) -> list[FinishedSession]:
        return _finished(await self._send(_list(selector, since, until, limit, status)))

    async def export(self, **selection: Unpack[ExportSelection]) -> AsyncIterator[Row]:
        """`Client.export`, streamed asynchronously."""
        call = _export(**selection)
        async with self._http.stream(call.method, call.path, json=call.json) as response:
            if response.status_code >= 400:
                _raise_for(response.status_code, await response.aread())
            async for line in response.aiter_lines():
                row = _row(line)
                if row is not None:
                    yield row

    async def export_batch(self, *, pad_id: int = 0, **selection: Any) -> Batch:
        return Batch.from_rows([row async for row in self.export(**selection)], pad_id=pad_id)

    async def delete(self, session_id: str) -> None:
        await self._send(_Call("DELETE", f"/sessions/{session_id}"))
