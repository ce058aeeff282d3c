"""The sweep pipeline: prepare-data -> tune-trials (every trial the pipeline's own fit, on Ray Tune, with ASHA) ->
register-model of the best finished trial, through the same gate as a nightly run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.runtime import deployment, flow_run
from pydantic import BaseModel, ConfigDict, Field

from flows.parameters import with_settings_as_parameters
from flows.run_settings import check_deployment_pins
from raytrain_driver.preflight import code_model_name
from raytrain_driver.sweep_run import SweepOutcome, best_trial_config, close_sweep_run, fail_sweep_run, plan_search
from raytrain_tasks.config import RUN_KEY_PATTERN, config_from_parameters, new_run_key
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.redact import install_log_redaction, redacted_errors
from raytrain_tasks.settings import JsonObject
from tasks.data import prepare_data
from tasks.register import ModelRef, register_model
from tasks.sweep import tune_trials


class SweepResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    outcome: SweepOutcome
    model: ModelRef | None


@flow(name="sweep")
@with_settings_as_parameters
def sweep_pipeline(
    search: JsonObject,
    trials: Annotated[int, Field(ge=1, le=1000)] = 4,
    grace_period: Annotated[int, Field(ge=1)] = 1,
    sweep_key: str = "",
    **settings: Any,
) -> SweepResult:
    """Search hyperparameters with Ray Tune: each trial is this pipeline's fit; the best finished trial's model goes
    through the promotion gate, one registered version per sweep.

    Args:
        search: The settings and train_config keys to vary, e.g. {"learning_rate": {"loguniform": [1e-4, 1e-1]},
            "hidden": [32, 64]}: a list draws one of its values; {"grid": [...]} tries each; uniform, loguniform
            and randint take [low, high].
        trials: How many draws of the search (each value of a grid that many times).
        grace_period: The epochs every trial trains before ASHA may stop it.
        sweep_key: Leave empty for a new sweep. A killed sweep's key continues it: finished trials are kept.
    """
    install_log_redaction("prefect", "prefect.flow_runs", "prefect.task_runs", "ray", "mlflow")
    with redacted_errors():
        config = config_from_parameters(settings)
        check_deployment_pins(config, deployment.get_id(), flow_run.get_id())
        config = config.resolved(Path.cwd(), os.environ, code_model_name(config))
        if sweep_key and not RUN_KEY_PATTERN.fullmatch(sweep_key):
            raise SettingsError(f"sweep_key {sweep_key!r} is not a sweep key (YYYYMMDD-HHMMSS-xxxxxx)")
        sweep_key = sweep_key or new_run_key()
        plan_search(config, search, grace_period)  # before any data is prepared: a search no trial could train with
        get_run_logger().info("sweep key %s (continue it with sweep_key=%s)", sweep_key, sweep_key)
    dataset = prepare_data(config)
    outcome = tune_trials(config, search, dataset, sweep_key, trials, grace_period)
    try:
        if outcome.best_fit is None:
            close_sweep_run(config, outcome, "nothing: no trial trained every epoch")
            return SweepResult(outcome=outcome, model=None)
        best = best_trial_config(config, search, outcome)
        if not best.register:
            close_sweep_run(config, outcome, "nothing: register is off")
            return SweepResult(outcome=outcome, model=None)
        model = register_model(best, dataset, outcome.best_fit)
    except BaseException as exc:
        fail_sweep_run(config, outcome, exc)  # not left RUNNING
        raise
    close_sweep_run(config, outcome, f"{model.name} version {model.version}: {model.decision} ({model.reason})")
    return SweepResult(outcome=outcome, model=model)
