"""Retention during a fit (raytrain_driver.retention): Ray Train's rule, except that the checkpoint the fit resumed
from stays while the fit runs. No Ray is started: Ray Train's own CheckpointManager is stepped directly, on real
checkpoint folders in a local run folder, beside a twin of it that Ray Train's manager alone steps."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import shutil
from pathlib import Path

import pytest

from raytrain_driver.retention import checkpoints_to_delete, keep_resumed_checkpoint
from raytrain_tasks.checked_reports import UNSCORED
from raytrain_tasks.tracking.names import RANK_SCORE_KEY

RUN = "run"


@pytest.mark.parametrize(
    ("ranked", "keep", "latest", "pending", "protected", "deleted"),
    [
        # Ray Train's own rule: all but the best `keep`, never the latest nor one awaiting validation.
        ("abcd", 2, "d", "", "", "ab"),
        ("abcd", 2, "a", "", "", "b"),
        ("abcd", 2, "d", "b", "", "a"),
        ("abcd", None, "d", "", "", ""),
        ("abcd", 4, "d", "", "", ""),
        ("abcd", 1, "c", "", "", "ab"),
        ("", 2, None, "", "", ""),
        # The resumed-from one is spared as the latest is; the others go as before.
        ("abcd", 2, "d", "", "a", "b"),
        ("abcd", 2, "d", "", "c", "ab"),  # among the best already
        ("abcd", 2, "d", "", "x", "ab"),  # not in Ray's record (a rejected run's newest): nothing to spare
        ("abcd", 1, "d", "b", "a", "c"),
        ("abcd", 2, "a", "", "a", "b"),
    ],
)
def test_which_checkpoints_are_deleted(
    ranked: str, keep: int | None, latest: str | None, pending: str, protected: str, deleted: str
) -> None:
    assert checkpoints_to_delete(list(ranked), keep, latest, set(pending), set(protected)) == frozenset(deleted)


# (what the first fit reported, the checkpoint the second resumes from, what the second reports), each report a
# checkpoint folder and its rank score; 2 kept.
SCENARIOS = {
    # A checkpoint within an epoch ranks last: it goes as soon as two newer ones are kept.
    "within an epoch": (
        [("epoch-0001", 0.5), ("epoch-0002", 0.7), ("epoch-0003-step-00000031", UNSCORED)],
        "epoch-0003-step-00000031",
        [("epoch-0003-step-00000036", UNSCORED), ("epoch-0003", 0.6), ("epoch-0004", 0.8)],
    ),
    # Ray's newest (epoch 3) failed verification: the fit starts from epoch 2, which the retrained ones outrank.
    "older than Ray's newest": (
        [("epoch-0001", 0.2), ("epoch-0002", 0.9), ("epoch-0003", 0.8)],
        "epoch-0002",
        [("epoch-0003-r1", 0.95), ("epoch-0004", 0.97)],
    ),
}


def _fit(run: Path, reports: list[tuple[str, float]], resumed_from: str | None, door: bool = True) -> None:
    """One fit's retention on the run folder ``run``: Ray Train's manager (reading the record the last fit left),
    through the door unless ``door`` is False, given ``reports`` in order, each a checkpoint folder just written."""
    import pyarrow.fs
    from ray.air.config import CheckpointConfig
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    storage = StorageContext(str(run.parent), run.name, storage_filesystem=pyarrow.fs.LocalFileSystem())
    # As raytrain_driver.trainer configures it.
    keep = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute=RANK_SCORE_KEY, checkpoint_score_order="max")

    async def steps() -> None:
        manager = CheckpointManager(keep, storage)
        if door:
            keep_resumed_checkpoint(manager, resumed_from)
        for name, score in reports:
            (run / name).mkdir()
            (run / name / "state.pt").write_bytes(name.encode())
            checkpoint = Checkpoint(str(run / name), filesystem=storage.storage_filesystem)
            manager.register_checkpoint(_TrainingReport(checkpoint, {RANK_SCORE_KEY: score}, validation=False))
        await asyncio.sleep(0)  # the manager's notifications run

    asyncio.run(steps())


def _folders(run: Path) -> set[str]:
    return {path.name for path in run.iterdir() if path.name.startswith("epoch-")}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_fit_never_deletes_the_checkpoint_it_resumed_from(tmp_path: Path, scenario: str) -> None:
    """Ray Train's manager alone deletes the resumed-from checkpoint while the fit runs; through the door it stays,
    and in Ray Train's record of the run, and every other checkpoint is deleted or kept as Ray Train's alone."""
    first, resumed_from, second = SCENARIOS[scenario]
    ours, rays = tmp_path / "ours" / RUN, tmp_path / "rays" / RUN
    ours.mkdir(parents=True)
    _fit(ours, first, None)
    shutil.copytree(ours.parent, rays.parent, dirs_exist_ok=True)

    _fit(rays, second, resumed_from, door=False)
    _fit(ours, second, resumed_from)

    assert resumed_from not in _folders(rays), "the scenario must be one where Ray Train's rule deletes it"
    assert _folders(ours) == _folders(rays) | {resumed_from}, f"{resumed_from} was deleted while the fit ran"
    record = (ours / "checkpoint_manager_snapshot.json").read_text()
    assert f'"checkpoint_dir_name":"{resumed_from}"' in record.replace(" ", "")


def test_the_next_fit_deletes_it_by_ray_trains_rule(tmp_path: Path) -> None:
    """Kept for the life of the fit that resumed from it, not beyond: the next fit reads the record (every folder
    it names is there) and, starting elsewhere, deletes it at its first checkpoint."""
    first, resumed_from, second = SCENARIOS["within an epoch"]
    run = tmp_path / RUN
    run.mkdir()
    _fit(run, first, None)
    _fit(run, second, resumed_from)
    assert resumed_from in _folders(run)
    _fit(run, [("epoch-0005", 0.1)], "epoch-0004")
    assert _folders(run) == {"epoch-0002", "epoch-0004", "epoch-0005"}


# Ray Train 2.60.0's source of what raytrain_driver.retention changes and relies on.
RAY_DELETION_SHA256 = "06e3b4e3eca827c11322c0e95b19ab534702166de77080f933a26ceb26f4c9e0"


def test_ray_trains_retention_is_the_shape_the_door_was_written_against() -> None:
    """Fails when Ray Train changes what the door replaces (the deletion) or where it reaches in (the controller
    builds one CheckpointManager, kept as ``_checkpoint_manager``, and is handed the trainer's train_loop_config):
    read the new source, then update raytrain_driver.retention and this digest."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.controller import TrainController
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    deletion = inspect.getsource(CheckpointManager._save_state_and_delete_old_checkpoints)
    assert hashlib.sha256(deletion.encode()).hexdigest() == RAY_DELETION_SHA256, deletion
    controller = inspect.getsource(TrainController.__init__)
    assert controller.count("CheckpointManager(") == 1
    assert "self._checkpoint_manager = CheckpointManager(" in controller
    assert "self._train_run_context = train_run_context" in controller
    assert "train_run_context=self.train_run_context," in inspect.getsource(DataParallelTrainer.fit)


def test_the_door_refuses_a_manager_it_was_not_written_for() -> None:
    with pytest.raises(TypeError, match="not the CheckpointManager of Ray 2.60.0"):
        keep_resumed_checkpoint(object(), "epoch-0001")


def test_the_controller_keeps_the_checkpoint_the_fit_hands_its_workers(tmp_path: Path) -> None:
    """The trainer a fit builds carries its ResumePoint's start in the train_loop_config Ray Train hands the
    controller, under the key KeepResumedController reads: what the workers start from is what is kept."""
    from raytrain_driver.fit_record import ResumePoint
    from raytrain_driver.retention import START_KEY
    from raytrain_driver.sizing import FitPlan
    from raytrain_driver.trainer import build_trainer
    from raytrain_tasks.config import TrainingConfig
    from tests.helpers import REGISTRY_CODE, fit_context

    config = TrainingConfig(train_code=REGISTRY_CODE, register=False, storage_path=str(tmp_path), cpus_per_worker=1)
    start = "epoch-0002-step-00000018"
    trainer = build_trainer(fit_context(config, "k", client=object()), FitPlan.of(config), ResumePoint(start=start))
    assert trainer.train_run_context.train_loop_config[START_KEY] == start
