"""The GRPO learner of `tokenkeep demo --train`: a policy-gradient step with torch on the
same weights vLLM serves, from tokenkeep's exported arrays.

It runs inside the engine virtualenv (vLLM's CPU torch 2.13 and transformers are there; a
second torch in tokenkeep's own environment would be a ~200 MB install for one demo), as a
child process that answers one JSON line per JSON line on stdin:

    {"op": "logprobs", "token_ids": [...]}            -> {"logprobs": [...]}
    {"op": "step", "rows": [...], "version": "3"}      -> {"loss", ..., "weights": DIR}

A row is one exported segment: `token_ids`, `loss_mask` (1 = sampled), `logprobs` (the
rollout's, null on context), `reward`, `group`, `versions` (the weight version of each
token, null on context), `allowed` (per token: null where the engine sampled from the whole
vocabulary, else the token ids a structured-output grammar allowed there). vLLM applies the
grammar's mask before it computes logprobs, so a constrained token's rollout logprob is
under the masked softmax; the learner computes the same distribution (a forced token,
one id allowed, has probability 1 and no gradient).

The loss is GRPO's clipped importance-weighted objective: the
advantage is the reward standardised within its group, the ratio is against the rollout's
own logprobs (so tokens sampled by an older version, in an asynchronous step, are weighted
for what they are). New weights are written as a safetensors checkpoint that vLLM reloads
in place (`POST /collective_rpc` `reload_weights`).

Only the standard library is imported at the top: tokenkeep's environment imports this
module for its path, the engine environment runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CLIP_EPSILON = 0.2


def _learner(model_dir: Path, lr: float, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    # One thread: this model is tiny, and OpenMP threads spin-waiting for cores the engine
    # holds made a step ~50x slower on 2 busy cores (measured).
    torch.set_num_threads(1)
    # fp32 master weights (Adam on bf16 loses small updates); vLLM gets a bf16 copy.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    return model, optimizer


def _token_logprobs(
    model: Any, token_ids: list[int], positions: Any, allowed: list[list[int] | None] | None = None
) -> Any:
    """log p(token[i+1] | tokens[:i+1]) at `positions` (indices into token_ids[1:]), under
    the grammar's mask where `allowed[j]` (for positions[j]) names the allowed ids; the
    output layer runs only there (151k logits per position is the whole cost)."""
    import torch

    ids = torch.tensor([token_ids], dtype=torch.long)
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
    logits = model.lm_head(hidden[positions]).float()
    if allowed is not None and any(a is not None for a in allowed):
        mask = torch.zeros_like(logits)
        for j, ids_allowed in enumerate(allowed):
            if ids_allowed is not None:
                mask[j] = float("-inf")
                mask[j, ids_allowed] = 0.0
        logits = logits + mask
    targets = ids[0, 1:][positions]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def _advantages(rows: list[dict[str, Any]]) -> list[float]:
    by_group: dict[str, list[float]] = {}
    for row in rows:
        by_group.setdefault(str(row["group"]), []).append(float(row["reward"]))
    out = []
    for row in rows:
        rewards = by_group[str(row["group"])]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        out.append((float(row["reward"]) - mean) / (std + 1e-4))
    return out


def _step(model: Any, optimizer: Any, rows: list[dict[str, Any]], version: str) -> dict[str, Any]:
    import torch

    started = time.monotonic()
    advantages = _advantages(rows)
    optimizer.zero_grad()
    loss_total, clipped, sampled = 0.0, 0, 0
    gaps_current: list[float] = []
    gaps_older: list[float] = []
    for row, advantage in zip(rows, advantages, strict=True):
        allowed_at = row["allowed"][1:]
        # Sampled tokens that were a choice (a forced token has probability 1: no gradient).
        chosen = [
            i
            for i, m in enumerate(row["loss_mask"][1:])
            if m and (allowed_at[i] is None or len(allowed_at[i]) > 1)
        ]
        if not chosen:
            continue
        positions = torch.tensor(chosen, dtype=torch.long)
        rollout = torch.tensor([row["logprobs"][1:][i] for i in chosen], dtype=torch.float32)
        logprobs = _token_logprobs(
            model, row["token_ids"], positions, [allowed_at[i] for i in chosen]
        )
        ratio = torch.exp(logprobs - rollout)
        objective = torch.minimum(
            ratio * advantage, ratio.clamp(1 - CLIP_EPSILON, 1 + CLIP_EPSILON) * advantage
        )
        # Each row counts once, whatever its length (GRPO's per-sequence mean).
        loss = -objective.mean() / len(rows)
        loss.backward()
        loss_total += float(loss)
        clipped += int(((ratio - 1).abs() > CLIP_EPSILON).sum())
        sampled += positions.numel()
        gap = (logprobs.detach() - rollout).abs().tolist()
        token_versions = [row["versions"][1:][i] for i in chosen]
        for value, token_version in zip(gap, token_versions, strict=True):
            (gaps_current if token_version == version else gaps_older).append(value)
    optimizer.step()
    return {
        "loss": loss_total,
        "sampled_tokens": sampled,
        "clipped_tokens": clipped,
        # The engine's logprob vs the learner's, on tokens the learner's current weights
        # sampled: small only if vLLM really serves these weights (lm_head included).
        "logprob_gap_current": max(gaps_current, default=None),
        "tokens_current": len(gaps_current),
        "logprob_gap_older": max(gaps_older, default=None),
        "tokens_older": len(gaps_older),
        "train_seconds": round(time.monotonic() - started, 3),
    }


@contextlib.contextmanager
def _published_weights(model: Any) -> Iterator[None]:
    """The model on the bf16 weights `_save` publishes, for the probe: against the fp32
    master weights the engine's logprobs differ by whatever bf16 rounding does to this
    step's weights, 0.01 nats one step and 0.26 the next (the intermittent "probe gap" of
    issue 32; a reload checked against a fresh engine is bit-for-bit exact)."""
    import torch

    masters = [p.data for p in model.parameters()]
    try:
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).to(torch.float32)
        yield
    finally:
        for p, master in zip(model.parameters(), masters, strict=True):
            p.data = master


def _save(model: Any, model_dir: Path, out_dir: Path) -> None:
    """A checkpoint vLLM's loader reads: the bf16 weights (the tied output layer is the
    embedding, stored once, as transformers does) and the model's config."""
    import torch
    from safetensors.torch import save_file

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(model_dir / "config.json", tmp / "config.json")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def serve(model_dir: Path, work_dir: Path, lr: float, seed: int) -> None:
    import torch

    model, optimizer = _learner(model_dir, lr, seed)
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command["op"] == "logprobs":
            ids = command["token_ids"]
            with torch.no_grad(), _published_weights(model):
                values = _token_logprobs(model, ids, torch.arange(len(ids) - 1))
            reply: dict[str, Any] = {"logprobs": values.tolist()}
        elif command["op"] == "step":
            reply = _step(model, optimizer, command["rows"], str(command["version"]))
            out_dir = work_dir / f"weights-{command['next_version']}"
            started = time.monotonic()
            _save(model, model_dir, out_dir)
            reply.update(weights=str(out_dir), save_seconds=round(time.monotonic() - started, 3))
        else:
            reply = {"error": f"unknown op {command['op']!r}"}
        print(json.dumps(reply), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    serve(args.model_dir, args.work_dir, args.lr, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
