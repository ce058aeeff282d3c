"""A sweep on Ray Tune (the `sweep` flow): every trial is the pipeline's own fit (``fit_in_this_process``) with
the settings its search drew: its N DDP workers, its checkpoints in the run's storage, its MLflow run, nested under
the sweep's. Each epoch's report reaches Tune (Ray Train's ``TuneReportCallback``), and ASHA stops the trials
that fall behind on the code's metric, in its direction.

A trial's run key follows from the sweep key and its trial id, so a sweep killed midway and started again with
the same sweep key (``Tuner.restore``) keeps its finished trials and continues the others from their last
checkpoint, each in its own MLflow run.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from raytrain_driver.search_space import Dimension, trial_overrides, tune_space
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.prepared import RunData
from raytrain_tasks.storage.locations import RUNS_DIR, StorageLocation, locate
from raytrain_tasks.tracking import runs as tracking
from raytrain_tasks.tracking.names import epoch_number

logger = logging.getLogger(__name__)

SWEEPS_DIR = "sweeps"  # <storage>/sweeps/<sweep key>: Ray Tune's record of the sweep
SWEEP_TAG = "prefect_raytrain.sweep"  # on the sweep's MLflow run and on each trial's: the sweep key
TRIAL_TAG = "prefect_raytrain.sweep.trial"  # on a trial's MLflow run: its Tune trial id
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a trial's run under the sweep's


@dataclass(frozen=True)
class SweepPlan:
    """What every trial needs, the same for all: the sweep's settings, what it searches, its data, its records."""

    config: dict[str, Any]  # the sweep's TrainingConfig, dumped (resolved: absolute storage, concrete tracking URI)
    dimensions: tuple[Dimension, ...]
    dataset: RunData | None
    sweep_key: str
    parent_run_id: str


@dataclass(frozen=True)
class Trial:
    """One trial as the sweep left it."""

    trial_id: str
    run_key: str
    settings: dict[str, Any]
    epochs: int  # the epochs it reported to Tune (its fit's record says, once it finished)
    score: float | None  # its best value of the code's metric
    finished: bool  # it trained every epoch (not stopped by ASHA, not failed)
    ended: str = ""  # as Tune saw it: "completed", "stopped" (by ASHA), or "failed: <the error>"


def trial_run_key(sweep_key: str, trial_id: str) -> str:
    """A trial's run key: the sweep key's time, and 6 hex digits of the sweep key and the trial id; the same for
    the trial of a restored sweep."""
    digest = hashlib.sha256(f"{sweep_key}/{trial_id}".encode()).hexdigest()[:6]
    return f"{sweep_key[:15]}-{digest}"


def trial_config(plan: SweepPlan, drawn: dict[str, Any]) -> TrainingConfig:
    """The trial's settings: the sweep's, with the values ``drawn`` for it; it never registers (the sweep does)."""
    settings, code = trial_overrides(plan.dimensions, drawn)
    base = plan.config
    return TrainingConfig.model_validate(
        {**base, **settings, "train_config": {**base["train_config"], **code}, "register": False}
    )


