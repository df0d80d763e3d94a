"""The managed Redis (issue 35, item 8): sized for what the ModelServer stores, `maxmemory`
with `noeviction` below its limit, a password from a Secret that Redis and the session servers
both read, and probes that authenticate and check for PONG. The rendered command line and
probe are run here against a real redis-server (Debian's, as in the CPU image)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py

from tests.operator.conftest import load_example, owner_of
from tests.operator.test_manifests import pvc_modelserver, render_sessionserver
from tests.redis_server import _free_loopback_port
from tokenkeep_operator.manifests import redis, session

GI = 2**30


def _redis_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    statefulset = next(o for o in objects if o["kind"] == "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    return container


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return args[args.index(flag) + 1]


def _session_env(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e for e in container.get("env", [])}


def _sessionserver(**managed: Any) -> dict[str, Any]:
    resource = load_example("sessionserver.yaml")
    resource["spec"]["tokenizer"] = "Qwen/Qwen3-8B"  # the pvc:// ModelServer needs one
    resource["spec"]["redis"]["managed"].update(managed)
    return resource


def test_maxmemory_is_below_the_limit_and_grows_with_routed_experts() -> None:
    plain = _redis_container(render_sessionserver(_sessionserver(), pvc_modelserver()))
    assert plain["resources"]["limits"]["memory"] == "2Gi"
    assert int(_arg(plain, "--maxmemory")) == int(1.5 * GI)
    assert _arg(plain, "--maxmemory-policy") == "noeviction"

    moe = pvc_modelserver()
    moe["spec"]["engine"]["returnRoutedExperts"] = True
    routed = _redis_container(render_sessionserver(_sessionserver(), moe))
    assert routed["resources"]["limits"]["memory"] == "8Gi"
    assert int(_arg(routed, "--maxmemory")) == 6 * GI  # ~15M tokens at ~420 bytes each

    explicit = _sessionserver(
        maxMemory="3Gi", resources={"limits": {"memory": "4Gi"}, "requests": {"memory": "1Gi"}}
    )
    container = _redis_container(render_sessionserver(explicit, moe))
    assert int(_arg(container, "--maxmemory")) == 3 * GI
    assert container["resources"]["limits"]["memory"] == "4Gi"

    no_limit = _sessionserver(resources={"requests": {"memory": "32Mi"}})  # examples/cpu
    assert int(_arg(_redis_container(render_sessionserver(no_limit, pvc_modelserver())),
                    "--maxmemory")) == int(1.5 * GI)  # fmt: skip


def test_a_maxmemory_at_or_above_the_limit_is_refused_with_what_to_change() -> None:
    too_big = _sessionserver(maxMemory="2Gi")
    with pytest.raises(session.ConfigError, match=r"maxMemory 2Gi must be below .* limit 2Gi"):
        render_sessionserver(too_big, pvc_modelserver())
    with pytest.raises(ValueError, match="should match pattern"):  # the CRD's pattern too
        render_sessionserver(_sessionserver(maxMemory="2Gb"), pvc_modelserver())


def test_redis_and_the_session_servers_read_one_password_secret() -> None:
    objects = render_sessionserver(_sessionserver(), pvc_modelserver())
    container = _redis_container(objects)
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    generated = {"name": "rollouts-redis-password", "key": "password"}
    assert env == {"REDIS_PASSWORD": generated, "REDISCLI_AUTH": generated}
    assert _arg(container, "--requirepass") == "$(REDIS_PASSWORD)"
    session_env = _session_env(objects)
    assert session_env["TOKENKEEP_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == generated
    config = next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    assert "@" not in config["TOKENKEEP_REDIS_URL"]  # no secret in the ConfigMap

    secret = redis.password_secret(owner_of(load_example("sessionserver.yaml")))
    assert secret["metadata"]["name"] == "rollouts-redis-password"
    assert re.fullmatch(r"[0-9a-f]{64}", secret["stringData"]["password"])

    named = _sessionserver(passwordSecretRef={"name": "mine", "key": "pw"})
    objects = render_sessionserver(named, pvc_modelserver())
    mine = {"name": "mine", "key": "pw"}
    assert _redis_container(objects)["env"][0]["valueFrom"]["secretKeyRef"] == mine
    assert _session_env(objects)["TOKENKEEP_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == mine


def _probe(container: dict[str, Any], env: dict[str, str], kind: str = "readinessProbe") -> int:
    command = container[kind]["exec"]["command"]
    return subprocess.run(command, env=env, capture_output=True, timeout=10).returncode


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_the_rendered_redis_command_and_probe_work_on_a_real_redis(tmp_path: Path) -> None:
    """What the kubelet does: expand $(REDIS_PASSWORD) in the args, run the probe with the
    container's environment. The probe fails without the password, where a bare
    `redis-cli ping` exits 0 on NOAUTH."""
    container = _redis_container(render_sessionserver(_sessionserver(), pvc_modelserver()))
    password = "f" * 64
    port = _free_loopback_port()
    args = [a.replace("$(REDIS_PASSWORD)", password) for a in container["args"]]
    args[args.index("--dir") + 1] = str(tmp_path)
    proc = subprocess.Popen(
        [*args, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis_py.Redis(port=port, password=password)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert client.config_get("maxmemory")["maxmemory"] == str(int(1.5 * GI))
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        base = {"PATH": os.environ["PATH"]}
        # redis-cli has no port variable: the probe runs in the pod on 6379; here on `port`.
        probed = {
            kind: {"exec": {"command": [c.replace("redis-cli", f"redis-cli -p {port}")
                                        for c in container[kind]["exec"]["command"]]}}
            for kind in ("readinessProbe", "livenessProbe")
        }  # fmt: skip
        for kind in probed:
            assert _probe(probed, {**base, "REDISCLI_AUTH": password}, kind) == 0
            assert _probe(probed, base, kind) != 0
            assert _probe(probed, {**base, "REDISCLI_AUTH": "wrong"}, kind) != 0
        bare = subprocess.run(["redis-cli", "-p", str(port), "ping"], env=base,
                              capture_output=True, timeout=10)  # fmt: skip
        assert bare.returncode == 0 and b"NOAUTH" in bare.stdout  # why the probe greps
    finally:
        proc.terminate()
        proc.wait(10)
