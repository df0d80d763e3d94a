"""Loading the served model's tokenizer (with its chat template) from a path or an id."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path_or_id: str) -> Any:
    if not path_or_id:
        raise ValueError("--tokenizer is required (a local directory or a Hugging Face id)")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path_or_id)
