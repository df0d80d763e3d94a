"""mini-swe-agent's default agent (its built-in `mini.yaml`: tool calling through LiteLLM)
on a task in a local directory, against a session URL. Run inside the LiteLLM virtualenv
(see test_litellm.py). Prints the agent's exit status and submission as JSON.

    python mini_swe_agent_driver.py BASE_URL WORKDIR TASK
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import minisweagent
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

if __name__ == "__main__":
    base_url, workdir, task = sys.argv[1:4]
    config_path = Path(minisweagent.__file__).parent / "config" / "mini.yaml"
    config = yaml.safe_load(config_path.read_text())
    model_config = config["model"]
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}), "api_base": base_url, "api_key": "tk",
    }  # fmt: skip
    model = LitellmModel(model_name="openai/tiny", cost_tracking="ignore_errors", **model_config)
    env = LocalEnvironment(cwd=workdir, **config.get("environment", {}))
    agent = DefaultAgent(model, env, **config["agent"])
    result = agent.run(task)
    print(json.dumps({"exit_status": result.get("exit_status"),
                      "submission": result.get("submission")}))  # fmt: skip
