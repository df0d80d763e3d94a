"""Children of a SessionServer: `tokenkeep serve` configured through environment variables,
in front of every replica of one ModelServer, with its Redis."""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from session_server.settings import ENV_NAMES
from tokenkeep_operator.manifests import engine, redis
from tokenkeep_operator.manifests.common import (
    CONFIG_HASH_ANNOTATION,
    ENDPOINT_PROPAGATION_SECONDS,
    GENERATION_ANNOTATION,
    USES_MODEL_SERVER_LABEL,
    Owner,
    generated_secret,
    http_probe,
    labels,
    locked_down,
    metadata,
    pod_disruption_budget,
    scheduling_fields,
    secret_env,
    selector_labels,
    service_account,
)
from tokenkeep_operator.manifests.podtemplate import merge_pod
from tokenkeep_operator.models import ModelServerSpec, SecretKeyRef, SessionServerSpec

APP = "tokenkeep"
COMPONENT = "session-server"
PORT = 8000
# The non-root user of the tokenkeep image (see the Dockerfile).
TOKENKEEP_UID = 10001
ADMIN_KEY_SECRET_KEY = "admin-key"
# uvicorn's own shutdown after the drain (session_server/cli.py) plus a second of slack.
SHUTDOWN_MARGIN_SECONDS = 6


# A file:/// model lives in the engine image: an init container running that image copies the
# model directory's small files (tokenizer, chat template, configs; not the weights) here.
TOKENIZER_PATH = "/tokenizer"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


class ConfigError(ValueError):
    """The SessionServer cannot be rendered as specified (the message says what to change)."""


def deployment_name(owner_name: str) -> str:
    return f"{owner_name}-sessions"


def config_map_name(owner_name: str) -> str:
    return f"{owner_name}-sessions-config"


def service_url(owner_name: str, namespace: str) -> str:
    return f"http://{deployment_name(owner_name)}.{namespace}.svc:{PORT}"


def session_url_template(owner_name: str, namespace: str) -> str:
    return f"{service_url(owner_name, namespace)}/sessions/{{session_id}}/v1"


def pod_selector(owner: Owner) -> dict[str, str]:
    return selector_labels(owner, APP, COMPONENT)


def tokenizer(spec: SessionServerSpec, model_server: ModelServerSpec) -> str:
    if spec.tokenizer:
        return spec.tokenizer
    if model_server.model.scheme == "hf":
        return model_server.model.location
    if model_server.model.scheme == "file":
        return TOKENIZER_PATH
    raise ConfigError(
        "spec.tokenizer is required when the ModelServer loads its model from a pvc:// uri"
    )


def settings(
    owner: Owner, spec: SessionServerSpec, model_server_name: str, model_server: ModelServerSpec
) -> dict[str, str]:
    """The session server's environment, as ConfigMap data (secrets are referenced apart),
    named by the server's own settings (ENV_NAMES)."""
    data = {
        ENV_NAMES["engine_urls"]: engine.replicas_url(model_server_name, owner.namespace),
        # The wire format of the engine the ModelServer runs (vLLM's or SGLang's).
        ENV_NAMES["engine_kind"]: model_server.engine.kind,
        # The headless Service resolves to every engine pod: one replica each.
        ENV_NAMES["engine_discovery"]: "true",
        ENV_NAMES["model"]: engine.served_model_name(model_server_name, model_server),
        ENV_NAMES["tokenizer"]: tokenizer(spec, model_server),
        ENV_NAMES["renderer"]: spec.renderer,
        ENV_NAMES["host"]: "0.0.0.0",
        ENV_NAMES["port"]: str(PORT),
        ENV_NAMES["session_ttl_seconds"]: str(spec.session_ttl_seconds),
        "HF_HOME": "/cache/huggingface",
    }
    if not spec.tokenizer and model_server.model.scheme == "hf" and model_server.model.revision:
        # The engine loads this revision (engine.py `--revision`): the tokenizer must too.
        data[ENV_NAMES["tokenizer_revision"]] = model_server.model.revision
    if spec.sampling_overrides:
        data[ENV_NAMES["sampling_overrides"]] = json.dumps(
            spec.sampling_overrides, sort_keys=True, separators=(",", ":")
        )
    if spec.redis.mode == "Managed":
        data[ENV_NAMES["redis_url"]] = redis.url(owner.name, owner.namespace)
        routed = model_server.engine.return_routed_experts
        try:
            redis.max_memory_bytes(spec.redis.managed, routed)
        except redis.RedisConfigError as error:
            raise ConfigError(str(error)) from None
    elif spec.redis.external and spec.redis.external.wait_replicas:
        data[ENV_NAMES["redis_wait_replicas"]] = str(spec.redis.external.wait_replicas)
    data[ENV_NAMES["shutdown_grace_s"]] = str(spec.shutdown_grace_seconds)
    if spec.max_policy_lag is not None:
        data[ENV_NAMES["max_policy_lag"]] = str(spec.max_policy_lag)
    return data


