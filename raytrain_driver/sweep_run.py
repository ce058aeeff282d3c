"""The `sweep` flow's driver side: refuse a search no trial could train with, open the sweep's MLflow run, run the
trials on Ray Tune (raytrain_driver.tuning), record how each ended, and hand the best finished trial's fit to the
same register-model gate as a nightly run: one registered version per sweep, never one per trial."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

from raytrain_driver.cluster import ray_session
from raytrain_driver.fit_record import FitResult, finished_fit
from raytrain_driver.preflight import resolve_code
from raytrain_driver.search_space import Dimension, check_every_value, parse_search, unknown_key_refusal
from raytrain_driver.tuning import SWEEP_TAG, SweepPlan, Trial, best_trial, run_trials, trial_config
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import redact
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


def plan_search(config: TrainingConfig, search: dict[str, Any] | str, grace_period: int = 1) -> tuple[Dimension, ...]:
    """The search's dimensions, every value they can take checked against the settings and the code's own; a
    SettingsError naming `search` (or the setting) otherwise, before anything starts."""
    from raytrain_tasks.code_settings import code_values, secret_keys, setting_names

    for refusal in _sweep_refusals(config, grace_period):
        raise SettingsError(refusal)
    spec = resolve_code(config)
    dimensions = parse_search(search, frozenset(TrainingConfig.model_fields), secret_keys(spec.settings))
    declared = spec.settings  # the code's settings class: it declares every key; plain defaults do not
    code_keys = tuple(setting_names(declared, declared.__name__) if declared is not None else spec.defaults)
    for dimension in dimensions:
        if dimension.in_code and (refusal := unknown_key_refusal(dimension.name, code_keys, declared is not None)):
            raise SettingsError(refusal)
    base = config.model_dump()

    def check(settings: dict[str, Any], code: dict[str, Any]) -> None:
        trial = TrainingConfig.model_validate({**base, **settings, "train_config": {**config.train_config, **code}})
        code_values(spec, trial.train_config, trial.train_code)

    check_every_value(dimensions, check)
    return dimensions


def _sweep_refusals(config: TrainingConfig, grace_period: int) -> list[str]:
    """What a sweep's own settings cannot be (each trial reports one epoch at a time to ASHA, and gets a fixed
    share of the cluster)."""
    refusals = []
    if config.checkpoint_every_steps or config.checkpoint_every_minutes:
        refusals.append(
            "a sweep's trials report every epoch to Ray Tune, whose ASHA counts reports: set checkpoint_every_steps "
            "and checkpoint_every_minutes to 0 for a sweep"
        )
    if grace_period >= config.epochs:
        refusals.append(
            f"grace_period {grace_period} must be below epochs {config.epochs}: ASHA can only stop a trial before "
            "its last epoch"
        )
    if config.max_workers > config.num_workers:
        refusals.append("a sweep's trials have a fixed number of workers: set max_workers to 0 for a sweep")
    if config.resume:
        refusals.append("resume continues one run; a sweep is continued with sweep_key (--sweep-key)")
    return refusals


def run_sweep(
    config: TrainingConfig,
    search: dict[str, Any] | str,
    dataset: RunData | None,
    sweep_key: str,
    trials: int,
    grace_period: int,
) -> SweepOutcome:
    """The sweep's trials, recorded under its MLflow run; the best finished trial's fit."""
    dimensions = plan_search(config, search, grace_period)
    spec = resolve_code(config)
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    experiment_id = tracking.ensure_experiment(
        client, config.experiment_name, config.mlflow_tracking_uri, config.storage_path
    )
    given = {"search": _search_text(search), "trials": str(trials), "grace_period": str(grace_period)}
    parent_run_id = _open_sweep_run(client, experiment_id, sweep_key, given)
    metric = spec.selection
    try:
        with ray_session(config):
            plan = SweepPlan(_trials_settings(config), dimensions, dataset, sweep_key, parent_run_id)
            ended = run_trials(plan, trials, grace_period, metric.name, metric.higher_is_better)
        runs = locate(config.storage_path, config.storage_options).child(RUNS_DIR)
        fits = {t.run_key: finished_fit(runs.child(t.run_key), client, experiment_id, t.run_key) for t in ended}
        # Finished is what the fit recorded, not what Tune counted (a restored sweep's counts start again).
        ended = [_as_recorded(t, fits.get(t.run_key), metric.name) for t in ended]
        _mark_stopped(client, experiment_id, sweep_key, ended)
        best = best_trial(ended, metric.higher_is_better)
        rows = [_row(t, metric.name) for t in ended]
        client.log_text(parent_run_id, redact(json.dumps(rows, indent=1)), "sweep/trials.json")
    except BaseException as exc:
        _end_parent(client, parent_run_id, exc)
        raise
    if best is None:
        client.set_tag(parent_run_id, "prefect_raytrain.sweep.best", "none: no trial trained every epoch")
        return SweepOutcome(sweep_key=sweep_key, parent_run_id=parent_run_id, trials=rows)
    client.set_tag(parent_run_id, "prefect_raytrain.sweep.best", f"{best.run_key}: {metric.name}={best.score}")
    return SweepOutcome(
        sweep_key=sweep_key,
        parent_run_id=parent_run_id,
        trials=rows,
        best_run_key=best.run_key,
        best_settings=best.settings,
        best_fit=fits[best.run_key],
    )


def _trials_settings(config: TrainingConfig) -> dict[str, Any]:
    """The settings every trial starts from: the sweep's, each worker's CPUs pinned (a trial sized to the whole
    cluster would wait for CPUs the other trials hold)."""
    return config.model_copy(update={"cpus_per_worker": config.cpus_per_worker or 1.0}).model_dump()


def _as_recorded(trial: Trial, fit: FitResult | None, metric: str) -> Trial:
    if fit is None:
        return dataclasses.replace(trial, finished=False)
    score = fit.best_metrics.get(metric)
    return dataclasses.replace(trial, finished=True, epochs=fit.epochs_completed, score=score)


def _row(trial: Trial, metric: str) -> dict[str, Any]:
    return {
        **trial.settings,
        "run_key": trial.run_key,
        "epochs": trial.epochs,
        metric: trial.score,
        "finished": trial.finished,
        "ended": trial.ended,
    }


def _search_text(search: dict[str, Any] | str) -> str:
    return search if isinstance(search, str) else json.dumps(search, sort_keys=True)


def _end_parent(client: Any, run_id: str, exc: BaseException) -> None:
    from raytrain_driver.hooks import stopped_by

    if (why := stopped_by(exc)) is not None:
        tracking.stop_run(client, run_id, f"stopped by {why}: continue it with its sweep key", exc)
    else:
        tracking.fail_run(client, run_id, exc)


def best_trial_config(config: TrainingConfig, search: dict[str, Any] | str, outcome: SweepOutcome) -> TrainingConfig:
    """The settings the best trial trained with, registering as the sweep asks."""
    plan = SweepPlan(config.model_dump(), parse_search(search, frozenset(TrainingConfig.model_fields)), None, "", "")
    return trial_config(plan, outcome.best_settings).model_copy(update={"register": config.register})


def close_sweep_run(config: TrainingConfig, outcome: SweepOutcome, registered: str) -> None:
    """The sweep's MLflow run: what was registered from it (or why nothing), then FINISHED."""
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    client.set_tag(outcome.parent_run_id, "prefect_raytrain.sweep.registered", registered[:4000])
    tracking.finish_run(client, outcome.parent_run_id)


