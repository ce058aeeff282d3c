"""Ray Train's record of a run's checkpoints (checkpoint_manager_snapshot.json), checked before Ray Train reads it
(raytrain_driver.ray_record): a writer of storage alone must not make Ray Train delete or load a folder outside the
run. No Ray is started; Ray Train's own checkpoint manager is stepped directly where its behaviour is the point."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from raytrain_tasks.config import new_run_key
from raytrain_tasks.errors import CheckpointError, UnsafeCheckpointError
from raytrain_tasks.storage.locations import RUNS_DIR, locate
from tests.helpers import prepared_for, small_config

RECORD = "checkpoint_manager_snapshot.json"
KEY = "20261127-080000-a1b2c3"
OLDER, NEWER = "checkpoint_2026-11-27_08-00-00.000001", "checkpoint_2026-11-27_08-00-05.000001"


def _entry(name: Any, loss: float = 0.5) -> dict[str, Any]:
    return {"checkpoint_dir_name": name, "metrics": {"val_loss": loss}}


def _record(results: list[Any], latest: Any = None, pending: tuple[Any, ...] = (), **lists: list[Any]) -> str:
    """A record of Ray Train 2.60's shape (its CheckpointManager._save_state): checkpoints by folder name."""
    import ray

    names = ("validated", "timed_out_validation", "failed_validation")
    return json.dumps(
        {
            "ray_version": ray.__version__,
            "checkpoint_results": [_entry(name) for name in results],
            "checkpoint_report_indices": list(range(len(results))),
            "latest_checkpoint_result": _entry(results[-1] if latest is None else latest) if results else None,
            "pending_training_results": [_entry(name) for name in pending],
            "pending_validation_specs": [True for _ in pending],
            "current_report_index": len(results),
            **{f"{name}_checkpoint_dir_names": lists.get(name, []) for name in names},
        }
    )


def _run(tmp_path: Path, *folders: str, key: str = KEY) -> Path:
    """A run's folder in storage (small_config's storage_path) holding checkpoint ``folders``."""
    run = tmp_path / "storage" / RUNS_DIR / key
    run.mkdir(parents=True, exist_ok=True)
    for name in folders:
        (run / name).mkdir()
        (run / name / "state.pt").write_bytes(name.encode())
    return run


def test_the_record_ray_train_writes_for_the_pipelines_checkpoints_passes(tmp_path: Path) -> None:
    from raytrain_driver.ray_record import refuse_unsafe_record

    run = _run(tmp_path, OLDER, NEWER, "epoch-0001", "epoch-0002-r1")
    record = _record([OLDER, NEWER, "epoch-0001"], latest="epoch-0001", pending=("epoch-0002-r1",), validated=[OLDER])
    (run / RECORD).write_text(record)
    refuse_unsafe_record(KEY, locate(str(run)))
    (run / RECORD).unlink()  # a run that has committed nothing yet
    refuse_unsafe_record(KEY, locate(str(run)))


def _outside(tmp_path: Path) -> str:
    victim = tmp_path / "victim"
    victim.mkdir(exist_ok=True)
    (victim / "precious.txt").write_text("not the run's")
    return str(victim)


@pytest.mark.parametrize(
    ("field", "entry"),
    [
        ("results", "absolute"),
        ("results", "relative"),
        ("results", f"{NEWER}/.."),
        ("results", f"../{KEY}/{NEWER}"),  # back into the run, yet not a plain name
        ("results", "."),
        ("results", ""),
        ("results", "epoch-0009"),  # a name of ours, but no such folder in the run
        ("results", "planted-0002"),  # a folder in the run, of a name this pipeline never writes
        ("results", 7),
        ("latest", "absolute"),
        ("pending", "relative"),
        ("validated", "absolute"),
        ("timed_out_validation", "relative"),
        ("failed_validation", "absolute"),
    ],
)
def test_every_entry_not_a_checkpoint_folder_inside_the_run_is_refused(tmp_path: Path, field: str, entry: Any) -> None:
    """Ray Train joins each name to the run's path as given (an absolute one replaces it, `..` climbs out) and
    deletes what an evicted entry names: every field that names a folder is checked, by its whole name."""
    from raytrain_driver.ray_record import refuse_unsafe_record

    run = _run(tmp_path, OLDER, NEWER, "planted-0002")
    victim = _outside(tmp_path)
    name = {"absolute": victim, "relative": os.path.relpath(victim, run)}.get(entry, entry)
    results, latest, pending, lists = [OLDER, NEWER], None, (), {}
    if field == "results":
        results = [name, NEWER]
    elif field == "latest":
        results, latest = [name, NEWER], name
    elif field == "pending":
        results, pending = [OLDER, name], (name,)
    else:
        lists = {field: [name]}
    (run / RECORD).write_text(_record(results, latest, pending, **lists))

    with pytest.raises(UnsafeCheckpointError) as raised:
        refuse_unsafe_record(KEY, locate(str(run)))

    message = str(raised.value)
    assert repr(name) in message and "`storage_path`" in message and str(run) in message, message
    assert KEY in message and RECORD in message


