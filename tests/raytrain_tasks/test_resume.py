"""Resuming picks the newest intact checkpoint of a run, never a corrupted one."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from ray.train import Checkpoint

from raytrain_tasks.checkpoint import MODEL_FILE, ModelSpec, TrainingState, save_checkpoint
from raytrain_tasks.errors import CheckpointError
from raytrain_tasks.resume import checkpoint_dir_name, load_newest_intact, resume_order


@pytest.mark.parametrize(
    ("latest", "siblings", "expected"),
    [
        ("epoch-0003", ["epoch-0001", "epoch-0002", "epoch-0003"], ["epoch-0003", "epoch-0002", "epoch-0001"]),
        ("epoch-0002", ["epoch-0001", "epoch-0002", "epoch-0003"], ["epoch-0002", "epoch-0001"]),  # newer unregistered
        ("epoch-0000", ["epoch-0000", "checkpoint_manager_snapshot.json"], ["epoch-0000"]),
        ("epoch-0010", ["epoch-0009", "epoch-0010", ".tmp"], ["epoch-0010", "epoch-0009"]),
        # as numbers, not text: -r10 is newer than -r9, epoch 10000 than 9999
        (
            "epoch-0002-r10",
            ["epoch-0002-r9", "epoch-0002-r10", "epoch-0002"],
            ["epoch-0002-r10", "epoch-0002-r9", "epoch-0002"],
        ),
        ("epoch-10000", ["epoch-9999", "epoch-10000"], ["epoch-10000", "epoch-9999"]),
        # a snapshot pointed at a folder this project never names: all of the run's own follow it, newest first
        ("planted-0002", ["epoch-0001", "epoch-0002", "planted-0002"], ["planted-0002", "epoch-0002", "epoch-0001"]),
        # names that only start like ours are not ours (they raised ValueError, failing every attempt)
        ("epoch-planted", ["epoch-0001", "epoch-planted"], ["epoch-planted", "epoch-0001"]),
        (
            "epoch-0002",
            ["epoch-0001", "epoch-0001.tmp", "epoch-0001-r1-old", "epoch-0002"],
            ["epoch-0002", "epoch-0001"],
        ),
    ],
)
def test_resume_order(latest: str, siblings: list[str], expected: list[str]) -> None:
    assert resume_order(latest, siblings) == expected


def _run_with_checkpoints(run_dir: Path, epochs: int) -> None:
    spec = ModelSpec(model="mlp", in_features=4, num_classes=2, hidden_sizes=(8,))
    for epoch in range(epochs):
        save_checkpoint(
            run_dir / checkpoint_dir_name(epoch),
            state=TrainingState(epoch=epoch, metrics={}, spec=spec),
            model_state={"w": torch.full((2,), float(epoch))},
        )


def _latest(run_dir: Path, epoch: int) -> Checkpoint:
    return Checkpoint(str(run_dir / checkpoint_dir_name(epoch)), pafs.LocalFileSystem())


def test_intact_latest_is_used(tmp_path: Path) -> None:
    _run_with_checkpoints(tmp_path, 3)
    loaded, used = load_newest_intact(_latest(tmp_path, 2), announce=False)
    assert loaded.state.epoch == 2 and used.path.endswith("epoch-0003")  # the third epoch: index 2, number 3


def test_truncated_latest_falls_back_to_previous_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _run_with_checkpoints(tmp_path, 3)
    model_file = tmp_path / "epoch-0003" / MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[:10])
    with caplog.at_level("WARNING"):
        loaded, used = load_newest_intact(_latest(tmp_path, 2), announce=True)
    assert loaded.state.epoch == 1 and used.path.endswith("epoch-0002")
    assert "falling back to the last intact checkpoint epoch-0002 (epoch 2)" in caplog.text
    assert model_file.exists()  # never deleted behind Ray Train's back


def test_no_intact_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    _run_with_checkpoints(tmp_path, 2)
    for epoch in range(2):
        (tmp_path / checkpoint_dir_name(epoch) / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no intact checkpoint left.*without `resume`"):
        load_newest_intact(_latest(tmp_path, 1), announce=False)


def _as_if_written_by_a_newer_torch(checkpoint: Path) -> None:
    """Rewrite the checkpoint's model.pt with an archive version above what this torch reads (what an older torch
    meets in a file a newer one wrote), and its manifest to match, as that newer prefect-raytrain would."""
    import hashlib
    import json
    import zipfile

    model_file = checkpoint / MODEL_FILE
    original = zipfile.ZipFile(model_file)
    newer = checkpoint / "newer.pt"
    with zipfile.ZipFile(newer, "w", compression=zipfile.ZIP_STORED) as out:
        for info in original.infolist():
            data = original.read(info.filename)
            out.writestr(info, b"99\n" if info.filename.endswith("/version") else data)
    original.close()
    newer.replace(model_file)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    content = model_file.read_bytes()
    manifest["files"][MODEL_FILE] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    manifest["torch_version"] = "9.9.0"
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_this_torch_is_too_old_to_read_is_passed_over_not_called_tampered(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It was UnsafeCheckpointError ("someone other than prefect-raytrain wrote this file"), which stops the
    resume: a torch upgrade on one node, then a resume on an older one, could never continue."""
    from raytrain_tasks.errors import UnsafeCheckpointError

    _run_with_checkpoints(tmp_path, 3)
    _as_if_written_by_a_newer_torch(tmp_path / "epoch-0003")
    with caplog.at_level("WARNING"):
        try:
            loaded, used = load_newest_intact(_latest(tmp_path, 2), announce=True)
        except UnsafeCheckpointError as exc:
            pytest.fail(f"reported as tampering: {exc}")
    assert loaded.state.epoch == 1 and used.path.endswith("epoch-0002")
    assert "written by torch 9.9.0" in caplog.text and f"torch {torch.__version__} cannot read" in caplog.text
