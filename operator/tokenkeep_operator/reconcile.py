"""What the operator does, without Kopf: read the resource, render its children, apply the
ones the API server serves, and recompute its status from what the cluster reports.

One entry point per kind (`reconcile_model_server`, `reconcile_session_server`), run by the
work queue for every event of the resource or of a child it owns: applying writes only what
differs from the rendering (so a hand edit is undone and an unchanged cluster sees no write),
and the status is written only when it changes, with one Event per change of state.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import UTC, datetime
from typing import Any

from kubernetes.client import ApiException
from pydantic import BaseModel, ValidationError

from tokenkeep_operator import status as st
from tokenkeep_operator.apply import apply
from tokenkeep_operator.kube import Kube, error_message
from tokenkeep_operator.manifests import engine, podtemplate, redis, session
from tokenkeep_operator.manifests.common import (
    NETWORK_POLICY_API_VERSION,
    Owner,
    selector_string,
)
from tokenkeep_operator.models import (
    API_VERSION,
    MAX_NAME_LENGTH,
    ModelServerSpec,
    SessionServerSpec,
)

logger = logging.getLogger(__name__)

# Children the product ships but can do without where the API server does not serve their
# API (a PodDisruptionBudget needs policy/v1, Kubernetes >= 1.21; a NetworkPolicy
# networking.k8s.io/v1, served since 1.7, but its absence must not keep the engines down).
OPTIONAL_KINDS = {"PodDisruptionBudget", "NetworkPolicy"}
# How often a multi-node ModelServer looks again for the LeaderWorkerSet API while it is not
# served (installing its CRD changes nothing the operator watches).
LWS_RECHECK_SECONDS = 10.0
LWS_INSTALL_HINT = (
    "parallelism.nodes > 1 runs each engine replica as a LeaderWorkerSet group, and this "
    f"cluster does not serve {engine.LWS_API_VERSION}: install the LeaderWorkerSet "
    "controller (kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/"
    "releases/download/v0.10.0/manifests.yaml), or set parallelism.nodes to 1"
)
# The Event reason naming spec.podTemplate fields the operator's own values override.
POD_TEMPLATE_CONFLICT = "PodTemplateConflict"
# How often a SessionServer's status.policy is refreshed from its server's GET /policy (a
# publish changes no Kubernetes object, so no event would), and how long one ask may take.
POLICY_POLL_SECONDS = 30.0
POLICY_TIMEOUT_SECONDS = 3.0
# Asks run here, so that a name that never resolves cannot hold a reconcile past the timeout.
_policy_askers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="policy")


def ask_policy(url: str, admin_key: str) -> tuple[int, Any]:
    """GET `url` with the admin key: (HTTP status, parsed JSON body or None). Raises OSError
    (urllib's errors among them) when the server cannot be reached in time."""
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {admin_key}", "Accept": "application/json"}
    )

    def get() -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(request, timeout=POLICY_TIMEOUT_SECONDS) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            return error.code, None
        except ValueError:  # not JSON
            return 200, None

    try:
        return _policy_askers.submit(get).result(timeout=POLICY_TIMEOUT_SECONDS + 1)
    except FutureTimeout as error:
        raise TimeoutError(f"no answer in {POLICY_TIMEOUT_SECONDS:.0f} s") from error


class ApplyError(Exception):
    """Some children could not be applied (already reported in status); try again later."""


class StatusWriteError(Exception):
    """The status could not be written (already reported as an Event); try again later."""


def field_path(loc: tuple[int | str, ...], prefix: str = "spec") -> str:
    path = prefix
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def describe_validation_error(error: ValidationError, prefix: str = "spec") -> list[str]:
    """Every error, each as `<field path in the resource>: <what is wrong>`. A validator that
    checks several fields names the one at fault first (`field: message`)."""
    described = []
    for item in error.errors(include_url=False):
        loc = tuple(item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        head, sep, rest = message.partition(": ")
        if sep and " " not in head:
            loc, message = (*loc, *head.split(".")), rest
        described.append(f"{field_path(loc, prefix)}: {message}")
    return described


def validate(model: type[BaseModel], body: dict[str, Any]) -> tuple[Any, list[str]]:
    """The parsed spec (None if invalid) and every problem with the resource."""
    problems = []
    name = body["metadata"]["name"]
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            f"metadata.name: {len(name)} characters, at most {MAX_NAME_LENGTH} allowed "
            "(children add suffixes to it and Service names have at most 63)"
        )
    try:
        spec = model.model_validate(body.get("spec") or {})
    except ValidationError as error:
        return None, problems + describe_validation_error(error)
    return (None if problems else spec), problems


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