@pytest.mark.parametrize("text", ['{"checkpoint_results": [', "[]", '{"checkpoint_results": [{"metrics": {}}]}'])
def test_a_record_that_cannot_be_read_is_refused_not_guessed(tmp_path: Path, text: str) -> None:
    """Cut short by a crash while Ray Train wrote it, or of another shape: nothing can vouch for its entries."""
    from raytrain_driver.ray_record import refuse_unsafe_record

    run = _run(tmp_path, OLDER)
    (run / RECORD).write_text(text)
    with pytest.raises(CheckpointError, match=r"cannot be read .*`storage_path`"):
        refuse_unsafe_record(KEY, locate(str(run)))


def test_the_fields_checked_are_every_field_of_ray_trains_record_that_names_a_folder() -> None:
    """A Ray Train whose record names folders in another field fails here, before a resume trusts it."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

    from raytrain_driver.ray_record import RECORD_ENTRY_FIELDS, RECORD_NAME_FIELDS

    fields = set(_CheckpointManagerState.__fields__)
    others = {"ray_version", "checkpoint_report_indices", "pending_validation_specs", "current_report_index"}
    assert fields - others == {*RECORD_ENTRY_FIELDS, *RECORD_NAME_FIELDS}


@pytest.mark.parametrize("entry", ["absolute", "relative"])
def test_ray_trains_eviction_deletes_the_folder_a_tampered_entry_names(tmp_path: Path, entry: str) -> None:
    """Why no tampered entry may reach Ray Train (2.60): its CheckpointManager rebuilds each entry's path with
    StorageContext.build_checkpoint_path_from_name and, when a new checkpoint pushes the entry out of
    `num_to_keep`, _save_state_and_delete_old_checkpoints deletes that path wherever it is."""
    import pyarrow.fs
    from ray.air.config import CheckpointConfig
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    run = _run(tmp_path, NEWER, "epoch-0003")
    victim = _outside(tmp_path)
    name = victim if entry == "absolute" else os.path.relpath(victim, run)
    state = json.loads(_record([name, NEWER]))
    state["checkpoint_results"][0]["metrics"] = {"val_loss": 9.0}  # the worst: evicted first
    (run / RECORD).write_text(json.dumps(state))
    storage = StorageContext(str(run.parent), run.name, storage_filesystem=pyarrow.fs.LocalFileSystem())
    keep = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min")
    checkpoint = Checkpoint(str(run / "epoch-0003"), filesystem=storage.storage_filesystem)

    async def commit_one_more() -> None:
        manager = CheckpointManager(keep, storage)
        manager.register_checkpoint(_TrainingReport(checkpoint, {"val_loss": 0.1}, validation=False))

    asyncio.run(commit_one_more())
    assert not Path(victim).exists()


def test_a_fit_refuses_a_tampered_record_before_ray_mlflow_or_any_worker(tmp_path: Path) -> None:
    """A fit that goes on with a run (a Prefect retry, a resume) whose record names a folder outside the run stops
    at its pre-flight: not retried, naming `storage_path`; no Ray, no MLflow run, nothing deleted or trained."""
    from raytrain_driver.fit import fit_in_this_process
    from raytrain_tasks.tracking import runs as tracking
    from tasks.fit import NOT_RETRYABLE

    key = new_run_key()
    config = small_config(tmp_path, dataset="synthetic", synthetic_samples=400, num_workers=1, epochs=2)
    config, dataset = prepared_for(config)
    runs = locate(config.storage_path).child(RUNS_DIR)
    run = _run(tmp_path, key=key)
    victim = _outside(tmp_path)
    (run / RECORD).write_text(_record([victim], latest=victim))
    before = sorted(p.name for p in run.iterdir())

    with pytest.raises(UnsafeCheckpointError) as raised:
        fit_in_this_process(config, dataset, key, runs, origin={"run_name": key})

    assert isinstance(raised.value, NOT_RETRYABLE)
    assert repr(victim) in str(raised.value) and "`storage_path`" in str(raised.value), raised.value
    assert (Path(victim) / "precious.txt").exists()
    assert sorted(p.name for p in run.iterdir()) == before  # the lease gone with it, nothing trained
    client = tracking.connect(config.mlflow_tracking_uri)
    experiments = client.search_experiments()
    assert not experiments or client.search_runs([e.experiment_id for e in experiments]) == []
