"""Checkpoint pins: the manifest digest MLflow records for each committed checkpoint (what a resume and the
registry trust), and the pin journal that keeps them on the driver's disk while MLflow is down."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import CheckpointError
from raytrain_tasks.tracking.names import checkpoint_name, pin_tag, pinned_digests
from raytrain_tasks.tracking.pin_journal import PinJournal

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)


def recorded_digest(client: MlflowClient, run_id: str, checkpoint_uri: str) -> str:
    """The manifest digest run ``run_id`` recorded for the checkpoint at ``checkpoint_uri``; CheckpointError if none."""
    name = checkpoint_name(checkpoint_uri)
    digest = pinned_digests(client.get_run(run_id).data.tags).get(name)
    if digest is None:
        raise CheckpointError(
            f"checkpoint {checkpoint_uri} has no manifest digest recorded in MLflow run {run_id}: as far as MLflow "
            "knows, this run never committed it, so it is not loaded. Resume the run (`resume`) to train it again"
        )
    return digest


def pin_journal_dir(state_dir: Path) -> Path:
    """Where this machine keeps its pin journals (raytrain_tasks.tracking.pin_journal): under ``state_dir``, the
    state folder of the process that drives the run (Prefect's home of a CLI run, a deployment's worker or serve;
    ``raytrain_driver.hooks.state_dir``), never in the run's storage."""
    return state_dir.expanduser().resolve() / "prefect-raytrain" / "pin-journal"


def pin_journal(config: TrainingConfig, run_key: str, state_dir: Path) -> PinJournal | None:
    """The run's pin journal under ``state_dir``; None (warned) where it would lie inside a local `storage_path`,
    which cannot vouch for itself."""
    from raytrain_tasks.storage.filesystem import is_s3

    directory = pin_journal_dir(state_dir)
    if not is_s3(config.storage_path) and directory.is_relative_to(Path(config.storage_path).resolve()):
        logger.warning(
            "no pin journal for run %s: %s lies inside storage_path; checkpoints are pinned in MLflow alone",
            run_key,
            directory,
        )
        return None
    return PinJournal.for_run(directory, run_key)


def pins_from_journal(client: MlflowClient, run_id: str, journal: PinJournal | None) -> list[str]:
    """Record in the MLflow run what ``journal`` holds for it and the run lacks (MLflow was down when those
    checkpoints were committed): their pins, and their epochs' metrics at their steps. A pin or a metric MLflow
    already has is never replaced. The folder names whose pins were added."""
    from mlflow.entities import Metric, RunTag

    if journal is None:
        return []
    known = pinned_digests(client.get_run(run_id).data.tags)
    missing = [entry for entry in journal.entries(run_id) if entry.checkpoint not in known]
    if not missing:
        return []
    steps: dict[str, set[int]] = {}
    metrics: list[Metric] = []
    timestamp = int(time.time() * 1000)
    for entry in missing:
        for key, value in entry.metrics.items():
            if key not in steps:
                steps[key] = {int(m.step) for m in client.get_metric_history(run_id, key)}
            if entry.step not in steps[key]:
                steps[key].add(entry.step)
                metrics.append(Metric(key, value, timestamp, entry.step))
    tags = [RunTag(pin_tag(entry.checkpoint), entry.sha256) for entry in missing]
    for start in range(0, max(len(tags), len(metrics)), 100):
        client.log_batch(run_id, metrics=metrics[start : start + 100], tags=tags[start : start + 100])
    return [entry.checkpoint for entry in missing]
