"""prepare-data: the Prefect task that writes (or reuses) the run's content-addressed dataset version
(raytrain_driver/dataset.py)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from raytrain_driver.dataset import prepare_dataset
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.data import DatasetRef
from raytrain_tasks.redact import redacted_errors


@task(name="prepare-data", cache_policy=NONE)
def prepare_data(config: TrainingConfig) -> DatasetRef:
    """Write (or reuse) the prepared dataset version for this config and return where it is."""
    logger = get_run_logger()
    with redacted_errors():
        dataset = prepare_dataset(config)
    logger.info(
        "dataset %s: %d train / %d val / %d test rows, %d features, %d classes at %s",
        dataset.content_hash,
        dataset.train_rows,
        dataset.val_rows,
        dataset.test_rows,
        dataset.num_features,
        dataset.num_classes,
        dataset.uri,
    )
    return dataset
