"""The sweep flow's task (flows/sweep.py): tune-trials runs every trial on Ray Tune under the sweep's MLflow run
(raytrain_driver.sweep_run). Not retried: a sweep started again with its sweep key keeps its finished trials."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from raytrain_driver.hooks import RunHooks, run_hooks
from raytrain_driver.sweep_run import SweepOutcome, run_sweep
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import redacted_errors


@task(name="tune-trials", task_run_name="sweep-{sweep_key}", cache_policy=NONE)
def tune_trials(
    config: TrainingConfig,
    search: dict[str, Any],
    dataset: RunData | None,
    sweep_key: str,
    trials: int,
    grace_period: int,
) -> SweepOutcome:
    """Every trial of the sweep; the best finished trial's fit, for register-model."""
    with redacted_errors(), run_hooks(RunHooks(get_run_logger())):
        return run_sweep(config, search, dataset, sweep_key, trials, grace_period)
