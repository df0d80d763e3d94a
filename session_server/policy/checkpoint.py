"""A checkpoint is checked before any engine is touched: vLLM's in-place reload of a
checkpoint that does not fit the served model answers 500 with layers half loaded, and the
engine then dies on its next request (measured on vLLM 0.32's CPU build). Only headers are
read (safetensors keeps a JSON header in front of the tensors): milliseconds, not a load."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

# The config fields that fix every weight's shape; a checkpoint that changes any of them
# cannot be loaded into a running engine.
SHAPE_FIELDS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
)
# A safetensors header above this is not one (the format's own readers cap it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """The checkpoint cannot be published; `status`: 400 (unreadable) or 422 (does not fit)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Layout:
    config: dict[str, object]
    tensors: dict[str, tuple[int, ...]]
    """Tensor name -> shape, over every *.safetensors file of the folder."""


def _header(path: Path) -> dict[str, object]:
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(422, f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(422, f"{path} is not a safetensors file (header length)")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        raise CheckpointError(422, f"{path} is not a safetensors file (header)") from None
    if not isinstance(header, dict):
        raise CheckpointError(422, f"{path} is not a safetensors file (header)")
    return header


def read_layout(folder: str | Path) -> Layout:
    """The config and tensor shapes of a Hugging Face checkpoint folder."""
    root = Path(folder)
    if not root.is_absolute():
        raise CheckpointError(400, f"checkpoint path {folder!r} must be absolute")
    if not root.is_dir():
        raise CheckpointError(400, f"checkpoint folder {folder} does not exist here")
    try:
        config = json.loads((root / "config.json").read_text())
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(400, f"checkpoint folder {folder} has no *.safetensors")
        tensors: dict[str, tuple[int, ...]] = {}
        for file in files:
            for name, entry in _header(file).items():
                if name != "__metadata__" and isinstance(entry, dict):
                    tensors[name] = tuple(int(n) for n in entry.get("shape", ()))
    except FileNotFoundError:
        raise CheckpointError(400, f"checkpoint folder {folder} has no config.json") from None
    except PermissionError as exc:
        raise CheckpointError(400, f"checkpoint folder {folder} is not readable: {exc}") from None
    except ValueError as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(422, f"{folder}/config.json is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(422, f"{folder}/config.json is not a JSON object")
    return Layout(config, tensors)


def check_fits(candidate: Layout, served: Layout) -> None:
    """Raise CheckpointError (422) unless `candidate` loads into the model `served` has: the
    same shape-fixing config fields, every tensor the served model has, each of the same
    shape (dtypes may differ: the engine casts on load)."""
    for name in SHAPE_FIELDS:
        if candidate.config.get(name) != served.config.get(name):
            raise CheckpointError(
                422,
                f"checkpoint config {name} is {candidate.config.get(name)!r}, the served model's "
                f"is {served.config.get(name)!r}",
            )
    missing = sorted(set(served.tensors) - set(candidate.tensors))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(422, f"checkpoint lacks {', '.join(missing[:3])}{more}")
    for name, shape in served.tensors.items():
        if candidate.tensors[name] != shape:
            raise CheckpointError(
                422,
                f"checkpoint tensor {name} has shape {list(candidate.tensors[name])}, "
                f"the served model's has {list(shape)}",
            )