def fail_sweep_run(config: TrainingConfig, outcome: SweepOutcome, exc: BaseException) -> None:
    """The sweep's MLflow run when what follows its trials failed (the gate, a refused best trial)."""
    _end_parent(tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url), outcome.parent_run_id, exc)


def _open_sweep_run(client: Any, experiment_id: str, sweep_key: str, given: dict[str, str]) -> str:
    """The sweep's MLflow run: found by its sweep key (a continued sweep, which must be given as it started), or
    made."""
    ((role, value),) = PARENT_ROLE.items()
    found = client.search_runs(
        [experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{sweep_key}' and tags.`{role}` = '{value}'"
    )
    if found:
        logged = found[0].data.params
        changed = [name for name, text in given.items() if logged.get(name) not in (None, text[:6000])]
        if changed:
            raise SettingsError(
                f"sweep_key {sweep_key} started with another {', '.join(changed)}: continue it with the values it "
                "started with (its MLflow run's params), or start a new sweep without sweep_key"
            )
        client.update_run(found[0].info.run_id, status="RUNNING")
        return str(found[0].info.run_id)
    from mlflow.entities import Param

    run = client.create_run(experiment_id, run_name=f"sweep {sweep_key}", tags={SWEEP_TAG: sweep_key, **PARENT_ROLE})
    params = [Param(name, redact(text)[:6000]) for name, text in given.items()]
    client.log_batch(run.info.run_id, params=params)
    return str(run.info.run_id)


def _mark_stopped(client: Any, experiment_id: str, sweep_key: str, ended: list[Trial]) -> None:
    """Every trial that did not train every epoch says how it ended on its MLflow run (KILLED): stopped by ASHA,
    or failed. Its process was ended mid-fit, so its run may be RUNNING still, or marked KILLED by a later fit on
    the same machine that found its driver gone."""
    for trial in ended:
        if trial.finished:
            continue
        run = tracking.find_run(client, experiment_id, trial.run_key)
        if run is None or run.data.tags.get(SWEEP_TAG) != sweep_key:
            continue
        how = "stopped by the sweep's ASHA" if trial.ended == "stopped" else f"ended: {trial.ended}"
        client.set_tag(run.info.run_id, STOPPED_TAG, f"{how} after {trial.epochs} epochs")
        if run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, status="KILLED")
