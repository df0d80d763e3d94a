"""`tokenkeep demo --train`: a GRPO loop that closes through tokenkeep on this machine's CPU.

Each step runs G rollouts (one group) of an unmodified OpenAI-SDK agent loop at session URLs
against the real vLLM CPU engine serving the tiny random-weights Qwen3: the model calls
`get_weather` in Qwen3's own `<tool_call>` tokens, gets the tool's result and answers. A
random-weights model never calls a tool by itself, so the first turn carries a vLLM grammar
written in token ids (`Grammar`): every token of the call is forced except the first
token of the city, one of len(CITIES) ids. The learner knows that grammar and computes the
same masked softmax vLLM sampled from (vLLM's logprobs are taken after the grammar mask).

The reward is 1 when it asked about the city the user named, else 0: a random policy
meets it 1 time in len(CITIES), and only learning raises it.

The learner (`session_server.devtools.grpo`, torch in the engine's environment) takes a
GRPO step from tokenkeep's exported arrays (token ids, loss mask, the rollout's logprobs),
writes the new weights, and the loop publishes them through the session server
(`POST /policy`, as any trainer does): every engine replica reloads them in place (the engine
is never restarted) and the policy version is bumped so the next tokens carry it.

Asynchronous by default: the next step's rollouts start while the learner trains, so some
of them span a weight update; the export's `weight_versions` show where the version changed
and the importance ratio weighs the older tokens against the logprobs they were sampled
with. After each publish the engine's logprobs of a fixed probe are compared with the
learner's on the bf16 weights it sent (a stale output layer, the tied-embeddings trap,
would show as a gap; what remains is bf16 against fp32 arithmetic).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from session_server.devtools import grpo, localengine
from session_server.devtools.stack import local_server, progress
from session_server.devtools.weather import weather, weather_tools
from tokenkeep.cli import counted

CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome")
TARGET = "Lima"
TOOLS = weather_tools(CITIES)
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather assistant. Use the tools."},
    {"role": "user", "content": f"What is the weather in {TARGET}?"},
]
# The policy the learner differentiates is the model's plain softmax: no temperature, no
# top-k/top-p truncation (the model's generation_config would otherwise apply 0.6/20/0.95).
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
DEFAULT_LR = 0.01


EOS_IDS = (151645, 151643)  # Qwen3's end-of-turn ids: either may end the grammar's turn


@dataclass(frozen=True)
class Grammar:
    """The tool-call turn's constraint, in token ids."""

    lark: str
    city_first_ids: tuple[int, ...]

    @classmethod
    def for_model(cls, model_dir: Path) -> Grammar:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        vocab = tokenizer.get_vocab()

        def ids(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False).ids)

        def spelled(token_ids: list[int]) -> str:
            return " ".join(f"<[{i}]>" for i in token_ids)

        cities = [ids(city) for city in CITIES]
        firsts = tuple(city[0] for city in cities)
        if len(set(firsts)) != len(firsts):  # the choice must be made at one token
            raise ValueError("two cities share a first token")
        head = spelled(ids('\n{"name": "get_weather", "arguments": {"city": "'))
        tail = spelled(ids('"}}\n'))
        choice = " | ".join(f"({spelled(city)})" for city in cities)
        lark = (
            f"start: <[{vocab['<tool_call>']}]> {head} ({choice}) {tail} "
            f"<[{vocab['</tool_call>']}]>\n"
        )
        return cls(lark, firsts)

    def allowed(self, token_ids: list[int], loss_mask: list[int]) -> list[list[int] | None]:
        """Per token of an exported row: the ids the grammar allowed where the first turn
        (the constrained one) sampled, None elsewhere."""
        out: list[list[int] | None] = [None] * len(token_ids)
        start = loss_mask.index(1) if 1 in loss_mask else len(loss_mask)
        i = start
        while i < len(loss_mask) and loss_mask[i] == 1:
            token = token_ids[i]
            if token in self.city_first_ids:
                out[i] = list(self.city_first_ids)
            elif token in EOS_IDS and (i + 1 == len(loss_mask) or loss_mask[i + 1] == 0):
                out[i] = list(EOS_IDS)
            else:
                out[i] = [token]
            i += 1
        return out


@dataclass
class Rollout:
    session_id: str
    reward: float | None
    status: str
    city: str | None