def run_trial(tune_config: dict[str, Any], plan: SweepPlan) -> None:
    """A trial, in its Ray Tune actor: the pipeline's fit of the drawn settings, reporting each epoch to Tune."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_driver.fit import fit_in_this_process
    from raytrain_driver.hooks import RunHooks, run_hooks, run_logger

    trial_id = ray.tune.get_context().get_trial_id()
    config = trial_config(plan, {d.name: tune_config[d.name] for d in plan.dimensions})
    run_key = trial_run_key(plan.sweep_key, trial_id)
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    experiment = client.get_experiment_by_name(config.experiment_name)
    earlier = None if experiment is None else tracking.find_run(client, experiment.experiment_id, run_key)
    if earlier is not None:
        if earlier.data.tags.get(TRIAL_TAG) != trial_id:
            raise RuntimeError(f"trial {trial_id}'s run key {run_key} is another trial's: run the sweep again")
        config = config.model_copy(update={"resume": run_key})  # a restored sweep: on from its last checkpoint
    origin = {
        "run_name": f"{run_key} ({plan.sweep_key} trial {trial_id})",  # the console and trials.json name run keys
        PARENT_TAG: plan.parent_run_id,
        SWEEP_TAG: plan.sweep_key,
        TRIAL_TAG: trial_id,
    }
    runs = locate(config.storage_path, config.storage_options).child(RUNS_DIR)
    hooks = RunHooks(run_logger(), controller_callbacks=(TuneReportCallback(),), ended_from_outside=True)
    with run_hooks(hooks):
        fit_in_this_process(config, plan.dataset, run_key, runs, origin)


def sweeps_location(config: TrainingConfig) -> StorageLocation:
    return locate(config.storage_path, config.storage_options).child(SWEEPS_DIR)


def run_trials(plan: SweepPlan, trials: int, grace_period: int, metric: str, higher_is_better: bool) -> list[Trial]:
    """Every trial of the sweep (``trials`` draws of the search; a grid's values each), at most as many at once as
    the cluster's CPUs hold; the ones a killed attempt of the sweep finished are kept, the others go on."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    config = TrainingConfig.model_validate(plan.config)
    # Ctrl-C stops the sweep (a KeyboardInterrupt, as anywhere else), not only Tune's loop: with Tune's own
    # handler, fit() returned normally and the half-run sweep was registered as if complete.
    os.environ.setdefault("TUNE_DISABLE_SIGINT_HANDLER", "1")
    # Tune's newer console output prints its configuration box and a TensorBoard hint even at verbose=0; the older
    # one prints nothing there. The sweep's progress is trial_lines': one line per trial epoch.
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    where = sweeps_location(config)
    # The trial itself holds no CPU: its Ray Train workers take them. (Ray Tune refuses an empty request.)
    trainable = tune.with_resources(tune.with_parameters(run_trial, plan=plan), {"cpu": 0, "memory": 1})
    path = where.child(plan.sweep_key)
    if tune.Tuner.can_restore(path.path, storage_filesystem=where.filesystem):
        logger.info("sweep %s: continuing its unfinished trials; its finished trials are kept", plan.sweep_key)
        tuner = tune.Tuner.restore(
            path.path, trainable, resume_unfinished=True, resume_errored=True, storage_filesystem=where.filesystem
        )
    else:
        at_once = _trials_at_once(config, ray.cluster_resources())
        mode = "max" if higher_is_better else "min"
        # A trial ends itself after its last epoch, its record written: every rung lies before the last epoch, and
        # a trial that reaches max_t is not stopped (that would end its process mid-way through its last steps).
        scheduler = ASHAScheduler(max_t=config.epochs, grace_period=grace_period, stop_last_trials=False)
        tuner = tune.Tuner(
            trainable,
            param_space=tune_space(plan.dimensions),
            tune_config=tune.TuneConfig(
                metric=metric, mode=mode, num_samples=trials, max_concurrent_trials=at_once, scheduler=scheduler
            ),
            run_config=tune.RunConfig(
                name=plan.sweep_key,
                storage_path=where.path,
                storage_filesystem=where.filesystem,
                verbose=0,
                callbacks=[trial_lines(plan.sweep_key, metric, config.epochs)],
                # A failed trial is tried again as a nightly fit is (fit_retries), from its last checkpoint.
                failure_config=tune.FailureConfig(max_failures=config.fit_retries),
            ),
        )
    grid = tuner.fit()
    return [_trial_of(plan, grid[index], metric, higher_is_better, config.epochs) for index in range(len(grid))]


def trial_line(run_key: str, result: dict[str, Any], metric: str, epochs: int) -> str:
    """A trial's epoch on the console: ``trial <run key> epoch 2/3: val_accuracy=0.9123``."""
    index = result.get("epoch")  # the 0-based index a fit reports; Tune's own count of reports otherwise
    epoch = epoch_number(index) if isinstance(index, int | float) else result.get("training_iteration", "?")
    value = result.get(metric)
    shown = f"{value:.4g}" if isinstance(value, int | float) else "?"
    return f"trial {run_key} epoch {epoch}/{epochs}: {metric}={shown}"


def trial_lines(sweep_key: str, metric: str, epochs: int) -> Any:
    """Ray Tune's callback on the sweep's driver: each epoch a trial reports goes to the run's log (the console,
    Prefect), as a nightly fit's epochs do; Tune itself stays quiet (verbose=0)."""
    from ray.tune import Callback

    class TrialLines(Callback):  # type: ignore[misc]
        def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
            from raytrain_driver.hooks import run_logger

            # The logger of the task running now: Tune keeps this callback in the sweep's record, and a continued
            # sweep (Tuner.restore) calls the kept one, so a logger taken when it was made would be the killed run's.
            run_logger().info(trial_line(trial_run_key(sweep_key, trial.trial_id), result, metric, epochs))

    return TrialLines()


def _trials_at_once(config: TrainingConfig, resources: dict[str, float]) -> int:
    """How many trials the cluster holds at once: each has num_workers workers of cpus_per_worker (and a GPU
    each, where use_gpu)."""
    at_once = int(resources.get("CPU", 1.0) // (config.num_workers * (config.cpus_per_worker or 1.0)))
    if config.use_gpu:
        at_once = min(at_once, int(resources.get("GPU", 0.0) // config.num_workers))
    return max(1, at_once)


def _trial_of(plan: SweepPlan, result: Any, metric: str, higher_is_better: bool, epochs: int) -> Trial:
    trial_id = str((result.metrics or {}).get("trial_id") or "")  # none: it never reported
    frame = result.metrics_dataframe
    scores = [] if frame is None or metric not in frame else [float(v) for v in frame[metric].dropna()]
    best = (max(scores) if higher_is_better else min(scores)) if scores else None
    settings = {d.name: result.config.get(d.name) for d in plan.dimensions}
    reported = 0 if frame is None else len(frame)
    if result.error is not None:
        ended = f"failed: {str(result.error).strip().splitlines()[-1][:300] if str(result.error).strip() else ''}"
    else:
        ended = "completed" if reported >= epochs else "stopped"
    return Trial(
        trial_id=trial_id,
        run_key=trial_run_key(plan.sweep_key, trial_id),
        settings=settings,
        epochs=reported,
        score=best,
        finished=result.error is None and reported >= epochs,
        ended=ended,
    )


def best_trial(trials: list[Trial], higher_is_better: bool) -> Trial | None:
    """The finished trial with the best score (a tie: the first); None when no trial finished."""
    scored = [(t.score, t) for t in trials if t.finished and t.score is not None]
    if not scored:
        return None
    best = max(scored, key=lambda pair: pair[0]) if higher_is_better else min(scored, key=lambda pair: pair[0])
    return best[1]
