"""A small Kubernetes REST client for the kinds the operator manages, over the official
client's authenticated `ApiClient` (so in-cluster and kubeconfig logins both work)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, config

from tokenkeep_operator.models import API_VERSION

PLURALS = {
    "ConfigMap": "configmaps",
    "Deployment": "deployments",
    "Event": "events",
    "Lease": "leases",
    "LeaderWorkerSet": "leaderworkersets",
    "ModelServer": "modelservers",
    "NetworkPolicy": "networkpolicies",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Pod": "pods",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Secret": "secrets",
    "Service": "services",
    "ServiceAccount": "serviceaccounts",
    "SessionServer": "sessionservers",
    "StatefulSet": "statefulsets",
}
MERGE_PATCH = "application/merge-patch+json"
# How long what the API server serves (discovery) is trusted before asking again; a kind
# found missing is asked for again sooner, so that a CRD installed later (LeaderWorkerSet)
# is noticed within seconds.
DISCOVERY_TTL_SECONDS = 300
MISSING_RECHECK_SECONDS = 10
COMPONENT = "tokenkeep-operator"

logger = logging.getLogger(__name__)


def error_message(error: Exception) -> str:
    """The API server's own message (from its Status body), else the HTTP reason, else
    what the connection said."""
    if not isinstance(error, client.ApiException):
        return str(error)
    try:
        message = json.loads(error.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return message or f"{error.status} {error.reason}"


def load_config() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # The client reads $KUBECONFIG once, at import; read it now.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    return client.ApiClient()


def resource_path(
    api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None
) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class Kube:
    """get / list / create / merge-patch of namespaced objects, as plain dicts."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api = api_client
        self._served: dict[str, tuple[float, set[str]]] = {}
        self._served_lock = threading.Lock()

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        method, url, headers, body, post = self._api.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._api.call_api(
            method, url, header_params=headers, body=body, post_params=post
        )
        response.read()
        if not 200 <= response.status < 300:
            raise client.ApiException(http_resp=response)
        return json.loads(response.data)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", resource_path(api_version, kind, namespace, name))
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str, selector: str | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", selector)] if selector else []
        found = self._call("GET", resource_path(api_version, kind, namespace), query=query)
        return list(found.get("items") or [])

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return self._call("POST", path, body=obj)

    def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        sub: str | None = None,
    ) -> dict[str, Any]:
        path = resource_path(api_version, kind, namespace, name, sub)
        return self._call("PATCH", path, body=patch, content_type=MERGE_PATCH)

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._call("DELETE", resource_path(api_version, kind, namespace, name))

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """PUT: fails with 409 unless `obj` carries the live resourceVersion."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        return self._call("PUT", path, body=obj)

    def get_custom(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.get(API_VERSION, kind, namespace, name)

    def patch_status(
        self, kind: str, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        return self.patch(API_VERSION, kind, namespace, name, {"status": status}, sub="status")

    def served(self, api_version: str, kind: str) -> bool:
        """Whether the API server serves `kind` in `api_version` (discovery, cached)."""
        with self._served_lock:
            checked, kinds = self._served.get(api_version, (0.0, set()))
            ttl = DISCOVERY_TTL_SECONDS if kind in kinds else MISSING_RECHECK_SECONDS
            if time.monotonic() - checked > ttl:
                base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
                try:
                    found = self._call("GET", base)
                    kinds = {r["kind"] for r in found.get("resources", [])}
                except client.ApiException as error:
                    if error.status != 404:
                        raise
                    kinds = set()
                self._served[api_version] = (time.monotonic(), kinds)
            return kind in kinds

    def post_event(self, about: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on `about`. Best effort: a failure is logged, never raised."""
        meta = about["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": about["apiVersion"],
                "kind": about["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.create(event)
        except client.ApiException as error:
            logger.warning(
                "event %s on %s not posted: %s", reason, meta["name"], error_message(error)
            )
