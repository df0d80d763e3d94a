"""The path every user takes, on a real node: `helm install`, `kubectl apply -f examples/cpu/`,
then a harness (the openai SDK) through the SessionServer's Service, to a vLLM CPU engine pod.

What this node cannot show: GPU scheduling (the examples/cpu ModelServer asks for no GPU).
"""

from __future__ import annotations

import base64
import itertools
import json
import time
import uuid
from typing import Any

import httpx
import openai
from tokenizers import Tokenizer

from session_server.devtools.demo import TOOLS, answer_grammar, tool_call_grammar, weather
from tests.cluster.conftest import Node, wait_for
from tests.operator.conftest import REPO_ROOT
from tests.operator.real_cluster import OPERATOR_NAMESPACE, RELEASE
from tests.real_tokenizers import qwen3_dir

NS = "rl"
EXAMPLES = REPO_ROOT / "examples" / "cpu"
# Two tool calls then an answer: grammar-constrained, as `tokenkeep demo` does, because the
# engine's weights are random.
SCRIPT = (("What is the weather in Paris?", "Paris"), (None, "Tokyo"), (None, None))


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    found = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in found if c["type"] == type_), {})


def ready(node: Node, kind: str, name: str) -> bool:
    obj = node.json("get", kind, name, "-n", NS)
    return condition(obj, "Ready").get("status") == "True"


def session_service(node: Node) -> str:
    service = node.json("get", "service", "rollouts-sessions", "-n", NS)
    return f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"


def admin_key(node: Node) -> str:
    secret = node.json("get", "secret", "rollouts-admin-key", "-n", NS)
    return base64.b64decode(secret["data"]["admin-key"]).decode()


def tool_loop(
    base: str, key: str, vocab: dict[str, int], session_id: str, turns: int
) -> list[dict[str, Any]]:
    """Drive `turns` turns of the script on a session; returns, per turn, the engine's prompt
    ids and sampled ids as the served response reports them."""
    admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    created = admin.post("/sessions", json={"id": session_id, "sampling": {"seed": 7}})
    assert created.status_code == 201, created.text
    body = created.json()
    client = openai.OpenAI(base_url=body["openai_base_url"], api_key=body["api_key"], timeout=300)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the tools."}]
    seen: list[dict[str, Any]] = []
    for user, city in SCRIPT[:turns]:
        if user:
            messages.append({"role": "user", "content": user})
        grammar = (
            tool_call_grammar(vocab, "get_weather", {"city": [city]})
            if city
            else answer_grammar(vocab)
        )
        started = time.monotonic()
        reply = client.chat.completions.create(
            model=session_id,
            messages=messages,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
            max_tokens=128,
            extra_body={
                "structured_outputs": {"grammar": grammar},
                "reasoning_ended": True,
                "return_token_ids": True,
            },
        )
        message = reply.choices[0].message
        seen.append(
            {
                "prompt_ids": (reply.model_extra or {})["prompt_token_ids"],
                "sampled": reply.choices[0].model_extra["token_ids"],
                "seconds": time.monotonic() - started,
            }
        )
        sent: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls:
            sent["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
                {"city": city}
            ]
        messages.append(sent)
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": weather(city)})
    return seen


def assert_contiguous(turns: list[dict[str, Any]]) -> None:
    """The engine's own prompt ids on every turn start with everything before: prompt +
    sampled tokens of the previous turn, unchanged."""
    for before, after in itertools.pairwise(turns):
        stored = before["prompt_ids"] + before["sampled"]
        assert after["prompt_ids"][: len(stored)] == stored


def diagnose(node: Node) -> None:
    """What an admin would look at, printed when a step fails."""
    for args in (
        ("get", "pods", "-n", NS, "-o", "wide"),
        ("describe", "pods", "-n", NS, "-l", "app.kubernetes.io/name=vllm"),
        ("logs", "-n", NS, "-l", "app.kubernetes.io/name=vllm", "--tail=60"),
        ("logs", "-n", NS, "-l", "app.kubernetes.io/name=tokenkeep", "--tail=60"),
        ("get", "events", "-n", NS),
    ):
        print(f"$ kubectl {' '.join(args)}\n{node.kubectl(*args, check=False)}")


def test_helm_install_apply_examples_and_a_harness_through_the_service(
    node: Node, release: Any
) -> None:
    try:
        run_stack(node)
    except BaseException:
        diagnose(node)
        raise


