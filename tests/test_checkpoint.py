"""The checkpoint format round-trips training state and refuses incomplete or corrupted checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raytrain_tasks.checkpoint import (
    MANIFEST_FILE,
    MODEL_FILE,
    ModelSpec,
    TrainingState,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from raytrain_tasks.errors import CheckpointError
from raytrain_tasks.models import build_model

SPEC = ModelSpec(model="mlp", in_features=8, num_classes=3, hidden_sizes=(16,), class_labels=("a", "b", "c"))


def _write(directory: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model("mlp", 8, 3, [16])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    state = TrainingState(epoch=4, metrics={"val_accuracy": 0.5}, spec=SPEC, history=[{"epoch": 4.0}])
    save_checkpoint(
        directory,
        state=state,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        rng_state=capture_rng_state(),
    )
    return model, optimizer


def test_round_trip_restores_model_optimizer_and_rng(tmp_path: Path) -> None:
    model, optimizer = _write(tmp_path)
    expected_draw = torch.rand(3)  # the draw that follows the saved RNG state

    loaded = load_checkpoint(tmp_path)
    assert loaded.state.epoch == 4 and loaded.state.spec == SPEC
    fresh = build_model("mlp", 8, 3, [16])
    fresh.load_state_dict(loaded.model_state)
    x = torch.randn(5, 8)
    assert torch.equal(fresh(x), model(x))
    assert loaded.optimizer_state is not None
    assert loaded.optimizer_state["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert loaded.rng_state is not None
    restore_rng_state(loaded.rng_state)
    assert torch.equal(torch.rand(3), expected_draw)


def test_truncated_file_is_detected(tmp_path: Path) -> None:
    _write(tmp_path)
    data = (tmp_path / MODEL_FILE).read_bytes()
    (tmp_path / MODEL_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"corrupted: {MODEL_FILE} has"):
        load_checkpoint(tmp_path)


def test_same_size_corruption_is_detected(tmp_path: Path) -> None:
    _write(tmp_path)
    data = bytearray((tmp_path / MODEL_FILE).read_bytes())
    data[-10] ^= 0xFF
    (tmp_path / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(tmp_path)


def test_missing_manifest_means_incomplete(tmp_path: Path) -> None:
    _write(tmp_path)
    (tmp_path / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(tmp_path)


def test_missing_listed_file_means_incomplete(tmp_path: Path) -> None:
    _write(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST_FILE).read_text())
    assert MODEL_FILE in manifest["files"]
    (tmp_path / MODEL_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"{MODEL_FILE} is missing"):
        load_checkpoint(tmp_path)