def run_rollout(
    base_url: str, model: str, grammar: Grammar, group: str, size: int, step: int
) -> Rollout:
    """One agent episode through a session URL with the unmodified OpenAI SDK."""
    import openai

    from tokenkeep import Client

    with Client(base_url) as tk:
        session = tk.create_session(
            group=group, group_size=size, sampling=SAMPLING, metadata={"step": step}
        )
        client = openai.OpenAI(
            base_url=session.openai_base_url, api_key=session.api_key, max_retries=0
        )
        messages = [dict(m) for m in MESSAGES]
        city: str | None = None
        try:
            call = client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=48,
                # constrained from the first token (no reasoning block before the call)
                extra_body={
                    "structured_outputs": {"grammar": grammar.lark},
                    "reasoning_ended": True,
                },
            )
            message = call.choices[0].message
            calls = message.tool_calls or []
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [c.model_dump() for c in calls],
                }
            )
            for tool_call in calls:
                asked = json.loads(tool_call.function.arguments).get("city", "")
                city = city or asked
                result = weather(asked)
                messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result})
            client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
                max_tokens=12,
            )
        except openai.APIError as error:
            tk.finish(session.id, status="model_error", metadata={"error": str(error)[:200]})
            return Rollout(session.id, None, "model_error", city)
        reward = 1.0 if city == TARGET else 0.0
        tk.finish(session.id, reward=reward, metadata={"city": city})
        return Rollout(session.id, reward, "ok", city)


class Learner:
    """The GRPO learner as a child process in the engine's environment (JSON lines)."""

    def __init__(self, model_dir: Path, work_dir: Path, lr: float, seed: int) -> None:
        self.model_dir = model_dir
        self.log_path = work_dir / "learner.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (closed in close())
        self.process = subprocess.Popen(
            [
                str(localengine.venv_python()),
                "-P",
                str(Path(grpo.__file__).resolve()),
                "--model-dir",
                str(model_dir),
                "--work-dir",
                str(work_dir),
                "--lr",
                str(lr),
                "--seed",
                str(seed),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**localengine._engine_env(1, 1), "TRANSFORMERS_VERBOSITY": "error"},
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.process.wait()
            raise localengine.LocalEngineError(
                f"the learner exited ({self.process.returncode}); see {self.log_path}:\n"
                + localengine._tail(self.log_path)
            )
        return dict(json.loads(line))

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class Engine:
    """The probe's reader: prompt logprobs straight from the running vLLM (weights are
    published through the session server's `POST /policy`, not here)."""

    def __init__(self, url: str, served_model_name: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=300)
        self.model = served_model_name

    def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        response = self.http.post(path, **kwargs)
        response.raise_for_status()
        return response

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        body = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 0.0,
        }
        choice = self._post("/v1/completions", json=body).json()["choices"][0]
        out = []
        for token, entry in zip(token_ids[1:], choice["prompt_logprobs"][1:], strict=True):
            out.append(float(entry[str(token)]["logprob"]))
        return out

    def close(self) -> None:
        self.http.close()


# How far the engine's probe logprobs may be from the learner's on the bf16 weights it
# published: bf16 against fp32 arithmetic stays well under it (0.003-0.006 measured over 12
# steps); a reload that missed the tied output layer is 0.2-0.9 nats off.
PROBE_GAP_LIMIT = 0.02


def probe_verdict(gap: float) -> str:
    if gap <= PROBE_GAP_LIMIT:
        return f"engine = learner (<= {PROBE_GAP_LIMIT})"
    return f"ENGINE != LEARNER (> {PROBE_GAP_LIMIT}: the engine does not serve what was published)"


