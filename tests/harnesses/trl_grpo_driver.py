"""Run in TRL's own virtualenv: one real `GRPOTrainer` step (trl 1.16.0, CPU) whose
`rollout_func` exports the given finished sessions from a live tokenkeep and hands
`tokenkeep.integrations.trl.rollout_output` back to TRL. Prints one JSON line: the adapter's
output, the tensors TRL built from it for the loss, the rewards TRL's reward function saw, the
step's loss and whether the weights moved.

The policy is a 2-layer random-weights Qwen3 (the real Qwen3 vocabulary and tokenizer): the
step checks TRL's data path, not what it learns.

    trl_grpo_driver.py SERVER_URL TOKENIZER_DIR SESSION_ID...
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tokenkeep, from this checkout
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from tokenkeep import Client
from tokenkeep.integrations.trl import rollout_output, tokenkeep_reward


def main() -> None:
    url, tokenizer_dir, *sessions = sys.argv[1:]
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        )
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    seen: dict[str, Any] = {}

    def rollout_func(prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        # The rollouts already ran through session URLs; a trainer would run them here.
        with Client(url) as tk:
            seen["adapter"] = rollout_output(tk.export(session_ids=sessions))
        return seen["adapter"]

    def reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
        seen["rewards"] = tokenkeep_reward(completions, **kwargs)
        return seen["rewards"]

    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=len(sessions),
            num_generations=len(sessions), max_steps=1, learning_rate=1e-2, use_cpu=True,
            bf16=False, report_to="none", logging_steps=1, save_strategy="no", beta=0.0,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward, args=config, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": ["What is the weather?"] * 4}),
            rollout_func=rollout_func,
        )  # fmt: skip
        generate = trainer._generate_and_score_completions

        def recorded(inputs: Any) -> Any:
            built = generate(inputs)
            seen["built"] = built
            return built

        trainer._generate_and_score_completions = recorded
        trainer.train()

    built = seen["built"]

    def unpadded(key: str, mask: str) -> list[list[Any]]:
        rows = zip(built[key], built[mask].bool(), strict=True)
        return [values[kept].tolist() for values, kept in rows]

    consumed = {
        "prompt_ids": unpadded("prompt_ids", "prompt_mask"),
        "completion_ids": unpadded("completion_ids", "completion_mask"),
        "logprobs": unpadded("sampling_per_token_logps", "completion_mask"),
        "env_mask": unpadded("tool_mask", "completion_mask"),
        "advantages": built["advantages"].tolist(),
    }
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    adapter = seen["adapter"]
    print(json.dumps({"adapter": adapter, "consumed": consumed, "rewards": seen["rewards"],
                      "losses": losses, "weights_moved": moved}))  # fmt: skip


if __name__ == "__main__":
    main()
