"""Which checkpoint a resume of the user's code starts from (raytrain_driver.fit_steps); no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_driver.fit_steps import choose_resume_point
from raytrain_tasks.errors import CheckpointError
from raytrain_tasks.integrity import folder_digest
from raytrain_tasks.storage.locations import locate

OLDER, NEWER = "checkpoint_2026-11-27_08-00-00.000001", "checkpoint_2026-11-27_08-00-05.000001"


def _checkpoints(tmp_path: Path) -> dict[str, str]:
    """Two committed checkpoints of one run and the digests MLflow recorded for them."""
    run_dir = locate(str(tmp_path))
    for name in (OLDER, NEWER):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_bytes(name.encode())
    return {name: folder_digest(run_dir.filesystem, run_dir.child(name).path) for name in (OLDER, NEWER)}


def test_a_resume_names_the_verified_checkpoint_it_starts_from(tmp_path: Path) -> None:
    """The newest checkpoint whose files hash to the recorded digest: the log line 'resumes from its checkpoint'
    names it (the README promises which checkpoint a continued run resumes from)."""
    pinned = _checkpoints(tmp_path)
    point = choose_resume_point(locate(str(tmp_path)), pinned)
    assert (point.start, point.rejected, point.fallback) == (NEWER, frozenset(), None)
    (tmp_path / NEWER / "state.pt").write_bytes(b"tampered")
    point = choose_resume_point(locate(str(tmp_path)), pinned)
    assert (point.start, point.rejected, point.fallback) == (OLDER, frozenset({NEWER}), OLDER)
    assert choose_resume_point(locate(str(tmp_path / "never-started")), {}).start is None
    (tmp_path / OLDER / "state.pt").write_bytes(b"tampered")
    with pytest.raises(CheckpointError, match="no checkpoint of run .* verifies"):
        choose_resume_point(locate(str(tmp_path)), pinned)


def test_a_resume_says_which_epoch_its_checkpoint_holds_when_the_report_said(tmp_path: Path) -> None:
    """Ray Train names your code's checkpoint folders by time: the resume line adds the epoch the checkpoint's
    report said (Ray Train's record of the run, beside them), and names the folder alone when it cannot tell."""
    pinned = _checkpoints(tmp_path)
    assert choose_resume_point(locate(str(tmp_path)), pinned).epoch is None  # no record: no epoch
    record = tmp_path / "checkpoint_manager_snapshot.json"
    results = [{"checkpoint_dir_name": OLDER, "metrics": {"epoch": 1}}, {"checkpoint_dir_name": NEWER, "metrics": {}}]
    record.write_text(json.dumps({"checkpoint_results": results}))
    assert choose_resume_point(locate(str(tmp_path)), pinned).epoch is None  # its report said no epoch
    results[1]["metrics"] = {"epoch": 2, "val_loss": 0.1}
    record.write_text(json.dumps({"checkpoint_results": results}))
    point = choose_resume_point(locate(str(tmp_path)), pinned)
    assert (point.start, point.epoch) == (NEWER, 3)  # reported 0-based, said from 1
    record.write_text('{"checkpoint_results": [')  # a record cut short, or of another shape: the folder alone
    assert choose_resume_point(locate(str(tmp_path)), pinned).epoch is None
    record.write_text('{"checkpoint_results": {"a": 1}}')
    assert choose_resume_point(locate(str(tmp_path)), pinned).epoch is None


@pytest.mark.parametrize(
    ("older", "newer"),
    [("epoch-0002-r9", "epoch-0002-r10"), ("epoch-9999", "epoch-10000"), ("epoch-0002", "epoch-0002-r1"),
     ("epoch-0002-r1", "epoch-0003"), (NEWER, "epoch-0001")],
)  # fmt: skip
def test_the_newest_checkpoint_is_found_by_epoch_and_retraining_as_numbers(
    tmp_path: Path, older: str, newer: str
) -> None:
    """A TrainSpec's folders are epoch-NNNN(-rK): compared as text, epoch-0002-r10 would come before epoch-0002-r9
    and a resume would start from the older one."""
    run_dir = locate(str(tmp_path))
    for name in (older, newer):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.pt").write_bytes(name.encode())
    pinned = {name: folder_digest(run_dir.filesystem, run_dir.child(name).path) for name in (older, newer)}
    assert choose_resume_point(run_dir, pinned).start == newer


def test_a_report_without_epoch_is_matched_to_its_step_by_the_metrics_mlflow_has() -> None:
    """A train_func that reports no `epoch`, with a `test_loss` (a gate_metric) that MLflow's per-step history of the
    run does not hold: each checkpoint still gets its own step (they all got the last one, so the Models tab and the
    summary showed the last epoch for every checkpoint)."""
    from raytrain_driver.fit_steps import step_of

    history = [{"epoch": 0.0, "val_loss": 0.5, "train_loss": 0.9}, {"epoch": 1.0, "val_loss": 0.4, "train_loss": 0.7}]
    assert step_of({"val_loss": 0.5, "test_loss": 0.55, "train_loss": 0.9}, history) == 1
    assert step_of({"val_loss": 0.4, "test_loss": 0.45}, history) == 2
    assert step_of({"epoch": 0, "val_loss": 0.4}, history) == 1  # a report's own epoch decides
