"""A fake Kubernetes API server: a TEST DOUBLE, because no kube-apiserver can run here.

It speaks the real REST protocol over HTTP on a loopback port, so Kopf and the official
Python client connect to it through an ordinary kubeconfig, and it keeps the behaviour the
operator depends on honest:

- discovery (`/api`, `/apis`, resource lists with subresources) for the kinds below;
- a global, monotonically increasing `resourceVersion`; `generation` bumped on spec changes
  only; a no-op write changes nothing and notifies nobody;
- list and watch (`?watch=true&resourceVersion=N`, label selectors, `timeoutSeconds`),
  replaying every change after N in order;
- JSON merge patch (RFC 7386) and JSON patch (RFC 6902, `test` failures are 422);
  strategic merge patch is refused with 415 rather than faked;
- optimistic concurrency: a stale `metadata.resourceVersion` in a write is a 409;
- the status subresource: the main endpoint ignores status, `/status` changes only status;
  the scale subresource of ModelServer;
- custom resources defaulted and validated against their CRD schema, CEL rules included
  (via tests/operator/schemas.py), failures are 422 like the real server;
- deletion honours finalizers, and owner-reference garbage collection deletes dependents
  (in the background, cascading).

What it does NOT do: no controllers (no Deployment controller, scheduler or kubelet: tests
create pods and write Deployment status themselves, playing those parts), no admission
webhooks, no field managers or server-side apply, no validation of built-in kinds (the
manifest tests validate those against the real schemas), no auth (any token works).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonpatch
import yaml
from aiohttp import web

from tests.operator.schemas import apply_defaults, custom_resource_errors


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


BUILTIN_KINDS = [
    Kind("", "v1", "pods", "Pod", subresources=("status",)),
    Kind("", "v1", "services", "Service", subresources=("status",)),
    Kind("", "v1", "configmaps", "ConfigMap"),
    Kind("", "v1", "secrets", "Secret"),
    Kind("", "v1", "serviceaccounts", "ServiceAccount"),
    Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", subresources=("status",)),
    Kind("", "v1", "events", "Event"),
    Kind("", "v1", "namespaces", "Namespace", namespaced=False, subresources=("status",)),
    Kind("apps", "v1", "deployments", "Deployment", subresources=("status", "scale")),
    Kind("apps", "v1", "statefulsets", "StatefulSet", subresources=("status", "scale")),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", subresources=("status",)),
    Kind("events.k8s.io", "v1", "events", "Event"),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        subresources=("status",),
    ),
]

Key = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-scoped), name


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


_SELECTOR_TERM = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*))?\s*$")


def matches_selector(labels: dict[str, str], selector: str | None) -> bool:
    """Equality-based label selectors: k=v, k==v, k!=v, k, !k (comma means and)."""
    if not selector:
        return True
    for term in selector.split(","):
        found = _SELECTOR_TERM.match(term)
        if not found:
            raise ApiError(400, "BadRequest", f"unsupported label selector {selector!r}")
        negate, key, op, value = found.groups()
        if op is None:
            if (key in labels) == bool(negate):
                return False
        elif op == "!=":
            if labels.get(key) == value:
                return False
        elif labels.get(key) != value:
            return False
    return True


class FakeApiServer:
    def __init__(self, crd_paths: list[Path]) -> None:
        self.kinds: dict[tuple[str, str, str], Kind] = {}
        self.crds: dict[tuple[str, str], dict[str, Any]] = {}
        for kind in BUILTIN_KINDS:
            self.kinds[(kind.group, kind.version, kind.plural)] = kind
        self.objects: dict[Key, dict[str, Any]] = {}
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # rv, group/plural, type, obj
        self.revision = 0
        self.requests: list[tuple[str, str]] = []
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self.port = 0
        for path in crd_paths:
            self._install_crd(yaml.safe_load(path.read_text()))

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._changed = asyncio.Event()
            self._stopping = asyncio.Event()
            app = web.Application()
            app.router.add_route("*", "/{path:.*}", self._handle)
            runner = web.AppRunner(app, shutdown_timeout=1, access_log=None)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            ready.set()
            loop.run_until_complete(self._stopping.wait())
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="fake-apiserver", daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop(self) -> None:
        if self._loop and self._stopping:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread:
            self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # --- CRDs ----------------------------------------------------------------------------

    def _install_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            subresources = tuple(version.get("subresources", {}))
            kind = Kind(
                spec["group"],
                version["name"],
                spec["names"]["plural"],
                spec["names"]["kind"],
                namespaced=spec["scope"] == "Namespaced",
                subresources=subresources,
                short_names=tuple(spec["names"].get("shortNames", [])),
            )
            self.kinds[(kind.group, kind.version, kind.plural)] = kind
            self.crds[(kind.group, kind.plural)] = crd
        self._store(
            ("apiextensions.k8s.io", "customresourcedefinitions", "", crd["metadata"]["name"]),
            self._new_metadata(copy.deepcopy(crd), ""),
            "ADDED",
        )

    # --- storage -------------------------------------------------------------------------

    def _new_metadata(self, obj: dict[str, Any], namespace: str) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if namespace:
            meta["namespace"] = namespace
        return obj

    def _store(self, key: Key, obj: dict[str, Any], event: str) -> dict[str, Any]:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        if event == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.history.append((self.revision, f"{key[0]}/{key[1]}", event, copy.deepcopy(obj)))
        if self._changed is not None:
            # Wake every watcher waiting on this event; later waiters get a fresh one.
            self._changed.set()
            self._changed = asyncio.Event()
        return obj

    def _delete(self, key: Key, *, collect: bool = True) -> dict[str, Any]:
        obj = self.objects[key]
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if "deletionTimestamp" not in meta:
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                self._store(key, obj, "MODIFIED")
            return obj
        self._store(key, copy.deepcopy(obj), "DELETED")
        if collect:
            self._collect_garbage()
        return obj

    def _collect_garbage(self) -> None:
        """Delete objects whose every owner is gone (background cascading deletion)."""
        while True:
            uids = {o["metadata"]["uid"] for o in self.objects.values()}
            orphans = [
                key
                for key, obj in self.objects.items()
                if obj["metadata"].get("ownerReferences")
                and not any(ref["uid"] in uids for ref in obj["metadata"]["ownerReferences"])
                and "deletionTimestamp" not in obj["metadata"]
            ]
            if not orphans:
                return
            for key in orphans:
                self._delete(key, collect=False)

    # --- request routing -----------------------------------------------------------------

    def _route(self, path: str) -> tuple[Kind, str, str | None, str | None]:
        """kind, namespace, name, subresource of a resource path."""
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"]:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", f"no route for {path}")
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest:
            raise ApiError(404, "NotFound", f"no route for {path}")
        kind = self.kinds.get((group, version, rest[0]))
        if kind is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub and sub not in kind.subresources:
            raise ApiError(404, "NotFound", f"{kind.plural} has no subresource {sub}")
        return kind, namespace, name, sub

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        try:
            discovery = self._discovery(request.path)
            if discovery is not None:
                return web.json_response(discovery)
            kind, namespace, name, sub = self._route(request.path)
            if name is None and request.method == "GET":
                if request.query.get("watch") in ("true", "1"):
                    return await self._watch(request, kind, namespace)
                return web.json_response(self._list(kind, namespace, request.query))
            body = await request.json() if request.can_read_body else None
            result = self._mutate(request, kind, namespace, name, sub, body)
            return web.json_response(result[0], status=result[1])
        except ApiError as error:
            return _status(error.code, error.reason, error.message)

    def _discovery(self, path: str) -> dict[str, Any] | None:
        path = path.rstrip("/")
        if path == "/version":
            return {"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "platform": "fake"}
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"]}
        if path == "/apis":
            groups: dict[str, list[str]] = {}
            for group, version, _ in self.kinds:
                if group:
                    groups.setdefault(group, [])
                    if version not in groups[group]:
                        groups[group].append(version)
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": group,
                        "versions": [
                            {"groupVersion": f"{group}/{v}", "version": v} for v in versions
                        ],
                        "preferredVersion": {
                            "groupVersion": f"{group}/{versions[0]}",
                            "version": versions[0],
                        },
                    }
                    for group, versions in sorted(groups.items())
                ],
            }
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) == 2:
            group, version = "", parts[1]
        elif parts[:1] == ["apis"] and len(parts) == 3:
            group, version = parts[1], parts[2]
        else:
            return None
        resources = []
        for kind in self.kinds.values():
            if (kind.group, kind.version) != (group, version):
                continue
            resources.append(
                {
                    "name": kind.plural,
                    "singularName": kind.kind.lower(),
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
                    "shortNames": list(kind.short_names),
                }
            )
            for sub in kind.subresources:
                resources.append(
                    {
                        "name": f"{kind.plural}/{sub}",
                        "singularName": "",
                        "namespaced": kind.namespaced,
                        "kind": "Scale" if sub == "scale" else kind.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        if not resources:
            raise ApiError(404, "NotFound", f"no group version {group}/{version}")
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": resources,
        }

    def _selected(self, kind: Kind, namespace: str, query: Any) -> list[dict[str, Any]]:
        selector = query.get("labelSelector")
        return [
            obj
            for (group, plural, ns, _), obj in sorted(self.objects.items())
            if (group, plural) == (kind.group, kind.plural)
            and (not namespace or ns == namespace)
            and matches_selector(obj["metadata"].get("labels", {}), selector)
        ]

    def _list(self, kind: Kind, namespace: str, query: Any) -> dict[str, Any]:
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(self.revision)},
            "items": copy.deepcopy(self._selected(kind, namespace, query)),
        }

    async def _watch(self, request: web.Request, kind: Kind, namespace: str) -> web.StreamResponse:
        assert self._changed is not None and self._stopping is not None
        selector = request.query.get("labelSelector")
        since = request.query.get("resourceVersion")
        timeout = float(request.query.get("timeoutSeconds", "300"))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if since in (None, "", "0"):
            # "Start at most recent": the current objects as ADDED, then changes.
            for obj in self._selected(kind, namespace, request.query):
                await self._send(response, "ADDED", obj)
            position = len(self.history)
        else:
            position = next(
                (i for i, entry in enumerate(self.history) if entry[0] > int(since)),
                len(self.history),
            )
        resource = f"{kind.group}/{kind.plural}"
        while loop.time() < deadline and not self._stopping.is_set():
            while position < len(self.history):
                _, entry_resource, event, obj = self.history[position]
                position += 1
                meta = obj["metadata"]
                if entry_resource != resource:
                    continue
                if namespace and meta.get("namespace") != namespace:
                    continue
                if not matches_selector(meta.get("labels", {}), selector):
                    continue
                await self._send(response, event, obj)
            if position < len(self.history):
                continue  # changed while we were sending
            # Single-threaded loop: nothing can change between the check above and this wait.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._changed.wait(), timeout=min(1.0, max(0.0, deadline - loop.time()))
                )
        return response

    @staticmethod
    async def _send(response: web.StreamResponse, event: str, obj: dict[str, Any]) -> None:
        line = json.dumps({"type": event, "object": obj}) + "\n"
        await response.write(line.encode())

    # --- writes --------------------------------------------------------------------------

    def _mutate(
        self,
        request: web.Request,
        kind: Kind,
        namespace: str,
        name: str | None,
        sub: str | None,
        body: Any,
    ) -> tuple[dict[str, Any], int]:
        method = request.method
        if name is None:
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", f"{method} on a collection")
            return self._create(kind, namespace, body), 201
        key = (kind.group, kind.plural, namespace, name)
        current = self.objects.get(key)
        if current is None:
            raise ApiError(404, "NotFound", f'{kind.plural} "{name}" not found')
        if method == "GET":
            return copy.deepcopy(self._view(kind, current, sub)), 200
        if method == "DELETE":
            return copy.deepcopy(self._delete(key)), 200
        if method == "PUT":
            desired = body
        elif method == "PATCH":
            desired = self._patched(request, self._view(kind, current, sub), body)
        else:
            raise ApiError(405, "MethodNotAllowed", method)
        return copy.deepcopy(self._update(kind, key, current, desired, sub)), 200

    def _view(self, kind: Kind, obj: dict[str, Any], sub: str | None) -> dict[str, Any]:
        if sub != "scale":
            return obj
        status = obj.get("status", {})
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: obj["metadata"][k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            },
            "spec": {"replicas": obj.get("spec", {}).get("replicas", 0)},
            "status": {
                "replicas": status.get("replicas", 0),
                "selector": status.get("selector", ""),
            },
        }

    @staticmethod
    def _patched(request: web.Request, current: dict[str, Any], patch: Any) -> dict[str, Any]:
        content_type = request.content_type
        if content_type == "application/merge-patch+json":
            return _merge_patch(current, patch)
        if content_type == "application/json-patch+json":
            try:
                return jsonpatch.apply_patch(current, patch)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
                raise ApiError(422, "Invalid", f"the JSON patch failed: {error}") from error
        raise ApiError(415, "UnsupportedMediaType", f"patch type {content_type} not supported")

    def _validated(self, kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        crd = self.crds.get((kind.group, kind.plural))
        if crd is None:
            return obj
        version = next(v for v in crd["spec"]["versions"] if v["name"] == kind.version)
        obj = apply_defaults(version["schema"]["openAPIV3Schema"], obj)
        errors = custom_resource_errors(crd, obj)
        if errors:
            raise ApiError(422, "Invalid", f"{kind.kind} is invalid: " + "; ".join(errors))
        return obj

    def _create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        # Like the real server: type information defaults from the URL, a mismatch is an error.
        body.setdefault("kind", kind.kind)
        body.setdefault("apiVersion", kind.api_version)
        if (body["kind"], body["apiVersion"]) != (kind.kind, kind.api_version):
            raise ApiError(400, "BadRequest", f"{body['kind']} posted to {kind.plural}")
        key = (kind.group, kind.plural, namespace, name)
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{kind.plural} "{name}" already exists')
        obj = copy.deepcopy(body)
        if "status" in kind.subresources:
            obj.pop("status", None)
        obj = self._validated(kind, self._new_metadata(obj, namespace))
        return copy.deepcopy(self._store(key, obj, "ADDED"))

    def _update(
        self,
        kind: Kind,
        key: Key,
        current: dict[str, Any],
        desired: dict[str, Any],
        sub: str | None,
    ) -> dict[str, Any]:
        sent_version = desired.get("metadata", {}).get("resourceVersion")
        if sent_version and sent_version != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                "the object has been modified; please apply your changes "
                "to the latest version and try again",
            )
        if sub == "scale":
            replicas = desired.get("spec", {}).get("replicas")
            updated = _merge_patch(current, {"spec": {"replicas": replicas}})
        elif sub == "status":
            updated = {**copy.deepcopy(current), "status": desired.get("status", {})}
        else:
            updated = copy.deepcopy(desired)
            if "status" in kind.subresources:
                updated["status"] = copy.deepcopy(current.get("status"))
                if updated["status"] is None:
                    del updated["status"]
            meta = updated.setdefault("metadata", {})
            fixed = (
                "uid",
                "creationTimestamp",
                "name",
                "namespace",
                "generation",
                "deletionTimestamp",
            )
            for field in fixed:
                if field in current["metadata"]:
                    meta[field] = current["metadata"][field]
        updated = self._validated(kind, updated)
        updated["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        if updated == current:
            return current  # a no-op write: no new version, no watch event
        spec_fields = {k for k in set(updated) | set(current) if k not in ("metadata", "status")}
        if any(updated.get(k) != current.get(k) for k in spec_fields):
            updated["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        stored = self._store(key, updated, "MODIFIED")
        if "deletionTimestamp" in stored["metadata"] and not stored["metadata"].get("finalizers"):
            self._delete(key)
        return self._view(kind, stored, sub)
