"""The TorchTrainer the fit task launches (imported when a fit starts: it loads torch), and what the project
reads of Ray Train's private modules: this file is their one adapter."""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


class RunTrainer(TorchTrainer):
    """TorchTrainer that starts Ray Data's per-run actor only for runs that pass Ray Datasets.

    Ray Train 2.60 creates a DatasetManager actor for every worker group, datasets or not, and the workers wait
    for it: one more process to start (about 4.5 s on 2 cores) at the first start and after every worker
    failure. With the torch DataLoader nothing ever asks it for a shard.
    """

    def _create_default_callbacks(self) -> list[Any]:
        # mypy resolves ray.train.torch to the V1 classes; V2 (which has this method) is used at runtime.
        callbacks: list[Any] = super()._create_default_callbacks()  # type: ignore[misc]
        if self.datasets:
            return callbacks
        return [callback for callback in callbacks if not isinstance(callback, DatasetsCallback)]


def waited_for_resources(exc: BaseException) -> WorkerGroupStartupTimeoutError | None:
    """The timeout when a fit failed because its worker group could not get its CPUs/GPUs in time (a node
    lost, a fixed worker count larger than what is left); None for any other failure."""
    cause = getattr(exc, "controller_failure", None)
    return cause if isinstance(cause, WorkerGroupStartupTimeoutError) else None