def _pruned(value: Any) -> Any:
    """`value` without null fields: a status is merge-patched, where null deletes a field
    (status.policy.version once unknown), so the server keeps no null to compare with."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    return value


def _transient(error: ApiException) -> bool:
    return error.status is None or error.status >= 500 or error.status in (409, 429)


def event_for(
    new: list[dict[str, Any]], previous: list[dict[str, Any]]
) -> tuple[str, str, str] | None:
    """One Event per change of state: (type, reason, message), or None if nothing changed.
    Warning only when the resource needs a person (Degraded turned True or changed reason);
    everything else, including recovery, is Normal progress."""
    changed = {c["type"]: c for c in st.changed_conditions(new, previous)}
    if not changed:
        return None
    degraded = changed.get(st.DEGRADED)
    if degraded and degraded["status"] == "True":
        return "Warning", degraded["reason"], degraded["message"]
    chosen = changed.get(st.READY) or changed.get(st.PROGRESSING) or degraded
    assert chosen is not None
    message = f"{chosen['type']} is {chosen['status']}"
    if chosen["message"]:
        message += f": {chosen['message']}"
    return "Normal", chosen["reason"], message


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        default_image: str,
        clock: Callable[[], str] = _now,
        policy_asker: Callable[[str, str], tuple[int, Any]] = ask_policy,
    ) -> None:
        self.kube = kube
        self.default_image = default_image
        self.clock = clock
        self.policy_asker = policy_asker
        self._locks: defaultdict[tuple[str, str, str], threading.Lock] = defaultdict(threading.Lock)
        self._locks_guard = threading.Lock()
        self._skipped: set[tuple[str, str]] = set()
        # The last status-write failure reported per resource uid: one Warning per failure
        # state, not one per retry.
        self._write_failures: dict[str, str] = {}
        # The spec.podTemplate conflicts last reported per resource uid.
        self._conflicts: dict[str, str] = {}

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        """One reconcile per resource at a time, so that an older observation never
        overwrites a newer one."""
        with self._locks_guard:
            return self._locks[(kind, namespace, name)]

    def reconcile(self, kind: str, namespace: str, name: str) -> float | None:
        """Seconds after which to reconcile this resource again with no event (a
        SessionServer's published policy), or None."""
        if kind == "ModelServer":
            return self.reconcile_model_server(namespace, name)
        return self.reconcile_session_server(namespace, name)

    def _apply_all(self, body: dict[str, Any], objects: list[dict[str, Any]]) -> list[str]:
        """Apply every child that can be applied; a refused one does not stop the others.
        Returns what the API server refused ("Kind name: its message"); raises on transient
        errors after trying the rest."""
        refused: list[str] = []
        transient: ApiException | None = None
        for obj in objects:
            if obj["kind"] in OPTIONAL_KINDS and not self.kube.served(
                obj["apiVersion"], obj["kind"]
            ):
                self._skip_once(body, obj)
                continue
            try:
                apply(self.kube, obj)
            except ApiException as error:
                what = f"{obj['kind']} {obj['metadata']['name']}"
                logger.warning(
                    "%s/%s: %s: %s",
                    body["kind"],
                    body["metadata"]["name"],
                    what,
                    error_message(error),
                )
                if _transient(error):
                    transient = error
                else:
                    refused.append(f"{what}: {error_message(error)}")
        if transient is not None and not refused:
            raise transient
        return refused

    def _skip_once(self, body: dict[str, Any], obj: dict[str, Any]) -> None:
        key = (body["metadata"]["uid"], obj["kind"])
        if key in self._skipped:
            return
        self._skipped.add(key)
        message = (
            f"{obj['kind']} {obj['metadata']['name']} not created: this API server does not "
            f"serve {obj['apiVersion']}"
        )
        self.kube.post_event(body, "Warning", "APINotServed", message)

    def _report_conflicts(self, body: dict[str, Any], conflicts: list[str]) -> None:
        """One Warning Event per distinct set of spec.podTemplate fields the operator's own
        values override (per resource and operator start; the rendered pod runs anyway)."""
        uid = body["metadata"]["uid"]
        if not conflicts:
            self._conflicts.pop(uid, None)
            return
        message = "; ".join(conflicts)
        if self._conflicts.get(uid) == message:
            return
        self._conflicts[uid] = message
        self.kube.post_event(body, "Warning", POD_TEMPLATE_CONFLICT, message)

    def _delete_owned(
        self, body: dict[str, Any], api_version: str, kind: str, name: str
    ) -> list[str]:
        """Delete the child `kind` `name` if this resource owns it and the rendering no longer
        has it: a NetworkPolicy turned off would go on refusing the peers the user now means
        to let in; the engine's Deployment of a ModelServer turned multi-node (or its
        LeaderWorkerSet, turned back) would go on holding GPUs. One of the same name that
        someone else made is left alone. Returns the refusal, if any."""
        namespace = body["metadata"]["namespace"]
        try:
            live = self.kube.get(api_version, kind, namespace, name)
            refs = (live or {}).get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") == body["metadata"]["uid"] for ref in refs):
                self.kube.delete(api_version, kind, namespace, name)
        except ApiException as error:
            if error.status == 404:  # gone meanwhile, or the API is not served
                return []
            if _transient(error):
                raise
            return [f"{kind} {name}: {error_message(error)}"]
        return []

    def _create_key(self, secret: dict[str, Any]) -> str | None:
        """Create a generated key's Secret (admin key, engine key) unless it exists; the
        refusal's message if the server refuses it. Create-only: applying it would replace
        the key on every reconcile."""
        try:
            self.kube.create(secret)
        except ApiException as error:
            if error.status == 409:  # it exists, which is the usual case
                return None
            if _transient(error):
                raise
            return f"Secret {secret['metadata']['name']}: {error_message(error)}"
        return None

    def _write_status(self, body: dict[str, Any], new: dict[str, Any]) -> None:
        previous = body.get("status") or {}
        old_conditions = previous.get("conditions", [])
        new = {
            **new,
            "conditions": st.with_transition_times(new["conditions"], old_conditions, self.clock()),
        }
        if all(_pruned(previous.get(k)) == _pruned(v) for k, v in new.items()):
            return
        meta = body["metadata"]
        try:
            self.kube.patch_status(body["kind"], meta["namespace"], meta["name"], new)
        except ApiException as error:
            if error.status == 404:
                return  # deleted meanwhile: nothing to report on
            message = f"status not written: {error_message(error)}"
            if self._write_failures.get(meta["uid"]) != message:
                self._write_failures[meta["uid"]] = message
                self.kube.post_event(body, "Warning", "StatusWriteFailed", message)
            raise StatusWriteError(message) from error
        self._write_failures.pop(meta["uid"], None)
        event = event_for(new["conditions"], old_conditions)
        if event:
            self.kube.post_event(body, *event)

    def _finish(self, body: dict[str, Any], status: dict[str, Any], refused: list[str]) -> None:
        if refused:
            generation = body["metadata"].get("generation", 1)
            failed = st.condition(
                st.DEGRADED, True, st.APPLY_FAILED, "; ".join(refused), generation
            )
            conditions = [c for c in status["conditions"] if c["type"] != st.DEGRADED]
            status = {**status, "conditions": [*conditions, failed]}
        self._write_status(body, status)
        if refused:
            raise ApplyError("; ".join(refused))

    # --- ModelServer ---------------------------------------------------------------------

    def reconcile_model_server(self, namespace: str, name: str) -> float | None:
        """Seconds after which to reconcile again with no event (a multi-node ModelServer
        waiting for the LeaderWorkerSet API), or None."""
        with self._lock("ModelServer", namespace, name):
            body = self.kube.get_custom("ModelServer", namespace, name)
            if body is None:
                return None
            spec, problems = validate(ModelServerSpec, body)
            refused: list[str] = []
            multi_node = spec is not None and spec.parallelism.nodes > 1
            lws_missing = multi_node and not self.kube.served(
                engine.LWS_API_VERSION, engine.LWS_KIND
            )
            # Without the LWS API nothing is applied, as for an invalid spec: an engine that
            # runs on one node (before nodes was raised) keeps serving until LWS is installed.
            if spec is not None and not lws_missing:
                owner = _owner(body)
                # The key first: the engine pods (and the session servers') read it.
                generated = spec.policy.publishing and spec.policy.engine_key_secret_ref is None
                problem = self._create_key(engine.engine_key_secret(owner)) if generated else None
                refused = self._apply_all(body, engine.render(owner, spec, self.default_image))
                # The other engine workload, left from before nodes changed (where the LWS API
                # is not served, getting an LWS finds nothing).
                if multi_node:
                    other = ("apps/v1", "Deployment", engine.deployment_name(name))
                else:
                    lws_name = engine.leader_worker_set_name(name)
                    other = (engine.LWS_API_VERSION, engine.LWS_KIND, lws_name)
                refused += self._delete_owned(body, *other)
                self._report_conflicts(
                    body,
                    podtemplate.conflicts(
                        lambda s: engine.render(owner, s, self.default_image), spec
                    ),
                )
                if not spec.network_policy.enabled:
                    refused += self._delete_owned(
                        body,
                        NETWORK_POLICY_API_VERSION,
                        "NetworkPolicy",
                        engine.deployment_name(name),
                    )
                if problem:
                    refused.append(problem)
            status = self.model_server_status(body, spec, problems, lws_missing=lws_missing)
            self._finish(body, status, refused)
            return LWS_RECHECK_SECONDS if lws_missing else None

    def model_server_status(
        self,
        body: dict[str, Any],
        spec: ModelServerSpec | None,
        problems: list[str],
        *,
        lws_missing: bool = False,
    ) -> dict[str, Any]:
        meta = body["metadata"]
        namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
        owner = _owner(body)
        base = {
            "url": engine.service_url(name, namespace),
            "selector": selector_string(engine.pod_selector(owner)),
            "observedGeneration": generation,
        }
        if spec is None:
            conditions = st.blocked_conditions(st.INVALID_SPEC, "; ".join(problems), generation)
            return {**base, "conditions": conditions}
        if lws_missing:
            conditions = st.blocked_conditions(
                st.LEADER_WORKER_SET_MISSING, LWS_INSTALL_HINT, generation
            )
            return {**base, "conditions": conditions}
        if spec.parallelism.nodes > 1:
            lws = self.kube.get(
                engine.LWS_API_VERSION,
                engine.LWS_KIND,
                namespace,
                engine.leader_worker_set_name(name),
            )
            controller = st.leader_worker_set_as_workload(lws)
        else:
            controller = self.kube.get(
                "apps/v1", "Deployment", namespace, engine.deployment_name(name)
            )
        # Every engine pod, a multi-node group's workers too: any of them can be what blocks.
        pods = self.kube.list("v1", "Pod", namespace, selector_string(engine.pod_selector(owner)))
        claims = []
        # A multi-node engine's cache claims are its pods' (volumeClaimTemplates): one that
        # blocks shows in its pod's scheduling message.
        if spec.cache.enabled and spec.parallelism.nodes == 1:
            claim = self.kube.get(
                "v1", "PersistentVolumeClaim", namespace, engine.cache_claim_name(name)
            )
            claims = [claim] if claim else []
        workload = st.Workload(controller, pods, claims)
        conditions = st.workload_conditions(
            workload,
            spec.replicas,
            generation,
            what="vLLM",
            gpu_resource=spec.resources.gpu_resource_name,
        )
        return {**base, **st.counts(workload), "conditions": conditions}

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
        spec, problems = validate(SessionServerSpec, body)
        if spec is None:
            return st.blocked_conditions(st.INVALID_SPEC, "; ".join(problems), generation)
        ms_name = spec.model_server_ref.name
        model_server = self.kube.get_custom("ModelServer", namespace, ms_name)
        if model_server is None:
            message = f"ModelServer {ms_name} does not exist in namespace {namespace}"
            return st.blocked_conditions(st.MODEL_SERVER_NOT_FOUND, message, generation)
        ms_spec, _ = validate(ModelServerSpec, model_server)
        if ms_spec is None:
            message = f"ModelServer {ms_name} has an invalid spec"
            return st.blocked_conditions(st.MODEL_SERVER_NOT_READY, message, generation)
        try:
            session.settings(_owner(body), spec, ms_name, ms_spec)
        except session.ConfigError as error:
            return st.blocked_conditions(st.INVALID_SPEC, str(error), generation)
        return spec, ms_name, ms_spec, model_server

    def reconcile_session_server(self, namespace: str, name: str) -> float | None:
        with self._lock("SessionServer", namespace, name):
            body = self.kube.get_custom("SessionServer", namespace, name)
            if body is None:
                return None
            inputs = self._session_inputs(body)
            refused: list[str] = []
            if not isinstance(inputs, list):
                spec, ms_name, ms_spec, _ = inputs
                owner = _owner(body)
                objects = session.render(owner, spec, ms_name, ms_spec, self.default_image)
                # The key first: the session server's pods read it from this Secret.
                generated = spec.api_key_secret_ref is None
                problem = self._create_key(session.admin_key_secret(owner)) if generated else None
                managed = spec.redis.managed
                if spec.redis.mode == "Managed" and managed.password_secret_ref is None:
                    # Before Redis and the session servers, which both read it.
                    problem = self._create_key(redis.password_secret(owner)) or problem
                refused = self._apply_all(body, objects)
                self._report_conflicts(
                    body,
                    podtemplate.conflicts(
                        lambda s: session.render(owner, s, ms_name, ms_spec, self.default_image),
                        spec,
                    ),
                )
                if not spec.network_policy.enabled:
                    refused += self._delete_owned(
                        body,
                        NETWORK_POLICY_API_VERSION,
                        "NetworkPolicy",
                        redis.statefulset_name(name),
                    )
                if problem:
                    refused.append(problem)
            self._finish(body, self.session_server_status(body, inputs), refused)
            return None if isinstance(inputs, list) else POLICY_POLL_SECONDS

    def session_server_status(
        self,
        body: dict[str, Any],
        inputs: tuple[SessionServerSpec, str, ModelServerSpec, dict[str, Any]]
        | list[dict[str, Any]],
    ) -> dict[str, Any]:
        meta = body["metadata"]
        namespace, name, generation = meta["namespace"], meta["name"], meta.get("generation", 1)
        base = {
            "url": session.service_url(name, namespace),
            "sessionUrlTemplate": session.session_url_template(name, namespace),
            "observedGeneration": generation,
        }
        if isinstance(inputs, list):
            policy = st.policy_unknown("no session server is deployed (see the conditions)")
            return {**base, "policy": policy, "conditions": inputs}
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
            claim = self.kube.get("v1", "PersistentVolumeClaim", namespace, redis.claim_name(name))
            redis_conditions = st.workload_conditions(
                st.Workload(statefulset, redis_pods, [claim] if claim else []),
                1,
                generation,
                what="Redis",
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
        workload = st.Workload(deployment, pods)
        conditions = st.workload_conditions(
            workload,
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
        counts = st.counts(workload)
        policy, answer = self.published_policy(namespace, name, spec, counts["readyReplicas"])
        conditions += st.server_conditions(answer, generation)
        return {**base, **counts, "policy": policy, "conditions": conditions}

    def published_policy(
        self, namespace: str, name: str, spec: SessionServerSpec, ready: int
    ) -> tuple[dict[str, Any], Any]:
        """status.policy, from the session server's GET /policy through its Service, asked
        with the admin key, and the answer itself (None where there is none; the
        TokenizerMismatch and StoreFull conditions are read from it). Never fails the
        reconcile: a server not ready, not reachable, an unreadable key give `unknown` (with
        why), an image without the endpoint (404) `unsupported`."""
        if not ready:
            return st.policy_unknown("no session server replica is ready"), None
        ref = session.admin_key_ref(name, spec)
        try:
            secret = self.kube.get("v1", "Secret", namespace, ref.name)
        except ApiException as error:
            message = f"admin key Secret {ref.name} not readable: {error_message(error)}"
            return st.policy_unknown(message), None
        try:
            key = base64.b64decode(((secret or {}).get("data") or {})[ref.key]).decode()
        except (KeyError, binascii.Error, UnicodeDecodeError):
            return st.policy_unknown(f"admin key Secret {ref.name} has no key {ref.key}"), None
        url = f"{session.service_url(name, namespace)}/policy"
        try:
            code, answer = self.policy_asker(url, key)
        except OSError as error:
            reason = getattr(error, "reason", None) or error
            return st.policy_unknown(f"GET {url}: {reason}"), None
        if code == 404:
            return st.policy_unsupported(url), None
        if code != 200:
            return st.policy_unknown(f"GET {url} answered {code}"), None
        return st.policy_status(answer), answer