def run_stack(node: Node) -> None:
    # The operator: a pod of the chart's Deployment, Ready, holding the chart's Lease.
    lease = node.json("get", "lease", "tokenkeep-operator", "-n", OPERATOR_NAMESPACE)
    assert lease["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    wait_for(
        lambda: node.json("get", "lease", "tokenkeep-operator", "-n", OPERATOR_NAMESPACE)[
            "spec"
        ].get("holderIdentity"),
        timeout=120,
    )

    node.kubectl("create", "namespace", NS)
    started = time.monotonic()
    node.kubectl("apply", "-n", NS, "-f", str(EXAMPLES))
    wait_for(lambda: ready(node, "modelserver", "tiny-qwen3"), timeout=900, interval=5)
    node.timings["modelserver_ready_s"] = time.monotonic() - started
    wait_for(lambda: ready(node, "sessionserver", "rollouts"), timeout=600, interval=5)
    node.timings["sessionserver_ready_s"] = time.monotonic() - started

    # `kubectl get` columns say what the pods say.
    table = node.kubectl("get", "modelservers,sessionservers", "-n", NS)
    assert "tiny-qwen3" in table and "rollouts" in table

    base, key = session_service(node), admin_key(node)
    vocab = Tokenizer.from_file(str(qwen3_dir() / "tokenizer.json")).get_vocab()
    session_id = f"cluster-{uuid.uuid4().hex[:12]}"
    turns = tool_loop(base, key, vocab, session_id, turns=len(SCRIPT))
    node.timings["turn_s"] = sorted(t["seconds"] for t in turns)[len(turns) // 2]
    assert_contiguous(turns)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as admin:
        summary = admin.get(f"/sessions/{session_id}").json()
        trajectory = admin.get(f"/sessions/{session_id}/trajectory").json()
    assert (summary["turns"], summary["segments"], summary["breaks"]) == (len(SCRIPT), 1, {})
    [branch] = trajectory["branches"]
    [segment] = branch["segments"]
    assert segment["token_ids"] == turns[-1]["prompt_ids"] + turns[-1]["sampled"]
    assert sum(segment["loss_mask"]) == sum(len(t["sampled"]) for t in turns)

    # The start-up check behind the operator's admin key says the model is token-exact.
    pod = node.json("get", "pods", "-n", NS, "-l", "app.kubernetes.io/name=tokenkeep")["items"][0]
    logs = node.kubectl("logs", "-n", NS, pod["metadata"]["name"])
    assert "start-up check: token-exact" in logs or "start-up check (cached)" in logs, logs
    assert "Traceback" not in logs

    print(f"cluster tier timings: {json.dumps(node.timings)}")

    # Delete the engine pod: the Deployment replaces it (maxSurge 0: meanwhile there is no
    # engine, and turns get a clean 503), then sessions run on the replacement, found
    # through the headless Service's DNS.
    selector = "app.kubernetes.io/name=vllm"
    engine = node.json("get", "pods", "-n", NS, "-l", selector)["items"][0]["metadata"]["name"]
    started = time.monotonic()
    node.kubectl("delete", "pod", "-n", NS, engine, "--timeout=300s")
    node.kubectl("wait", "-n", NS, "--for=condition=Ready", "pod", "-l", selector, "--timeout=900s")
    node.timings["engine_replaced_s"] = time.monotonic() - started
    # With no engine the session servers report not ready (/readyz), so the Service has no
    # endpoint until they have found the replacement.
    node.kubectl(
        "wait", "-n", NS, "--for=condition=Ready", "pod", "-l",
        "app.kubernetes.io/name=tokenkeep", "--timeout=300s",
    )  # fmt: skip

    def serves() -> list[dict[str, Any]]:
        try:
            return tool_loop(base, key, vocab, f"cluster-{uuid.uuid4().hex[:12]}", turns=2)
        except openai.APIStatusError as error:  # 503 until the new address is discovered
            assert error.status_code == 503, error
            raise AssertionError(str(error)) from error
        except httpx.ConnectError as error:  # no ready session server behind the Service yet
            raise AssertionError(str(error)) from error

    assert_contiguous(wait_for(serves, timeout=300, interval=5))

    # Delete everything, then uninstall: nothing left, no stuck finalizer, no Lease.
    node.kubectl("delete", "-n", NS, "-f", str(EXAMPLES), "--timeout=300s")
    assert node.kubectl("get", "modelservers,sessionservers", "-n", NS, "-o", "name") == ""
    node.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", "--timeout", "5m")
    # The Lease and the Deployment go with the release; the operator pod after its grace.
    assert node.kubectl("get", "lease,deployment", "-n", OPERATOR_NAMESPACE, "-o", "name") == ""
    wait_for(
        lambda: node.kubectl("get", "pods", "-n", OPERATOR_NAMESPACE, "-o", "name") == "",
        timeout=120,
    )
    print(f"cluster tier timings: {json.dumps(node.timings)}")