def token_versions(row: Any) -> list[str | None]:
    """The weight version of each token of an exported row (None on context)."""
    versions: list[str | None] = [None] * len(row.token_ids)
    for span in row.weight_versions:
        versions[span.start : span.end] = [span.version] * (span.end - span.start)
    return versions


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def train(
    base_url: str,
    engine: Engine,
    learner: Learner,
    grammar: Grammar,
    *,
    steps: int,
    group_size: int,
    asynchronous: bool,
    trajectory_dir: Path | None,
    emit: Any,
) -> dict[str, Any]:
    from tokenkeep import Client

    run = uuid.uuid4().hex[:8]
    version = 0
    tk = Client(base_url)
    # Version 0 is the base model, published like every later step (`force`: a shared
    # engine and store may have served a run before).
    tk.publish_policy(version, path=str(learner.model_dir), pause="wait", force=True)
    pool = ThreadPoolExecutor(max_workers=group_size)

    def start(step: int) -> list[Future[Rollout]]:
        group = f"train-{run}-{step}"
        return [
            pool.submit(run_rollout, base_url, engine.model, grammar, group, group_size, step)
            for _ in range(group_size)
        ]

    curve: list[dict[str, Any]] = []
    probe: list[int] | None = None
    started = time.monotonic()
    pending = start(0)
    http = httpx.Client(base_url=base_url, timeout=120)
    try:
        for step in range(steps):
            step_started = time.monotonic()
            rollouts = [f.result() for f in pending]
            group = f"train-{run}-{step}"
            rows = list(tk.export(group=group, failed_members="drop"))
            if probe is None:
                probe = rows[0].token_ids[:160]
            payload = [
                {
                    "token_ids": row.token_ids,
                    "loss_mask": row.loss_mask,
                    "logprobs": row.logprobs,
                    "reward": row.reward,
                    "group": row.group,
                    "versions": token_versions(row),
                    "allowed": grammar.allowed(row.token_ids, row.loss_mask),
                }
                for row in rows
            ]
            command = {"op": "step", "rows": payload, "version": str(version)}
            stepped = learner.call({**command, "next_version": version + 1})
            learner_logprobs = learner.call({"op": "logprobs", "token_ids": probe})["logprobs"]
            if asynchronous and step + 1 < steps:
                # The next rollouts start now: turns in flight when the weights are swapped
                # finish on the old version, their next turns run on the new one.
                pending = start(step + 1)
            before = engine.prompt_logprobs(probe)
            version += 1
            # Through tokenkeep, as a trainer publishes: in-flight turns finish on the old
            # weights first (pause "wait"), every replica reloads in place.
            published = tk.publish_policy(version, path=stepped["weights"], pause="wait")
            after = engine.prompt_logprobs(probe)
            if not asynchronous and step + 1 < steps:
                pending = start(step + 1)
            sampled_by = sorted({v for row in rows for v in row.versions}, key=int)
            line = {
                "step": step,
                "mean_reward": sum(r.reward or 0.0 for r in rollouts) / len(rollouts),
                "weight_version": sampled_by[-1] if sampled_by else None,
                "rollouts": len(rollouts),
                "tokens": sum(len(row.token_ids) for row in rows),
                "sampled_tokens": stepped["sampled_tokens"],
                "failed": sum(r.status != "ok" for r in rollouts),
                "mixed_version_rollouts": sum(row.mixed_versions for row in rows),
                "versions": sampled_by,
                "new_version": str(version),
                "loss": round(stepped["loss"], 6),
                "logprob_gap_current": stepped["logprob_gap_current"],
                "tokens_current": stepped["tokens_current"],
                "probe_gap": round(_gap(after, learner_logprobs), 5),
                "probe_shift": round(_gap(before, learner_logprobs), 5),
                "engine_matches_learner": _gap(after, learner_logprobs) <= PROBE_GAP_LIMIT,
                "train_seconds": stepped["train_seconds"],
                "publish_seconds": max(r.seconds or 0.0 for r in published.replicas),
                "pause_seconds": published.pause_seconds,
                "seconds": round(time.monotonic() - step_started, 2),
            }
            curve.append(line)
            emit(line)
            if trajectory_dir is not None:
                trajectory_dir.mkdir(parents=True, exist_ok=True)
                for r in rollouts:
                    data = http.get(f"/sessions/{r.session_id}/trajectory").json()
                    data.update(step=step, reward=r.reward, status=r.status, city=r.city)
                    (trajectory_dir / f"step{step:03d}-{r.session_id}.json").write_text(
                        json.dumps(data)
                    )
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)
        tk.close()
        http.close()
    head = curve[: max(1, len(curve) // 4)]
    tail = curve[-max(1, len(curve) // 4) :]
    return {
        "steps": len(curve),
        "group_size": group_size,
        "asynchronous": asynchronous,
        "task": f"call get_weather with the city the user named ({TARGET}) among {len(CITIES)}",
        "chance_reward": round(1 / len(CITIES), 4),
        "first_quarter_mean_reward": round(sum(x["mean_reward"] for x in head) / len(head), 4),
        "last_quarter_mean_reward": round(sum(x["mean_reward"] for x in tail) / len(tail), 4),
        "final_version": str(version),
        "mixed_version_rollouts": sum(x["mixed_version_rollouts"] for x in curve),
        "max_probe_gap": max(x["probe_gap"] for x in curve),
        "engine_matches_learner": all(x["engine_matches_learner"] for x in curve),
        "min_probe_shift": min(x["probe_shift"] for x in curve),
        "seconds_per_step": round((time.monotonic() - started) / max(1, len(curve)), 2),
        "seconds": round(time.monotonic() - started, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (--train)")
    group.add_argument("--train", action="store_true", help="run the GRPO loop (see docs)")
    group.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    group.add_argument("--group-size", type=int, default=8, help="rollouts per step (8)")
    group.add_argument("--json", action="store_true", help="one JSON object per step")
    group.add_argument("--trajectory-dir", type=Path, help="write each rollout's trajectory")
    group.add_argument("--lr", type=float, default=DEFAULT_LR, help="Adam learning rate")
    group.add_argument(
        "--sync", action="store_true", help="wait for each update before the next rollouts"
    )
    group.add_argument(
        "--engine-url",
        help="a running vLLM serving the tiny model (--train: a dev-mode one, whose weights "
        "are restored at the end); default: start one",
    )


def main(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.group_size < 2:
        print("error: --steps >= 1 and --group-size >= 2", file=sys.stderr)
        return 2
    model_dir = localengine.model_dir()

    def emit(line: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(line), flush=True)
        else:
            print(
                f"step {line['step']:3d}  reward {line['mean_reward']:.3f}  "
                f"versions {','.join(line['versions'])} -> {line['new_version']}  "
                f"mixed {line['mixed_version_rollouts']}  probe gap {line['probe_gap']:.4f}: "
                f"{probe_verdict(line['probe_gap'])} "
                f"(was {line['probe_shift']:.4f})  {line['seconds']:.1f}s",
                flush=True,
            )

    owned: localengine.LocalEngine | None = None
    try:
        if args.engine_url:
            url, served = args.engine_url, localengine.served_name(localengine.TINY_MODEL_NAME)
        else:
            progress("[train] starting vLLM (dev mode: weight reloads and versions)")
            # One engine thread: the learner takes the other core.
            owned = localengine.start(dev_mode=True, threads=1, progress=progress)
            url, served, model_dir = owned.url, owned.served_model_name, owned.model_dir
        engine = Engine(url, served)
        with tempfile.TemporaryDirectory(prefix="tokenkeep-train-") as work:
            learner = Learner(model_dir, Path(work), args.lr, args.seed or 0)
            try:
                with local_server(url, served, model_dir, args.redis_url, args.port) as base:
                    progress(f"[train] session server {base} -> vLLM {url}")
                    summary = train(
                        base,
                        engine,
                        learner,
                        Grammar.for_model(model_dir),
                        steps=args.steps,
                        group_size=args.group_size,
                        asynchronous=not args.sync,
                        trajectory_dir=args.trajectory_dir,
                        emit=emit,
                    )
                    if owned is None:  # a shared engine gets its original weights back
                        from tokenkeep import Client

                        with Client(base) as tk:
                            tk.publish_policy(0, path=str(model_dir), force=True)
            finally:
                learner.close()
        engine.close()
    except localengine.LocalEngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if owned is not None:
            owned.stop()
    print(json.dumps({"summary": summary}) if args.json else _report(summary), flush=True)
    return 0


def _report(summary: dict[str, Any]) -> str:
    return "\n".join(
        [
            "",
            f"task         {summary['task']}",
            f"reward       {summary['first_quarter_mean_reward']:.3f} (first quarter) -> "
            f"{summary['last_quarter_mean_reward']:.3f} (last quarter); chance "
            f"{summary['chance_reward']:.3f}",
            f"versions     0 -> {summary['final_version']} (engine never restarted); "
            f"{counted(summary['mixed_version_rollouts'], 'rollout')} spanned an update",
            f"engine check probe logprob gap after every publish <= "
            f"{summary['max_probe_gap']:.4f}: {probe_verdict(summary['max_probe_gap'])}",
            f"took         {summary['seconds']:.0f}s ({summary['seconds_per_step']:.1f}s/step)",
        ]
    )
