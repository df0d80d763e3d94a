"""Checkpoints a trainer would write: the tiny model's weights perturbed by the engine's own
torch (tokenkeep's environment has none), saved as safetensors with the model's config and
tokenizer files. Used by the policy-publishing tests and bench/bench_publish.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

from session_server.devtools import localengine

PERTURB = """
import shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
src, out, seed = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
out.mkdir(parents=True)
for f in src.iterdir():
    if f.is_file() and f.suffix != ".safetensors":
        shutil.copy(f, out / f.name)
g = torch.Generator().manual_seed(seed)
for f in src.glob("*.safetensors"):
    tensors = load_file(str(f))
    moved = {
        k: (v.float() + 0.5 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype)
        for k, v in tensors.items()
    }
    save_file(moved, str(out / f.name), metadata={"format": "pt"})
"""


def perturbed(model_dir: Path, out: Path, seed: int) -> Path:
    python = localengine.install(lambda _line: None)
    subprocess.run([str(python), "-c", PERTURB, str(model_dir), str(out), str(seed)], check=True)
    return out
