"""N concurrent rollouts through tokenkeep, then one GRPO step's inputs as NumPy arrays.

Each rollout is an ordinary OpenAI SDK agent loop (the "harness": it knows nothing about
tokenkeep, it only gets a session's base URL). The driver creates one session per rollout,
finishes it with a reward, and exports the finished group as padded arrays: token ids, loss
mask, the rollout policy's logprobs, rewards -> group-normalised advantages, the per-token
weights of the policy-gradient loss. No training framework is needed to run it; a trainer
would feed these arrays to its forward pass.

    tokenkeep serve --engine-url http://127.0.0.1:8001 --tokenizer Qwen/Qwen3-8B &
    python examples/grpo_rollouts.py --url http://127.0.0.1:8000 --group-size 8
"""

from __future__ import annotations

import argparse
import asyncio
import re
import uuid

import numpy as np
import openai

from tokenkeep import AsyncClient, Batch

QUESTIONS = {"What is 6 times 7?": "42", "What is 19 plus 23?": "42", "What is 3 cubed?": "27"}


async def harness(base_url: str, api_key: str, question: str, turns: int) -> str:
    """An unmodified agent loop: ask, then ask it to check itself, `turns` times."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    async with client:
        messages: list[dict[str, str]] = [{"role": "user", "content": question}]
        answer = ""
        for _ in range(turns):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=64
            )
            answer = reply.choices[0].message.content or ""
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Check that and give only the number."},
            ]
        return answer


def reward(answer: str, expected: str) -> float:
    numbers = re.findall(r"-?\d+", answer)
    return 1.0 if numbers and numbers[-1] == expected else 0.0


async def rollout(
    tk: AsyncClient, run: str, question: str, expected: str, turns: int, temperature: float
) -> str:
    session = await tk.create_session(
        sampling={"temperature": temperature}, metadata={"run": run, "group": question}
    )
    answer = await harness(session.openai_base_url, session.api_key, question, turns)
    await tk.finish(session.id, reward=reward(answer, expected), metadata={"answer": answer})
    return session.id


def grpo_inputs(batch: Batch) -> dict[str, np.ndarray]:
    """Group-normalised advantages (GRPO) spread over each row's sampled tokens.

    A row is one segment of one rollout; rows of one question form a group. The loss a
    trainer minimises is -mean(weights * ratio), ratio = exp(new_logprobs - logprobs)
    (clipped), with `new_logprobs` from its own forward pass over `token_ids`."""
    groups = [m["group"] for m in batch.metadata]
    advantages = np.zeros(len(groups), dtype=np.float32)
    for group in set(groups):
        rows = np.array([g == group for g in groups])
        rewards = np.nan_to_num(batch.rewards[rows])
        advantages[rows] = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    weights = advantages[:, None] * batch.loss_mask
    return {
        "token_ids": batch.token_ids,
        "attention_mask": batch.attention_mask,
        "loss_mask": batch.loss_mask,
        "old_logprobs": np.nan_to_num(batch.logprobs),
        "advantages": advantages,
        "token_weights": weights.astype(np.float32),
    }


async def main(argv: list[str] | None = None) -> dict[str, np.ndarray]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the session server")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per question")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--keep", action="store_true", help="do not delete the sessions")
    args = parser.parse_args(argv)
    run = uuid.uuid4().hex[:12]
    async with AsyncClient(args.url) as tk:
        session_ids = await asyncio.gather(
            *(
                rollout(tk, run, question, expected, args.turns, args.temperature)
                for question, expected in QUESTIONS.items()
                for _ in range(args.group_size)
            )
        )
        batch = await tk.export_batch(selector=f"run={run}", limit=len(session_ids))
        if not args.keep:
            await asyncio.gather(*(tk.delete(s) for s in session_ids))
    inputs = grpo_inputs(batch)
    print(
        f"{len(session_ids)} rollouts -> {batch.token_ids.shape[0]} rows x "
        f"{batch.token_ids.shape[1]} tokens; sampled tokens {int(batch.loss_mask.sum())}; "
        f"mean reward {np.nanmean(batch.rewards):.2f}"
    )
    return inputs


if __name__ == "__main__":
    asyncio.run(main())
