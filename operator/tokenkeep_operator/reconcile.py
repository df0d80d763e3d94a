"""What the handlers do, without Kopf: read the resource, render its children, apply them,
and recompute its status from what the cluster reports."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiException
from pydantic import ValidationError

from tokenkeep_operator import status as st
from tokenkeep_operator.apply import apply
from tokenkeep_operator.kube import Kube
from tokenkeep_operator.manifests import engine, redis, session
from tokenkeep_operator.manifests.common import Owner, selector_string
from tokenkeep_operator.models import API_VERSION, ModelServerSpec, SessionServerSpec

# (object, event type, reason, message) -> posts a Kubernetes Event about `object`.
EmitEvent = Callable[[dict[str, Any], str, str, str], None]


class ApplyError(Exception):
    """The API server refused a child object; retrying will not help until something
    changes (the message says what it refused)."""


def describe_validation_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"])
        parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "; ".join(parts)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _owner(body: dict[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(
        api_version=API_VERSION,
        kind=body["kind"],
        name=meta["name"],
        namespace=meta["namespace"],
        uid=meta["uid"],
        generation=meta.get("generation", 1),
    )


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        emit: EmitEvent,
        default_image: str,
        clock: Callable[[], str] = _now,
    ) -> None:
        self.kube = kube
        self.emit = emit
        self.default_image = default_image
        self.clock = clock
        self._locks: defaultdict[tuple[str, str, str], threading.Lock] = defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        """One reconcile or status refresh per resource at a time, so that an older
        observation never overwrites a newer one."""
        with self._locks_guard:
            return self._locks[(kind, namespace, name)]

    def _apply_all(self, body: dict[str, Any], objects: list[dict[str, Any]]) -> None:
        for obj in objects:
            try:
                apply(self.kube, obj)
            except ApiException as error:
                if error.status is None or error.status >= 500 or error.status in (409, 429):
                    raise  # transient: Kopf retries
                message = f"{obj['kind']} {obj['metadata']['name']}: {error.reason}: {error.body}"
                self._record_apply_failure(body, message)
                raise ApplyError(message) from error

    def _create_admin_key(self, owner: Owner) -> None:
        """Create the generated admin-key Secret unless it exists. Create-only (the operator
        may not read Secrets): applying it would replace the key on every reconcile."""
        try:
            self.kube.create(session.admin_key_secret(owner))
        except ApiException as error:
            if error.status != 409:  # 409: it exists, which is the usual case
                raise

    def _record_apply_failure(self, body: dict[str, Any], message: str) -> None:
        generation = body["metadata"].get("generation", 1)
        conditions = list(body.get("status", {}).get("conditions", []))
        failed = st.condition(st.DEGRADED, True, st.APPLY_FAILED, message, generation)
        conditions = [c for c in conditions if c.get("type") != st.DEGRADED] + [failed]
        self._write_status(body, {**body.get("status", {}), "conditions": conditions})

    def _write_status(self, body: dict[str, Any], new: dict[str, Any]) -> None:
        previous = body.get("status") or {}
        old_conditions = previous.get("conditions", [])
        new = {
            **new,
            "conditions": st.with_transition_times(new["conditions"], old_conditions, self.clock()),
        }
        if all(previous.get(k) == v for k, v in new.items()):
            return
        meta = body["metadata"]
        self.kube.patch_status(body["kind"], meta["namespace"], meta["name"], new)
        for cond in st.changed_conditions(new["conditions"], old_conditions):
            healthy = (cond["type"] == st.DEGRADED) != (cond["status"] == "True")
            if cond["type"] == st.PROGRESSING and cond["reason"] != st.ROLLOUT_STALLED:
                healthy = True
            message = f"{cond['type']} is {cond['status']}"
            if cond["message"]:
                message += f": {cond['message']}"
            self.emit(body, "Normal" if healthy else "Warning", cond["reason"], message)

    # --- ModelServer ---------------------------------------------------------------------

    def reconcile_model_server(self, namespace: str, name: str) -> None:
        with self._lock("ModelServer", namespace, name):
            body = self.kube.get_custom("ModelServer", namespace, name)
            if body is None:
                return
            try:
                spec = ModelServerSpec.model_validate(body.get("spec") or {})
            except ValidationError:
                spec = None
            if spec is not None:
                self._apply_all(body, engine.render(_owner(body), spec))
                body = self.kube.get_custom("ModelServer", namespace, name) or body
            self._write_status(body, self.model_server_status(body))

    def refresh_model_server(self, namespace: str, name: str) -> None:
        with self._lock("ModelServer", namespace, name):
            body = self.kube.get_custom("ModelServer", namespace, name)
            if body is not None:
                self._write_status(body, self.model_server_status(body))

    def model_server_status(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
        previous = body.get("status") or {}
        base = {"url": engine.service_url(name, namespace)}
        try:
            spec = ModelServerSpec.model_validate(body.get("spec") or {})
        except ValidationError as error:
            conditions = st.blocked_conditions(
                st.INVALID_SPEC, describe_validation_error(error), generation
            )
            return {**base, "observedGeneration": generation, "conditions": conditions}
        owner = _owner(body)
        deployment = self.kube.get("apps/v1", "Deployment", namespace, engine.deployment_name(name))
        pods = self.kube.list("v1", "Pod", namespace, selector_string(engine.pod_selector(owner)))
        claims = []
        if spec.cache.enabled:
            claim = self.kube.get(
                "v1", "PersistentVolumeClaim", namespace, engine.cache_claim_name(name)
            )
            claims = [claim] if claim else []
        conditions = st.workload_conditions(
            st.Workload(deployment, pods, claims),
            spec.replicas,
            generation,
            what="vLLM",
            gpu_resource=spec.resources.gpu_resource_name,
        )
        applied = st.rollout(deployment, spec.replicas).applied_generation if deployment else None
        carried = st.carried_apply_failure(previous.get("conditions", []), applied, generation)
        if carried:
            conditions = [c for c in conditions if c["type"] != st.DEGRADED] + [carried]
        state = st.rollout(deployment, spec.replicas) if deployment else None
        return {
            **base,
            "observedGeneration": applied or previous.get("observedGeneration"),
            "replicas": state.replicas if state else 0,
            "readyReplicas": state.ready if state else 0,
            "selector": selector_string(engine.pod_selector(owner)),
            "conditions": conditions,
        }

    # --- SessionServer -------------------------------------------------------------------

    def session_servers_using(self, namespace: str, model_server: str) -> list[str]:
        return [
            item["metadata"]["name"]
            for item in self.kube.list(API_VERSION, "SessionServer", namespace)
            if (item.get("spec") or {}).get("modelServerRef", {}).get("name") == model_server
        ]

    def _session_inputs(
        self, body: dict[str, Any]
    ) -> tuple[SessionServerSpec, str, ModelServerSpec, dict[str, Any]] | list[dict[str, Any]]:
        """The parsed specs this SessionServer needs, or the conditions saying why not."""
        generation = body["metadata"].get("generation", 1)
        namespace = body["metadata"]["namespace"]
        try:
            spec = SessionServerSpec.model_validate(body.get("spec") or {})
        except ValidationError as error:
            message = describe_validation_error(error)
            return st.blocked_conditions(st.INVALID_SPEC, message, generation)
        ms_name = spec.model_server_ref.name
        model_server = self.kube.get_custom("ModelServer", namespace, ms_name)
        if model_server is None:
            message = f"ModelServer {ms_name} does not exist in namespace {namespace}"
            return st.blocked_conditions(st.MODEL_SERVER_NOT_FOUND, message, generation)
        try:
            ms_spec = ModelServerSpec.model_validate(model_server.get("spec") or {})
        except ValidationError:
            message = f"ModelServer {ms_name} has an invalid spec"
            return st.blocked_conditions(st.MODEL_SERVER_NOT_READY, message, generation)
        try:
            session.settings(_owner(body), spec, ms_name, ms_spec)
        except session.ConfigError as error:
            return st.blocked_conditions(st.INVALID_SPEC, str(error), generation)
        return spec, ms_name, ms_spec, model_server

    def reconcile_session_server(self, namespace: str, name: str) -> None:
        with self._lock("SessionServer", namespace, name):
            body = self.kube.get_custom("SessionServer", namespace, name)
            if body is None:
                return
            inputs = self._session_inputs(body)
            if not isinstance(inputs, list):
                spec, ms_name, ms_spec, _ = inputs
                owner = _owner(body)
                objects = session.render(owner, spec, ms_name, ms_spec, self.default_image)
                if spec.api_key_secret_ref is None:
                    self._create_admin_key(owner)
                self._apply_all(body, objects)
                body = self.kube.get_custom("SessionServer", namespace, name) or body
            self._write_status(body, self.session_server_status(body))

    def refresh_session_server(self, namespace: str, name: str) -> None:
        with self._lock("SessionServer", namespace, name):
            body = self.kube.get_custom("SessionServer", namespace, name)
            if body is not None:
                self._write_status(body, self.session_server_status(body))

    def session_server_status(self, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
        previous = body.get("status") or {}
        base = {
            "url": session.service_url(name, namespace),
            "sessionUrlTemplate": session.session_url_template(name, namespace),
        }
        inputs = self._session_inputs(body)
        if isinstance(inputs, list):
            return {**base, "observedGeneration": generation, "conditions": inputs}
        spec, ms_name, _, model_server = inputs
        owner = _owner(body)
        waiting = None
        redis_degraded = None
        if spec.redis.mode == "Managed":
            statefulset = self.kube.get(
                "apps/v1", "StatefulSet", namespace, redis.statefulset_name(name)
            )
            redis_pods = self.kube.list(
                "v1", "Pod", namespace, selector_string(redis.pod_selector(owner))
            )
            redis_conditions = st.workload_conditions(
                st.Workload(statefulset, redis_pods), 1, generation, what="Redis"
            )
            redis_ready = st.get_condition(redis_conditions, st.READY)
            if redis_ready and redis_ready["status"] != "True":
                waiting = st.Problem(st.REDIS_NOT_READY, f"Redis: {redis_ready['message']}")
            degraded = st.get_condition(redis_conditions, st.DEGRADED)
            if degraded and degraded["status"] == "True":
                redis_degraded = st.Problem(degraded["reason"], f"Redis: {degraded['message']}")
        ms_ready = st.get_condition(
            (model_server.get("status") or {}).get("conditions", []), st.READY
        )
        if waiting is None and (ms_ready is None or ms_ready.get("status") != "True"):
            why = (
                f"{ms_ready['reason']}: {ms_ready.get('message', '')}" if ms_ready else "no status"
            )
            waiting = st.Problem(st.MODEL_SERVER_NOT_READY, f"ModelServer {ms_name}: {why}")
        deployment = self.kube.get(
            "apps/v1", "Deployment", namespace, session.deployment_name(name)
        )
        pods = self.kube.list("v1", "Pod", namespace, selector_string(session.pod_selector(owner)))
        conditions = st.workload_conditions(
            st.Workload(deployment, pods),
            spec.replicas,
            generation,
            what="session server",
            waiting=waiting,
        )
        degraded = st.get_condition(conditions, st.DEGRADED)
        if redis_degraded and degraded and degraded["status"] == "False":
            replacement = st.condition(
                st.DEGRADED, True, redis_degraded.reason, redis_degraded.message, generation
            )
            conditions = [c for c in conditions if c["type"] != st.DEGRADED] + [replacement]
        state = st.rollout(deployment, spec.replicas) if deployment else None
        applied = state.applied_generation if state else None
        carried = st.carried_apply_failure(previous.get("conditions", []), applied, generation)
        if carried:
            conditions = [c for c in conditions if c["type"] != st.DEGRADED] + [carried]
        return {
            **base,
            "observedGeneration": applied or previous.get("observedGeneration"),
            "replicas": state.replicas if state else 0,
            "readyReplicas": state.ready if state else 0,
            "conditions": conditions,
        }