def config_map(owner: Owner, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(owner, config_map_name(owner.name), labels(owner, APP, COMPONENT)),
        "data": data,
    }


def admin_key_ref(name: str, spec: SessionServerSpec) -> SecretKeyRef:
    """The admin key: the Secret the user named, else the one the operator generates."""
    return spec.api_key_secret_ref or SecretKeyRef(
        name=f"{name}-admin-key", key=ADMIN_KEY_SECRET_KEY
    )


def admin_key_secret(owner: Owner) -> dict[str, Any]:
    """A new random admin key. Created once and never updated (the reconciler creates it
    only where it is missing): rotating it is deleting it. Owned by the SessionServer, so
    it goes with it. Session keys are never stored here: `POST /sessions` returns each one
    to its caller, who holds the admin key."""
    return generated_secret(
        owner,
        f"{owner.name}-admin-key",
        ADMIN_KEY_SECRET_KEY,
        secrets.token_urlsafe(32),
        APP,
        COMPONENT,
    )


def _secret_env(
    owner: Owner, spec: SessionServerSpec, model_server_name: str, model_server: ModelServerSpec
) -> list[dict[str, Any]]:
    env = []
    if spec.redis.mode == "Managed":
        # The URL is in the ConfigMap; its password comes apart, from the Secret.
        ref = redis.password_ref(owner.name, spec.redis.managed)
        env.append(secret_env(ENV_NAMES["redis_password"], ref.name, ref.key))
    if spec.redis.mode == "External" and spec.redis.external:
        ref = spec.redis.external.url_secret_ref
        env.append(secret_env(ENV_NAMES["redis_url"], ref.name, ref.key))
    # The server listens on 0.0.0.0, which it refuses to do without an admin key.
    ref = admin_key_ref(owner.name, spec)
    env.append(secret_env(ENV_NAMES["admin_key"], ref.name, ref.key))
    if model_server.model.auth_secret_ref:
        # The same token that lets vLLM download a gated model lets us load its tokenizer.
        ref = model_server.model.auth_secret_ref
        env.append(secret_env("HF_TOKEN", ref.name, ref.key))
    engine_key = engine.engine_key_ref(model_server_name, model_server)
    if engine_key:
        # The engines ask every request but /health for it (tokenkeep_vllm.EngineKey on
        # vLLM, --api-key on SGLang).
        env.append(secret_env(ENV_NAMES["engine_key"], engine_key.name, engine_key.key))
    return env


