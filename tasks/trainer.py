"""The TorchTrainer the fit task launches (imported when a fit starts: it loads torch)."""

from __future__ import annotations

from typing import Any

from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback


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
