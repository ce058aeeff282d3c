"""What every phase of one fit works with, made once when the fit starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain_driver.lease import HeldLease
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.prepared import RunData
from raytrain_tasks.storage.locations import StorageLocation

if TYPE_CHECKING:
    from raytrain_tasks.api import TrainFunc


@dataclass(frozen=True)
class FitContext:
    """One fit of one run key: its settings, its data, where it lives, its code and its MLflow client."""

    config: TrainingConfig
    dataset: RunData | None  # what prepare-data stored; None: the code reads its own data
    run_key: str
    runs: StorageLocation  # <storage>/runs: Ray Train's storage_path
    origin: Mapping[str, str]  # the MLflow run's name and the tags that lead back to the Prefect flow run
    spec: TrainFunc
    client: Any  # MlflowClient
    lease: HeldLease | None = None  # None where no lease is held (a test calling a phase alone)

    @property
    def run_dir(self) -> StorageLocation:
        """<storage>/runs/<run key>: the run's checkpoints and records."""
        return self.runs.child(self.run_key)
