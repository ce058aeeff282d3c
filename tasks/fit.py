"""distributed-fit: the Prefect task that trains one run key (raytrain_driver/fit.py), here or as a Ray Job on
the cluster.

It hands the driver this task run's logger and run page, and the tags that lead back to the flow run; it decides
which failures Prefect retries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.settings import PREFECT_HOME

from raytrain_driver.fit_record import FitResult
from raytrain_driver.hooks import EpochView, Logger, RunHooks, run_hooks
from raytrain_driver.origin import ENTRY_POINT
from raytrain_tasks.config import TrainingConfig, check_run_key
from raytrain_tasks.errors import (
    CheckpointError,
    ClusterError,
    DatasetError,
    NodeStorageError,
    RepeatedFailureError,
    RunLeaseError,
    SettingsError,
    TrackingError,
    UserCodeError,
)
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import redacted_errors
from raytrain_tasks.storage.locations import RUNS_DIR, locate
from tasks.run_page import EpochProgress

# Failures that another attempt cannot fix: the config or the environment must change first.
# RunLeaseError: another live driver holds the run; a retry seconds later would only be refused again.
# UserCodeError: train_code does not import, or is not what the pipeline needs; the code must change.
# NodeStorageError: a Ray node cannot use the storage with its own credentials; its setup must change.
# RepeatedFailureError: the training raised the same exception twice in a row (raytrain_tasks.failures).
NOT_RETRYABLE = (
    DatasetError,
    ClusterError,
    CheckpointError,
    TrackingError,
    RunLeaseError,
    UserCodeError,
    NodeStorageError,
    RepeatedFailureError,
    SettingsError,
)


def is_retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry training failures, not configuration problems."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, NOT_RETRYABLE)


def _run_page(client: Any, run_id: str, epochs: int, logger: Logger, view: EpochView) -> EpochProgress:
    """The task run's progress artifact, following the fit's committed epochs."""
    return EpochProgress(client, run_id, epochs, logger, view)


def prefect_origin(run_key: str) -> dict[str, str]:
    """The MLflow run's name and the tags that lead back to the Prefect flow run, taken here, in the Prefect run
    (a Ray Job that trains for it has no Prefect context)."""
    from prefect.runtime import deployment, flow_run
    from prefect.utilities.urls import url_for

    name = flow_run.get_name()
    origin = {"run_name": f"{name}-{run_key}" if name else run_key}
    # MLflow's own source tags: the UI's "Source" column and run page show the entry point, not "—".
    origin["mlflow.source.type"] = "JOB"
    origin["mlflow.source.name"] = ENTRY_POINT
    if flow_run.get_id():
        origin["prefect.flow_run_id"] = str(flow_run.get_id())
        ui_url = url_for("flow-run", obj_id=str(flow_run.get_id()))  # the UI's route, as Prefect's "View at" log
        if ui_url and ui_url.startswith(("http://", "https://")):  # the temporary server has no UI URL
            origin["prefect.flow_run_url"] = ui_url
    if deployment.get_name():
        origin["prefect.deployment_name"] = str(deployment.get_name())
    return origin


@task(
    name="distributed-fit",
    task_run_name="fit-{run_key}",
    cache_policy=NONE,
    retry_condition_fn=is_retryable,
)
def distributed_fit(config: TrainingConfig, dataset: RunData | None, run_key: str) -> FitResult:
    """Train (or continue training) run ``run_key`` and return its best checkpoint and metrics."""
    with redacted_errors(), run_hooks(RunHooks(get_run_logger(), _run_page, Path(PREFECT_HOME.value()))):
        check_run_key(run_key)  # it names a folder in storage and goes into MLflow filters
        runs = locate(config.storage_path, config.storage_options).child(RUNS_DIR)
        origin = prefect_origin(run_key)
        if config.launch_mode == "ray_job":
            from raytrain_driver.ray_job import fit_as_ray_job

            # The job takes the run's lease itself (fit_in_this_process, run by raytrain_driver/fit_job.py there).
            return fit_as_ray_job(config, dataset, run_key, runs, origin)
        from raytrain_driver.fit import fit_in_this_process  # Ray Train's modules: not on the CLI's way in

        return fit_in_this_process(config, dataset, run_key, runs, origin)
