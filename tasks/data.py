"""prepare-data: the Prefect task that checks the run's storage (for every code) and writes (or reuses) the run's
content-addressed dataset version: what your code's ``prepare`` writes (raytrain_driver/user_data.py). It has no
retries: what it finds wrong needs a setting changed."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from raytrain_driver.preflight import resolve_code
from raytrain_driver.user_data import prepare_user_data
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import redacted_errors


@task(name="prepare-data", cache_policy=NONE)
def prepare_data(config: TrainingConfig) -> RunData | None:
    """Check the run's storage, then write (or reuse) the prepared dataset version for this config and return
    where it is; None for your own code without ``prepare`` (it reads its data where it is)."""
    logger = get_run_logger()
    with redacted_errors():
        spec = resolve_code(config)
        data = prepare_user_data(config, spec)
    if data is None:
        logger.info("train_code %s has no prepare: it reads its own data", config.train_code)
    else:
        logger.info("%s", data.describe())
    return data
