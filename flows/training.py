"""The training pipeline: prepare-data -> distributed-fit -> register-model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import State, flow, get_run_logger
from prefect.runtime import deployment, flow_run
from prefect.states import Cancelled
from pydantic import BaseModel, ConfigDict

from flows.continuation import already_continued, continuation_of, log_continuation, prepare_recovery
from flows.parameters import with_settings_as_parameters
from flows.run_settings import check_deployment_pins
from flows.stop_signals import note_run_key, send_again_a_stop_that_a_finalizer_swallowed
from raytrain_driver.fit_record import FitResult
from raytrain_driver.preflight import code_model_name, code_secret_keys
from raytrain_tasks.config import (
    TrainingConfig,
    config_from_parameters,
    new_run_key,
    non_default_settings,
)
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import install_log_redaction, redacted_errors, strip_credentials
from tasks.data import prepare_data
from tasks.fit import distributed_fit
from tasks.register import ModelRef, register_model
from tasks.run_page import publish_run_summary


class PipelineResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    run_key: str
    config: TrainingConfig
    # What your code's prepare wrote, or None: your code reads its own data.
    dataset: RunData | None
    fit: FitResult
    model: ModelRef | None


@flow(name="training-pipeline")
@with_settings_as_parameters
def training_pipeline(continue_flow_run: str | None = None, **settings: Any) -> PipelineResult | State:
    """Train a model on Ray and register it in MLflow; `resume` continues an interrupted run.

    Every training setting (`TrainingConfig`'s fields: workers, training, storage, MLflow and registry) is
    a parameter of its own: a deployment run that sets some keeps the deployment's values for the others.

    Args:
        continue_flow_run: Leave empty. Set by the deployment's crash trigger to the id of a Crashed run of this
            deployment: this run then continues that one from its last checkpoint, with its settings and run key
            (the other parameters are not used). A second run continuing the same crash ends Cancelled at once.
    """
    install_log_redaction("prefect", "prefect.flow_runs", "prefect.task_runs", "ray", "mlflow")
    send_again_a_stop_that_a_finalizer_swallowed()  # a cancelled served run is stopped with SIGTERM
    with redacted_errors():
        if continue_flow_run:
            if duplicate := already_continued(continue_flow_run):
                get_run_logger().warning(duplicate)
                return Cancelled(message=duplicate)
            continuation = continuation_of(continue_flow_run)
            log_continuation(continuation, continue_flow_run)
            config = continuation.config
        else:
            config = config_from_parameters(settings)
        check_deployment_pins(config, deployment.get_id(), flow_run.get_id())
        if not continue_flow_run:  # after the pins: a refused run imports none of its code
            shown = non_default_settings(config, code_secret_keys(config))
            get_run_logger().info("settings: %s", shown or "the defaults")
        return _pipeline(config)


def _pipeline(config: TrainingConfig) -> PipelineResult:
    if strip_credentials(config.mlflow_tracking_uri)[2]:
        get_run_logger().warning(
            "mlflow_tracking_uri carries a password: it is masked in everything this run writes, but Prefect keeps "
            "flow-run parameters as given. Put credentials in MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD "
            "(or MLFLOW_TRACKING_TOKEN) in the worker's environment instead"
        )
    config = config.resolved(Path.cwd(), os.environ, code_model_name(config))
    run_key = config.resume or new_run_key()
    note_run_key(run_key)  # a stop from now on names the command that continues this run
    prepare_recovery(run_key)
    get_run_logger().info(
        "run key %s (after a crash, continue it with resume=%s, or `prefect-raytrain resume %s`)",
        run_key,
        run_key,
        run_key,
    )
    dataset = prepare_data(config)
    fit = distributed_fit.with_options(retries=config.fit_retries, retry_delay_seconds=config.retry_delay_seconds)(
        config, dataset, run_key
    )
    if not config.register:
        result = PipelineResult(run_key=run_key, config=config, dataset=dataset, fit=fit, model=None)
        publish_run_summary(result)
        return result
    registered = register_model(config, dataset, fit, return_state=True)
    if not registered.is_completed():
        error = registered.result(raise_on_failure=False)
        result = PipelineResult(run_key=run_key, config=config, dataset=dataset, fit=fit, model=None)
        publish_run_summary(result, registry_error=str(error))
        raise error if isinstance(error, BaseException) else RuntimeError(f"register-model ended {registered.name}")
    result = PipelineResult(run_key=run_key, config=config, dataset=dataset, fit=fit, model=registered.result())
    publish_run_summary(result)
    return result


if __name__ == "__main__":
    from flows.cli import main

    raise SystemExit(main(training_pipeline))
