"""The `sweep` flow's driver side: refuse a search no trial could train with, open the sweep's MLflow run, run the
trials on Ray Tune (raytrain_driver.tuning), record how each ended, and hand the best finished trial's fit to the
same register-model gate as a nightly run: one registered version per sweep, never one per trial."""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from raytrain_driver.cluster import ray_session
from raytrain_driver.fit_record import FitResult, finished_fit
from raytrain_driver.preflight import resolve_code
from raytrain_driver.search_space import Dimension, check_every_value, parse_search
from raytrain_driver.tuning import SWEEP_TAG, SweepPlan, Trial, best_trial, run_trials, trial_config
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.prepared import RunData
from raytrain_tasks.storage.locations import RUNS_DIR, locate
from raytrain_tasks.tracking import runs as tracking

logger = logging.getLogger(__name__)

STOPPED_TAG = "prefect_raytrain.sweep.stopped"  # on a trial's MLflow run that ASHA (or a failure) ended early
PARENT_ROLE = {"prefect_raytrain.sweep.role": "sweep"}  # the sweep's own MLflow run, beside its trials' (same key)


class SweepOutcome(BaseModel):
    """How the sweep's trials ended, and the best finished one's fit (None: no trial finished)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    sweep_key: str
    parent_run_id: str
    trials: list[dict[str, Any]]
    best_run_key: str | None = None
    best_settings: dict[str, Any] = {}
    best_fit: FitResult | None = None


def plan_search(config: TrainingConfig, search: dict[str, Any] | str) -> tuple[Dimension, ...]:
    """The search's dimensions, every value they can take checked against the settings and the code's own; a
    SettingsError naming `search` otherwise, before anything starts."""
    from raytrain_tasks.code_settings import code_values

    if config.checkpoint_every_steps or config.checkpoint_every_minutes:
        raise SettingsError(
            "a sweep's trials report every epoch to Ray Tune, whose ASHA counts reports: set checkpoint_every_steps "
            "and checkpoint_every_minutes to 0 for a sweep"
        )
    dimensions = parse_search(search, frozenset(TrainingConfig.model_fields))
    spec = resolve_code(config)
    base = config.model_dump()

    def check(settings: dict[str, Any], code: dict[str, Any]) -> None:
        trial = TrainingConfig.model_validate({**base, **settings, "train_config": {**config.train_config, **code}})
        code_values(spec, trial.train_config, trial.train_code)

    check_every_value(dimensions, check)
    return dimensions


def run_sweep(
    config: TrainingConfig,
    search: dict[str, Any] | str,
    dataset: RunData | None,
    sweep_key: str,
    trials: int,
    grace_period: int,
) -> SweepOutcome:
    """The sweep's trials, recorded under its MLflow run; the best finished trial's fit."""
    dimensions = plan_search(config, search)
    spec = resolve_code(config)
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    experiment_id = tracking.ensure_experiment(
        client, config.experiment_name, config.mlflow_tracking_uri, config.storage_path
    )
    parent_run_id = _open_sweep_run(client, experiment_id, sweep_key, search, trials, grace_period)
    plan = SweepPlan(config.model_dump(), dimensions, dataset, sweep_key, parent_run_id)
    metric = spec.selection
    try:
        with ray_session(config):
            ended = run_trials(plan, trials, grace_period, metric.name, metric.higher_is_better)
    except BaseException as exc:
        tracking.fail_run(client, parent_run_id, exc)
        raise
    _mark_stopped(client, experiment_id, ended)
    best = best_trial(ended, metric.higher_is_better)
    rows = [
        {**t.settings, "run_key": t.run_key, "epochs": t.epochs, metric.name: t.score, "finished": t.finished}
        for t in ended
    ]
    client.log_text(parent_run_id, json.dumps(rows, indent=1), "sweep/trials.json")
    if best is None:
        client.set_tag(parent_run_id, "prefect_raytrain.sweep.best", "none: no trial trained every epoch")
        tracking.finish_run(client, parent_run_id)
        return SweepOutcome(sweep_key=sweep_key, parent_run_id=parent_run_id, trials=rows)
    runs = locate(config.storage_path, config.storage_options).child(RUNS_DIR)
    fit = finished_fit(runs.child(best.run_key), client, experiment_id, best.run_key)
    client.set_tag(parent_run_id, "prefect_raytrain.sweep.best", f"{best.run_key}: {metric.name}={best.score}")
    return SweepOutcome(
        sweep_key=sweep_key,
        parent_run_id=parent_run_id,
        trials=rows,
        best_run_key=best.run_key,
        best_settings=best.settings,
        best_fit=fit,
    )


def best_trial_config(config: TrainingConfig, search: dict[str, Any] | str, outcome: SweepOutcome) -> TrainingConfig:
    """The settings the best trial trained with, registering as the sweep asks."""
    plan = SweepPlan(config.model_dump(), parse_search(search, frozenset(TrainingConfig.model_fields)), None, "", "")
    return trial_config(plan, outcome.best_settings).model_copy(update={"register": config.register})


def close_sweep_run(config: TrainingConfig, outcome: SweepOutcome, registered: str) -> None:
    """The sweep's MLflow run: what was registered from it (or why nothing), then FINISHED."""
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    client.set_tag(outcome.parent_run_id, "prefect_raytrain.sweep.registered", registered[:4000])
    tracking.finish_run(client, outcome.parent_run_id)


def _open_sweep_run(
    client: Any, experiment_id: str, sweep_key: str, search: Any, trials: int, grace_period: int
) -> str:
    """The sweep's MLflow run: found by its sweep key (a restored sweep), or made."""
    ((role, value),) = PARENT_ROLE.items()
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_key}' and tags.`{role}` = '{value}'"
    )
    if found:
        client.update_run(found[0].info.run_id, status="RUNNING")
        return str(found[0].info.run_id)
    from mlflow.entities import Param

    text = search if isinstance(search, str) else json.dumps(search)
    run = client.create_run(experiment_id, run_name=f"sweep {sweep_key}", tags={SWEEP_TAG: sweep_key, **PARENT_ROLE})
    params = {"search": text[:6000], "trials": trials, "grace_period": grace_period}
    client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])
    return str(run.info.run_id)


def _mark_stopped(client: Any, experiment_id: str, ended: list[Trial]) -> None:
    """A trial ASHA stopped (its actor was ended mid-fit) left its MLflow run RUNNING: say how it ended."""
    for trial in ended:
        if trial.finished or not trial.trial_id:
            continue
        run = tracking.find_run(client, experiment_id, trial.run_key)
        if run is None or run.info.status != "RUNNING":
            continue
        client.set_tag(run.info.run_id, STOPPED_TAG, f"stopped by the sweep's ASHA after {trial.epochs} epochs")
        client.set_terminated(run.info.run_id, status="KILLED")
