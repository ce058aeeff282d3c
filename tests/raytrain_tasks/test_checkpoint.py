"""The checkpoint format round-trips training state and refuses incomplete or corrupted checkpoints."""

from __future__ import annotations

import json
import os
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


KEY = "20261124-110000-abc123"


def test_a_staging_folder_left_by_a_killed_attempt_is_replaced_by_the_runs_next_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raytrain_tasks.checkpoint import STAGING_PREFIX, staging_folder

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    left = tmp_path / f"{STAGING_PREFIX}{os.getuid()}" / KEY
    left.parent.mkdir(mode=0o700)  # as the first checkpoint on this node made it
    left.mkdir()
    (left / "model.pt").write_bytes(b"half-written by a worker that was killed")
    with staging_folder(KEY) as folder:
        assert folder == left and list(folder.iterdir()) == []  # nothing stale goes into the new checkpoint
        (folder / "model.pt").write_bytes(b"x")
    assert not left.exists()
    assert not list(tmp_path.glob("prt-ckpt-*"))


@pytest.mark.parametrize("unsafe", ["a link", "open to others"])
def test_a_staging_parent_that_is_not_this_users_own_is_never_used_or_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unsafe: str
) -> None:
    from raytrain_tasks.checkpoint import STAGING_PREFIX, staging_folder

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    elsewhere = tmp_path / "someone-elses"
    (elsewhere / KEY).mkdir(parents=True)
    (elsewhere / KEY / "keep.txt").write_text("not ours")
    root = tmp_path / f"{STAGING_PREFIX}{os.getuid()}"
    if unsafe == "a link":
        root.symlink_to(elsewhere, target_is_directory=True)
    else:
        elsewhere.rename(root)
        root.chmod(0o777)
    with staging_folder(KEY) as folder:
        assert folder.name.startswith("prt-ckpt-") and folder.parent == tmp_path  # a fresh temporary folder
    assert (root / KEY / "keep.txt").read_text() == "not ours"
    assert not folder.exists()


def test_without_a_run_key_each_checkpoint_gets_a_fresh_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raytrain_tasks.checkpoint import staging_folder

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with staging_folder(None) as first, staging_folder(None) as second:
        assert first != second and first.parent == second.parent == tmp_path
    assert list(tmp_path.iterdir()) == []


def test_scoring_a_split_runs_in_bounded_batches_with_the_same_logits() -> None:
    """Evaluation and the champion's re-scoring push a split through the model in batches (one pass over a large
    split ran a GPU out of memory), with the logits of one whole pass."""
    import numpy as np
    import torch

    from raytrain_driver.evaluation import PREDICT_BATCH_ROWS, predict_logits

    seen: list[int] = []

    class Recording(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(len(x))
            return super().forward(x)

    torch.manual_seed(0)
    model = Recording(8, 3)
    features = np.random.default_rng(0).normal(size=(2 * PREDICT_BATCH_ROWS + 5, 8)).astype(np.float32)
    logits = predict_logits(model, features)
    assert seen == [PREDICT_BATCH_ROWS, PREDICT_BATCH_ROWS, 5]
    with torch.no_grad():
        whole = model(torch.from_numpy(features)).numpy()
    np.testing.assert_allclose(logits, whole, rtol=1e-6, atol=1e-6)
