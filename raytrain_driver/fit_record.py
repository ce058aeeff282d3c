"""What a finished fit left behind (``FitResult``), and its record in the run's storage (``fit.json``), which
makes a resume of a complete run train and log nothing again."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from raytrain_driver.hooks import run_logger
from raytrain_driver.lease import HeldLease
from raytrain_tasks.errors import UnsafeCheckpointError
from raytrain_tasks.storage.locations import StorageLocation
from raytrain_tasks.tracking import runs as tracking
from raytrain_tasks.tracking.names import checkpoint_name

if TYPE_CHECKING:
    import ray.train

    from raytrain_tasks.tracking.pin_journal import PinJournal


class FitResult(BaseModel):
    """What a finished fit left behind, and where."""

    model_config = ConfigDict(frozen=True)

    run_key: str
    run_uri: str
    mlflow_run_id: str
    mlflow_experiment_id: str
    backend: str
    epochs_completed: int
    best_epoch: int  # its number, 1 to epochs (tracking.epoch_number)
    best_checkpoint_uri: str
    best_metrics: dict[str, float]
    final_metrics: dict[str, float]
    history: list[dict[str, float]]
    reopened_mlflow_run: bool
    # The best checkpoint's scores: what the code reported with it (the gate's held-out metric among them).
    scores: dict[str, float] = {}
    # The MLflow LoggedModel that stands for the best checkpoint (tracking.outcome.log_checkpoint_models).
    best_checkpoint_model_id: str | None = None
    # What summaries show of the metrics, in order (empty: all of them, sorted).
    shown_metrics: tuple[str, ...] = ()
    # The user's code trained on Ray Datasets: registering it (load_model, input_example, evaluate) needs Ray.
    ray_datasets: bool = False


FIT_RECORD = "fit.json"


def write_fit_record(
    run_dir: StorageLocation, client: Any, run_id: str, fit: FitResult, lease: HeldLease | None
) -> None:
    """The record goes last: a run with it is complete, and a resume of it trains and logs nothing again. Its
    digest goes to MLflow after it: a record without one is not trusted (see finished_fit)."""
    if lease is not None:
        lease.check()  # a driver that lost the run writes nothing more into it
    record = fit.model_dump_json(indent=1)
    run_dir.child(FIT_RECORD).write_text(record)
    client.set_tag(run_id, tracking.FIT_RECORD_TAG, hashlib.sha256(record.encode()).hexdigest())


def finished_fit(run_dir: StorageLocation, client: Any, experiment_id: str, run_key: str) -> FitResult | None:
    """The run's FIT_RECORD if it is the one this run wrote (its digest is in the MLflow run); None otherwise.

    Without a recorded digest (the process died between writing the record and tagging it) the record is ignored
    and the fit runs again: Ray Train finds every epoch done and the summary steps are redone. A record whose
    digest differs was replaced in storage, and the fit stops: its scores would feed the promotion gate.
    """
    record = run_dir.child(FIT_RECORD)
    if not record.exists():
        return None
    text = record.read_text()
    run = tracking.find_run(client, experiment_id, run_key)
    expected = run.data.tags.get(tracking.FIT_RECORD_TAG) if run is not None else None
    if expected is None:
        run_logger().warning("%s of run %s has no digest in MLflow; finishing the run again", FIT_RECORD, run_key)
        return None
    if hashlib.sha256(text.encode()).hexdigest() != expected:
        raise UnsafeCheckpointError(
            f"{record.uri} is not the record run {run_key} wrote (its SHA-256 differs from the one in MLflow run "
            f"{run.info.run_id if run else '?'}); someone or something changed it in storage. Check who can write "
            "`storage_path`; delete the file to have the run finish again from its checkpoints"
        )
    return FitResult.model_validate_json(text)


def checkpoint_uri(run_dir: StorageLocation, checkpoint: ray.train.Checkpoint) -> str:
    return run_dir.child(checkpoint_name(checkpoint.path)).uri


@dataclass(frozen=True)
class ResumePoint:
    """Which of a run's checkpoints a resume may start from: ``rejected`` ones never (their files do not hash to
    what the run recorded when Ray Train committed them, or nothing was recorded), ``fallback`` instead."""

    rejected: frozenset[str] = frozenset()
    fallback: str | None = None
    why: str = ""
    start: str | None = None  # the checkpoint it starts from (verified); None: from the first epoch
    epoch: int | None = None  # the epoch (from 1) that ``start`` holds, when its report said (``epoch``)
    # Every name in the run's folder as the fit starts: of these, only ``start`` may be handed to the code.
    present: frozenset[str] = frozenset()


def refuse_foreign_checkpoints(
    result: ray.train.Result, run_key: str, run_dir: StorageLocation, ours: Callable[[str], bool], named: str
) -> None:
    """UnsafeCheckpointError when Ray Train's record of the run lists a checkpoint folder this pipeline never
    writes (``ours`` tells; ``named`` says how its folders are named): someone pointed the record elsewhere.
    Nothing is registered from such a run (test_security, test_own_code)."""
    reported = (checkpoint_name(checkpoint.path) for checkpoint, _ in result.best_checkpoints or [])
    if foreign := sorted(name for name in reported if not ours(name)):
        raise UnsafeCheckpointError(
            f"Ray Train's checkpoint record of run {run_key} (checkpoint_manager_snapshot.json in {run_dir.uri}) "
            f"lists {', '.join(foreign)}, which this pipeline never writes (its checkpoints are {named}): "
            "someone or something changed the run's storage. Nothing is registered from it; check who can write "
            "`storage_path`, then start a new run (without `resume`)"
        )


@dataclass(frozen=True)
class OpenRun:
    """The fit's MLflow run once it exists, and what a resume starts from."""

    run_id: str
    experiment_id: str
    reopened: bool
    backend: str
    journal: PinJournal | None
    # The checkpoint digests MLflow vouches for (fit_steps.choose_resume_point).
    pinned: dict[str, str]
    resume_point: ResumePoint | None

    @classmethod
    def new(cls, run_id: str, experiment_id: str, reopened: bool, backend: str) -> OpenRun:
        """The MLflow run as just opened, before what it resumes from is known."""
        return cls(run_id, experiment_id, reopened, backend, journal=None, pinned={}, resume_point=None)
