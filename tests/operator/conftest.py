"""Shared helpers of the operator tests: rendering the examples the way the operator does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tokenkeep_operator.manifests.common import Owner
from tokenkeep_operator.models import API_VERSION

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
TEST_NAMESPACE = "rl"


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def owner_of(resource: dict[str, Any], uid: str = "1b4e28ba-2fa1-11d2-883f-0016d3cca427") -> Owner:
    return Owner(
        api_version=API_VERSION,
        kind=resource["kind"],
        name=resource["metadata"]["name"],
        namespace=TEST_NAMESPACE,
        uid=uid,
        generation=1,
    )