def deployment(
    owner: Owner,
    spec: SessionServerSpec,
    model_server_name: str,
    model_server: ModelServerSpec,
    data: dict[str, str],
    default_image: str,
) -> dict[str, Any]:
    object_labels = labels(owner, APP, COMPONENT)
    config_hash = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    resources: dict[str, Any] = {}
    if spec.resources.requests:
        resources["requests"] = dict(spec.resources.requests)
    if spec.resources.limits:
        resources["limits"] = dict(spec.resources.limits)
    container = {
        "name": "session-server",
        "image": spec.image or default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["tokenkeep", "serve"],
        "envFrom": [{"configMapRef": {"name": config_map_name(owner.name)}}],
        "env": _secret_env(owner, spec, model_server_name, model_server),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        # Loading a tokenizer from the Hub can take a while on a cold node.
        "startupProbe": http_probe("/healthz", period=5, failures=60),
        "readinessProbe": http_probe("/readyz", period=5, failures=2),
        "livenessProbe": http_probe("/healthz", period=10, failures=3),
        "lifecycle": {
            "preStop": {"exec": {"command": ["sleep", str(ENDPOINT_PROPAGATION_SECONDS)]}}
        },
        "resources": resources,
        # A crash at start shows its last log line in the SessionServer's CrashLoop condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": locked_down(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": "/cache"},
        ],
    }
    if not container["env"]:
        del container["env"]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    init_containers = []
    if not spec.tokenizer and model_server.model.scheme == "file":
        init_containers.append(_tokenizer_copy(model_server))
        volumes.append({"name": "tokenizer", "emptyDir": {}})
        container["volumeMounts"].append(
            {"name": "tokenizer", "mountPath": TOKENIZER_PATH, "readOnly": True}
        )
    checkpoints = engine.checkpoint_mount(model_server)
    if checkpoints:
        # POST /policy validates a checkpoint folder here before any engine reloads it.
        volumes.append(checkpoints[0])
        container["volumeMounts"].append(checkpoints[1])
    pod_extra = {"initContainers": init_containers} if init_containers else {}
    template, _ = merge_pod(
        {
            "metadata": {
                # What the ModelServer's NetworkPolicy admits to the engines.
                "labels": object_labels | {USES_MODEL_SERVER_LABEL: model_server_name},
                # A changed ConfigMap rolls the pods, which read it only at start-up.
                "annotations": {CONFIG_HASH_ANNOTATION: config_hash},
            },
            "spec": {
                "serviceAccountName": deployment_name(owner.name),
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                # preStop sleep (endpoints drop the pod), then SIGTERM: the server drains
                # for up to shutdownGraceSeconds, then its own shutdown takes <= 5 s.
                "terminationGracePeriodSeconds": ENDPOINT_PROPAGATION_SECONDS
                + spec.shutdown_grace_seconds
                + SHUTDOWN_MARGIN_SECONDS,
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": TOKENKEEP_UID,
                    "runAsGroup": TOKENKEEP_UID,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                **pod_extra,
                "containers": [container],
                "volumes": volumes,
                **scheduling_fields(spec.scheduling),
            },
        },
        spec.pod_template,
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(
            owner,
            deployment_name(owner.name),
            object_labels,
            annotations={GENERATION_ANNOTATION: str(owner.generation)},
        ),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": pod_selector(owner)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": template,
        },
    }


def _tokenizer_copy(model_server: ModelServerSpec) -> dict[str, Any]:
    """Copies the tokenizer of a file:/// model out of the engine image (which has a shell),
    so that the session server reads the very files the engine serves with, no hub needed."""
    source = model_server.model.location.rstrip("/")
    skip = " ".join(f"! -name '*{suffix}'" for suffix in WEIGHT_SUFFIXES)
    return {
        "name": "tokenizer",
        "image": model_server.engine.image_or_default,
        "imagePullPolicy": model_server.engine.image_pull_policy,
        "command": [
            "sh",
            "-c",
            f"find '{source}' -maxdepth 1 -type f {skip} -exec cp {{}} {TOKENIZER_PATH}/ ';'",
        ],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
        "securityContext": locked_down(),
        "volumeMounts": [{"name": "tokenizer", "mountPath": TOKENIZER_PATH}],
    }


def service(owner: Owner, spec: SessionServerSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(owner, deployment_name(owner.name), labels(owner, APP, COMPONENT)),
        "spec": {
            "type": spec.service_type,
            "selector": pod_selector(owner),
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render(
    owner: Owner,
    spec: SessionServerSpec,
    model_server_name: str,
    model_server: ModelServerSpec,
    default_image: str,
) -> list[dict[str, Any]]:
    """Every child of a SessionServer, in the order they should be applied.

    Raises ConfigError when the spec cannot work with this ModelServer."""
    data = settings(owner, spec, model_server_name, model_server)
    objects: list[dict[str, Any]] = []
    if spec.redis.mode == "Managed":
        routed = model_server.engine.return_routed_experts
        objects += redis.render(owner, spec.redis.managed, spec.scheduling, routed)
        if spec.network_policy.enabled:
            objects.append(redis.redis_network_policy(owner, pod_selector(owner)))
    return [
        *objects,
        service_account(owner, deployment_name(owner.name), APP, COMPONENT),
        config_map(owner, data),
        service(owner, spec),
        pod_disruption_budget(owner, deployment_name(owner.name), APP, COMPONENT),
        deployment(owner, spec, model_server_name, model_server, data, default_image),
    ]
