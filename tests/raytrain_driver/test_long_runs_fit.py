"""Checkpoints within an epoch, for real: a TrainSpec (tests/long_run_code.py: dropout, so the RNG matters) checkpoints
every 5 steps; one of its runs fails in rank 0 part-way through epoch 2, and Ray Train's restarted worker group
continues from the step before. Both runs are made once, by the module fixture; the deciders (when a checkpoint is
due, which settings are refused, the loader's position) are tested without a fit in test_long_runs.py."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from raytrain_tasks.tracking.names import LAST_STEP_TAG, STEP_SERIES, within_epoch
from tests.helpers import mlflow_client, only_run, small_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster", "prefect_api")]

CODE = "tests.long_run_code:training"
# 2 workers, 400 train rows each, 32 a batch: 13 steps an epoch. A checkpoint 5 steps after the last one (an
# epoch's end counts), never at an epoch's last step: global steps 5, 10 | 18, 23 | 31, 36; epochs end at 13, 26, 39.
SETTINGS = {"epochs": 3, "batch_size": 32, "checkpoint_every_steps": 5, "register": False}
WITHIN = [5, 10, 18, 23, 31, 36]
EPOCH_ENDS = [13, 26, 39]
FAIL_AT = 21  # in epoch 2, 3 steps after the checkpoint at step 18


def _run(workdir: Path, **overrides: Any) -> Any:
    config = small_config(workdir, train_code=CODE, **{**SETTINGS, **overrides})
    return training_pipeline(**parameters_of(config))


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    reference_dir, failed_dir = tmp_path_factory.mktemp("uninterrupted"), tmp_path_factory.mktemp("failed")
    marker = failed_dir / "failed-once"
    found = SimpleNamespace(reference_dir=reference_dir, failed_dir=failed_dir, marker=marker)
    found.reference_result = _run(reference_dir, checkpoints_to_keep=2)
    # Every checkpoint kept, to read which ones the restarted group wrote.
    failing = {"fail_at_step": FAIL_AT, "marker": str(marker)}
    found.failed_result = _run(failed_dir, checkpoints_to_keep=100, train_config=failing)
    for name in ("reference", "failed"):
        workdir = getattr(found, f"{name}_dir")
        run = only_run(workdir)
        client = mlflow_client(workdir)
        history = {key: client.get_metric_history(run.info.run_id, key) for key in run.data.metrics}
        (run_dir,) = (workdir / "storage" / "runs").iterdir()
        setattr(found, name, SimpleNamespace(run=run, history=history, run_dir=run_dir))
    return found


def _by_step(points: list[Any]) -> dict[int, float]:
    steps = [int(point.step) for point in points]
    assert len(steps) == len(set(steps)), f"each step logged once: {sorted(steps)}"
    return {int(point.step): float(point.value) for point in points}


def test_a_run_that_fails_within_an_epoch_ends_as_the_uninterrupted_one(long_runs: SimpleNamespace) -> None:
    """The failed run trained on from its checkpoint at step 18: every epoch's figures and every point of the
    step series equal the uninterrupted run's (to 1e-6), in one MLflow run, each epoch logged once."""
    assert long_runs.marker.read_text() == str(FAIL_AT)  # it did fail, where the test placed it
    failed, reference = long_runs.failed, long_runs.reference
    assert failed.run.info.status == "FINISHED"
    for key in ("train_loss", "val_loss", "val_accuracy", "test_accuracy", "test_loss"):
        got, expected = _by_step(failed.history[key]), _by_step(reference.history[key])
        assert sorted(got) == [1, 2, 3], key
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, abs=1e-6), (key, step)
    got, expected = _by_step(failed.history[STEP_SERIES]), _by_step(reference.history[STEP_SERIES])
    assert sorted(expected) == sorted(WITHIN + EPOCH_ENDS)
    assert sorted(got) == sorted(expected)
    for step, value in expected.items():
        assert math.isfinite(value) and got[step] == pytest.approx(value, abs=1e-6), step


def test_the_restarted_workers_continued_from_the_step_checkpoint_not_the_epoch(long_runs: SimpleNamespace) -> None:
    """Resumed from epoch 2's step-18 checkpoint: nothing before it was trained again (a retrained folder would be
    named `-r1`), and every checkpoint after it was written after the failure."""
    run_dir = long_runs.failed.run_dir
    names = sorted(path.name for path in run_dir.iterdir() if path.name.startswith("epoch-"))
    assert "epoch-0002-step-00000018" in names and not [name for name in names if "-r" in name], names
    failed_at = long_runs.marker.stat().st_mtime

    def written(name: str) -> float:
        return max(path.stat().st_mtime for path in (run_dir / name).iterdir())

    assert written("epoch-0002-step-00000018") < failed_at
    assert all(written(name) > failed_at for name in ("epoch-0002-step-00000023", "epoch-0002", "epoch-0003"))
    assert long_runs.failed.run.data.tags[LAST_STEP_TAG] == "39, epoch 3"


def test_retention_keeps_the_best_epoch_checkpoints_and_the_newest(long_runs: SimpleNamespace) -> None:
    """With `checkpoints_to_keep` 2, the checkpoints within epochs (no epoch scores: ranked last) are gone once a
    newer one is committed; what stays is the two best epochs by val_accuracy and the newest, and the registered
    choice is an epoch's."""
    reference = long_runs.reference
    kept = sorted(path.name for path in reference.run_dir.iterdir() if path.name.startswith("epoch-"))
    assert not [name for name in kept if within_epoch(name)], kept
    scores = _by_step(reference.history["val_accuracy"])
    best_two = sorted(scores, key=lambda step: -scores[step])[:2]
    assert set(kept) == {f"epoch-{step:04d}" for step in {*best_two, 3}}, (kept, scores)
    best = long_runs.reference_result.fit.best_checkpoint_uri.rstrip("/").rsplit("/", 1)[-1]
    assert best == f"epoch-{best_two[0]:04d}", (best, scores)
