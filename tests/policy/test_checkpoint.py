"""A checkpoint is checked against the served model before any engine is touched (vLLM's
in-place reload of one that does not fit leaves the engine half loaded, then dead)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from session_server.policy.checkpoint import CheckpointError, check_fits, read_layout

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "vocab_size": 1000}
TENSORS = {"model.embed_tokens.weight": [1000, 64], "model.norm.weight": [64]}


def write_checkpoint(
    folder: Path, config: dict[str, object], tensors: dict[str, list[int]]
) -> Path:
    """A real safetensors header (what every reader parses first) over zero-filled data."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors.items():
        size = 2
        for n in shape:
            size *= n
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return folder


def test_a_checkpoint_of_the_same_model_fits(tmp_path: Path) -> None:
    served = read_layout(write_checkpoint(tmp_path / "served", CONFIG, TENSORS))
    candidate = read_layout(write_checkpoint(tmp_path / "step-1", CONFIG, TENSORS))
    assert candidate.tensors == {k: tuple(v) for k, v in TENSORS.items()}
    check_fits(candidate, served)


@pytest.mark.parametrize(
    ("config", "tensors", "said"),
    [
        ({**CONFIG, "hidden_size": 32}, TENSORS, "config hidden_size is 32"),
        (CONFIG, {"model.norm.weight": [64]}, "lacks model.embed_tokens.weight"),
        (
            CONFIG,
            {**TENSORS, "model.norm.weight": [65]},
            "model.norm.weight has shape [65], the served model's has [64]",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_422_naming_the_difference(
    tmp_path: Path, config: dict[str, object], tensors: dict[str, list[int]], said: str
) -> None:
    served = read_layout(write_checkpoint(tmp_path / "served", CONFIG, TENSORS))
    candidate = read_layout(write_checkpoint(tmp_path / "other", config, tensors))
    with pytest.raises(CheckpointError) as caught:
        check_fits(candidate, served)
    assert caught.value.status == 422 and said in caught.value.message


def test_unreadable_folders_are_400_and_bad_files_422(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as missing:
        read_layout(tmp_path / "nowhere")
    assert missing.value.status == 400 and "does not exist" in missing.value.message
    with pytest.raises(CheckpointError) as relative:
        read_layout("relative/dir")
    assert relative.value.status == 400 and "absolute" in relative.value.message
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as no_weights:
        read_layout(empty)
    assert no_weights.value.status == 400 and "no *.safetensors" in no_weights.value.message
    (empty / "model.safetensors").write_bytes(struct.pack("<Q", 10**12))
    with pytest.raises(CheckpointError) as garbage:
        read_layout(empty)
    assert garbage.value.status == 422
