"""The steps of distributed-fit that concern the run's code (``train_code``).

``raytrain_driver.fit`` runs the fit: one run key, its lease, its MLflow run, Ray Train's checkpoints in the
run's storage, resume through ``ray.train.get_checkpoint()``. Here: the import check on the cluster, the
function and config each worker gets, the checkpoint a resume starts from, and the record of what the code's
reports said.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import TYPE_CHECKING, Any

from raytrain_driver.evaluation import scores_as_metrics
from raytrain_driver.fit_record import FitResult, OpenRun, ResumePoint, checkpoint_uri, refuse_foreign_checkpoints
from raytrain_driver.hooks import run_logger
from raytrain_tasks.api import TrainFunc
from raytrain_tasks.errors import CheckpointError, UserCodeError
from raytrain_tasks.reports import EVALUATION_ARTIFACT_DIR, log_learning_curves
from raytrain_tasks.tracking.controller import numeric_metrics, report_step
from raytrain_tasks.tracking.names import (
    EPOCH_FOLDER,
    IN_EPOCH_KEY,
    STEP_SERIES,
    checkpoint_name,
    checkpoint_order,
    epoch_number,
    pinned_digests,
)
from raytrain_tasks.tracking.outcome import SPEC_LOOP_EXTRAS, headline, log_checkpoint_models, log_summary

if TYPE_CHECKING:
    import ray.train

    from raytrain_driver.fit_context import FitContext
    from raytrain_tasks.storage.locations import StorageLocation

# The folders of a run's checkpoints: Ray Train names a train_func's checkpoint_<timestamp> (its reports may not
# pass checkpoint_dir_name: raytrain_tasks.checked_reports); a TrainSpec's are named for their epoch, epoch-0003
# (epoch-0003-r1 for its retraining). Ray Train keeps checkpoint_manager_snapshot.json beside them, not one.
CHECKPOINT_FOLDER = re.compile(rf"checkpoint_\d{{4}}-\d{{2}}-\d{{2}}_[\d.-]+|{EPOCH_FOLDER.pattern}")
CHECKPOINT_NAMES = "checkpoint_<timestamp> (Ray Train's) or epoch-NNNN (a TrainSpec's)"


def is_checkpoint_folder(name: str) -> bool:
    return CHECKPOINT_FOLDER.fullmatch(name) is not None


# How long the import check on a worker of the cluster may take (a cold worker imports torch and the user's code).
IMPORT_CHECK_TIMEOUT_S = 120.0


def check_importable_on_cluster(train_code: str, working_dir: str) -> None:
    """Import ``train_code`` in a Ray task on the cluster (where the workers will), before any training worker
    and its GPU are requested: ``ModuleNotFoundError`` on a remote worker is found in seconds, naming the path."""
    import ray

    from raytrain_tasks.user_code import check_importable

    task = ray.remote(num_cpus=0, max_retries=0)(check_importable)
    try:
        problem = ray.get(task.remote(train_code, working_dir), timeout=IMPORT_CHECK_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as exc:
        raise UserCodeError(
            f"train_code {train_code!r}: the import check on a Ray worker did not answer in "
            f"{IMPORT_CHECK_TIMEOUT_S:g} s (a cold worker, a slow runtime_env upload?)"
        ) from exc
    if problem:
        raise UserCodeError(problem)


def trainer_function(
    fit: FitContext, code_dir: str, resume: ResumePoint | None = None, fixed_workers: int = 0, driver_stop: Any = None
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(the function each worker runs, its ``train_loop_config``, ``TorchTrainer`` data kwargs). With prepared
    data, each worker finds its node's local copy (``config["data_dir"]``); the driver its own, for ``datasets``.
    ``fixed_workers``: the worker group's size when it is fixed (0: elastic), which kept splits are divided for.
    ``driver_stop``: a TrainSpec's ``DriverStop`` actor (raytrain_tasks.stop_requests), or None.
    Every checkpoint is checked against the fit's lease (raytrain_tasks.checked_reports)."""
    from raytrain_tasks.prepared import data_dir_of
    from raytrain_tasks.trainspec.loop import SpecTrainFunc
    from raytrain_tasks.user_code import run_train_func, user_config

    config, spec, prepared, lease = fit.config, fit.spec, fit.dataset, fit.lease

    loop_config = user_config(config, spec)
    data: dict[str, Any] = {}
    spec_func = spec.train_func if isinstance(spec.train_func, SpecTrainFunc) else None
    ray_spec = spec_func is not None and spec_func.ray_data  # what check_data found
    if spec.datasets is not None or ray_spec:  # Ray Datasets, built here: the data's local folder found once
        here = user_config(config, spec, data_dir_of(prepared, config.storage_options))
        if spec.datasets is not None:
            data["datasets"] = dict(spec.datasets(here))
        if spec_func is not None:  # a TrainSpec of Ray Datasets: sharded by Ray Train
            data |= spec_func.trainer_data(here, fixed_workers)
    resume = resume or ResumePoint()
    return (
        run_train_func,
        {
            "train_code": config.train_code,
            "code_dir": code_dir,
            "config": loop_config,
            # Of the run's folders as the fit starts, only the verified `start` reaches the code's get_checkpoint().
            "start": resume.start,
            # What a checkpointed report must hold: Ray Train keeps a run's checkpoints by it (checked_reports).
            "metric": spec.selection.name,
            "higher_is_better": spec.selection.higher_is_better,
            "present": sorted(resume.present),
            "data": prepared.model_dump(mode="json") if prepared is not None else None,
            "storage": config.storage_options.model_dump(mode="json"),
            "lease": {"uri": lease.location.uri, "holder": lease.holder} if lease is not None else None,
            # A TrainSpec's Ray Dataset splits: columns and example, so no worker calls data() (trainer_data).
            "ray_splits": spec_func.ray_splits if spec_func is not None and ray_spec else None,
            # A TrainSpec's checkpoints within epochs (refused before this for other code: preflight).
            # What the workers ask whether the driver is stopping (a TrainSpec's loop then commits first).
            "driver_stop": driver_stop,
            "step_checkpoints": {
                "every_steps": config.checkpoint_every_steps,
                "every_minutes": config.checkpoint_every_minutes,
            },
        },
        data,
    )


def choose_resume_point(run_dir: StorageLocation, pinned: dict[str, str]) -> ResumePoint:
    """The newest of the run's checkpoints whose files (every rank's) still hash to the digest recorded when it was
    committed; every newer one is rejected, and why. CheckpointError when checkpoints exist and none verifies."""
    from raytrain_tasks.integrity import folder_digest

    present = frozenset(run_dir.list_names())
    names = sorted((name for name in present if CHECKPOINT_FOLDER.fullmatch(name)), key=checkpoint_order)
    rejected: list[str] = []
    reasons: list[str] = []
    for name in reversed(names):
        expected = pinned.get(name)
        if expected is None:
            reasons.append(
                f"{name}: never recorded as committed (the run stopped, or a rank died, before it was committed)"
            )
        else:
            location = run_dir.child(name)
            if folder_digest(location.filesystem, location.path) == expected:
                return ResumePoint(
                    frozenset(rejected),
                    name if rejected else None,
                    "; ".join(reasons),
                    start=name,
                    epoch=reported_epoch(run_dir, name),
                    present=present,
                )
            reasons.append(f"{name}: its files do not hash to the digest recorded when it was committed")
        rejected.append(name)
    if rejected:
        raise CheckpointError(
            f"no checkpoint of run {run_dir.uri} verifies ({'; '.join(reasons)}); nothing was resumed. Check who "
            "can write `storage_path`; start a new run (a new run key) to train from scratch"
        )
    return ResumePoint(present=present)


# Ray Train's record of a run's checkpoints and what each one's report said, beside them in the run's folder.
RAY_CHECKPOINT_RECORD = "checkpoint_manager_snapshot.json"


def reported_epoch(run_dir: StorageLocation, name: str) -> int | None:
    """The epoch number (from 1) that checkpoint ``name``'s report said (its ``epoch``, 0-based, as the examples and
    a TrainSpec report it), from Ray Train's record of the run; None when the report said none or the record
    cannot be read (Ray Train's own file, whose shape may change): the resume line then names the folder alone."""
    try:
        results = json.loads(run_dir.child(RAY_CHECKPOINT_RECORD).read_text())["checkpoint_results"]
        epoch = next(r["metrics"] for r in results if r.get("checkpoint_dir_name") == name).get("epoch")
        return epoch_number(epoch) if isinstance(epoch, int | float) and not isinstance(epoch, bool) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration, OverflowError):
        return None


def history_of(result: ray.train.Result, logged: list[dict[str, float]]) -> list[dict[str, float]]:
    """One entry per checkpointed report, oldest first, each with its ``epoch`` (0-based): from MLflow's record
    of the run (every committed report, across resumes) when it has them, else from Ray Train's kept ones."""
    if logged:
        return logged
    entries: list[dict[str, float]] = []
    seen: set[int] = set()
    # A checkpoint within an epoch (a TrainSpec's or a train_func's) says so in its report: it holds no epoch.
    reports = [(c, m) for c, m in result.best_checkpoints or [] if IN_EPOCH_KEY not in m]
    for _, metrics in sorted(reports, key=lambda pair: checkpoint_name(pair[0].path)):
        step = report_step(metrics, seen)
        seen.add(step)
        entries.append({**numeric_metrics(metrics), "epoch": float(step - 1)})
    return entries


def best_checkpoint(
    result: ray.train.Result, spec: TrainFunc, run_key: str, rejected: frozenset[str] = frozenset()
) -> tuple[Any, dict[str, Any]]:
    """(the best kept checkpoint by the spec's metric, its reported metrics; never a rejected one). Only a report
    holding both the metric and the gate's metric as finite numbers can win; of equal scores, the first reported
    wins. UserCodeError when no kept checkpoint has such a report: nothing can be registered from the fit."""
    kept = [(c, m) for c, m in result.best_checkpoints or [] if checkpoint_name(c.path) not in rejected]
    if not kept:  # the code's own doing, the same on every attempt: not retried
        raise UserCodeError(
            f"training run {run_key}: train_func never passed a checkpoint to ray.train.report(..., checkpoint=...); "
            "nothing can be resumed or registered. Report one at least at the end of each epoch, then continue the "
            f"run with `resume={run_key}` (from epoch 1, in the same MLflow run)"
        )
    name = spec.selection.name
    needed = sorted({name, spec.gate.name})
    # Ray's own order ranks a NaN lowest and a missing metric as -inf, whatever the direction: read the reports.
    scored = [(c, m) for c, m in kept if all(math.isfinite(numeric_metrics(m).get(key, math.nan)) for key in needed)]
    if not scored:
        raise UserCodeError(_no_finite_report(kept, needed, run_key))
    sign = 1.0 if spec.selection.higher_is_better else -1.0
    in_report_order = sorted(scored, key=lambda pair: checkpoint_order(checkpoint_name(pair[0].path)))
    return max(in_report_order, key=lambda pair: sign * numeric_metrics(pair[1])[name])  # max: first of equals


def _no_finite_report(kept: list[tuple[Any, dict[str, Any]]], needed: list[str], run_key: str) -> str:
    """Why no kept report can be the best checkpoint, and what to do about it."""
    reports = [numeric_metrics(metrics) for _, metrics in kept]
    never = [key for key in needed if not any(key in report for report in reports)]
    if never:
        return (
            f"training run {run_key}: train_func never reported {never} with a checkpoint (it reported "
            f"{sorted(reports[-1])}); nothing is registered. Either name metrics it reports in the code's "
            f"TrainFunc(metric=..., gate_metric=...) and continue with `resume={run_key}` (the kept checkpoints' "
            "reports are read again; a resume keeps train_config as it was), or make train_func report them "
            "(beside what `evaluate` returns: the reported figure is the version's recorded score) and start a new "
            "run: the epochs trained hold no such figure"
        )
    diverged = [key for key in needed if not any(math.isfinite(report.get(key, math.nan)) for report in reports)]
    if diverged:
        return (
            f"training run {run_key}: train_func reported {diverged} with its checkpoints only as NaN or infinite "
            "values: the training diverged, and nothing is registered. Lower the learning rate or clip gradients, "
            "then start a new run"
        )
    return (
        f"training run {run_key}: no checkpoint's report holds {needed} together as finite numbers, so none can be "
        "both chosen and gated; nothing is registered. Make train_func report them in the same "
        "ray.train.report(..., checkpoint=...) call, then start a new run"
    )


def step_of(metrics: dict[str, Any], history: list[dict[str, float]]) -> int:
    """The MLflow step (epoch number) of a checkpoint's report: its ``epoch`` when it says it, else the step
    whose logged metrics are the report's."""
    if isinstance(metrics.get("epoch"), int | float):
        return epoch_number(metrics["epoch"])
    values = numeric_metrics(metrics)
    for entry in history:
        shared = [key for key in values if key in entry and key != "epoch"]  # MLflow's history lacks test_*
        if shared and all(abs(entry[key] - values[key]) <= 1e-9 * max(1.0, abs(values[key])) for key in shared):
            return epoch_number(entry["epoch"])
    return len(history)


def left_off(spec: TrainFunc) -> tuple[str, ...]:
    """What a run's epoch lines and summary leave off: a TrainSpec's timing figures and test scores; nothing of a
    train_func's (each name it reports is its own choice)."""
    from raytrain_tasks.trainspec.loop import SpecTrainFunc

    return SPEC_LOOP_EXTRAS if isinstance(spec.train_func, SpecTrainFunc) else ()


def logged_history(client: Any, run_id: str, spec: TrainFunc) -> list[dict[str, float]]:
    """The run's committed reports as MLflow holds them (step = epoch number), every metric at each step."""
    run = client.get_run(run_id)
    keys = [key for key in run.data.metrics if not key.startswith(("system/", "best_", "test_", STEP_SERIES))]
    by_step: dict[int, dict[str, float]] = {}
    for key in keys:
        for point in client.get_metric_history(run_id, key):
            by_step.setdefault(int(point.step), {})[key] = float(point.value)
    steps = [step for step, values in sorted(by_step.items()) if spec.selection.name in values]
    return [{**by_step[step], "epoch": float(step - 1)} for step in steps]


def log_user_summary(
    logger: logging.Logger | logging.LoggerAdapter[Any], spec: TrainFunc, step: int, best: dict
) -> None:
    """The best checkpoint's figures, as its epoch line shows them, then its held-out test scores."""
    shown = [*headline(best, left_off(spec)), *sorted(key for key in best if key.startswith("test_"))]
    logger.info(
        "best checkpoint: epoch %d by %s (%s is better): %s",
        step,
        spec.selection.name,
        "higher" if spec.selection.higher_is_better else "lower",
        ", ".join(f"{k}={best[k]:.4f}" for k in dict.fromkeys(shown)),
    )


__all__ = [
    "best_checkpoint",
    "check_importable_on_cluster",
    "step_of",
    "history_of",
    "log_user_summary",
    "logged_history",
    "trainer_function",
]


def record_fit(fit: FitContext, result: ray.train.Result, opened: OpenRun) -> FitResult:
    """What the user's reports said: the best checkpoint by their metric, and the run's history as MLflow holds
    it. Their metric is the score the gate compares (no held-out split of the pipeline's own here)."""
    client, spec, run_key, run_dir = fit.client, fit.spec, fit.run_key, fit.run_dir
    run_id = opened.run_id
    refuse_foreign_checkpoints(result, run_key, run_dir, is_checkpoint_folder, CHECKPOINT_NAMES)
    rejected = opened.resume_point.rejected if opened.resume_point is not None else frozenset()
    checkpoint, metrics = best_checkpoint(result, spec, run_key, rejected)
    history = history_of(result, logged_history(client, run_id, spec))
    step = step_of(metrics, history)
    best = numeric_metrics(metrics)
    log_user_summary(run_logger(), spec, step, best)
    keys = sorted({key for entry in history for key in entry} - {"epoch"})  # every metric the code reported
    kept = {
        checkpoint_name(c.path): (checkpoint_uri(run_dir, c), step_of(metrics, history))
        for c, metrics in result.best_checkpoints or []
        if checkpoint_name(c.path) not in rejected and IN_EPOCH_KEY not in metrics
    }
    model_ids = log_kept_checkpoints(client, opened, kept, keys)
    done = FitResult(
        run_key=run_key,
        run_uri=run_dir.uri,
        mlflow_run_id=run_id,
        mlflow_experiment_id=opened.experiment_id,
        backend=opened.backend,
        epochs_completed=len(history),
        best_epoch=step,
        best_checkpoint_uri=checkpoint_uri(run_dir, checkpoint),
        best_metrics=best,
        final_metrics={k: v for k, v in history[-1].items() if k != "epoch"} if history else best,
        history=history,
        reopened_mlflow_run=opened.reopened,
        # The best checkpoint's held-out figures (the gate's among them): the run's summary and the version's tags.
        scores={
            k: v
            for k, v in best.items()
            if k.startswith(("val_", "test_")) or k in (spec.selection.name, spec.gate.name)
        },
        best_checkpoint_model_id=model_ids.get(checkpoint_name(checkpoint.path)),
        shown_metrics=headline(keys, left_off(spec)),
    )
    firsts = [spec.selection.name, spec.gate.name, *done.shown_metrics]  # a TrainSpec's: no timing figure
    columns = [key for key in dict.fromkeys(firsts) if key in keys][:5]
    if not log_summary(client, run_id, history, spec.selection.name, step, columns):
        client.set_tag(run_id, "summary.best_epoch", str(step))  # a pick the history lacks: its score alone
        client.set_tag(run_id, f"summary.best_{spec.selection.name}", f"{best[spec.selection.name]:.6f}")
    log_learning_curves(client, run_id, history)  # the run page links it
    _log_checkpoint_pointer(client, done)
    # The best checkpoint's held-out scores: best_checkpoint_<key> at its step, on its model.
    client.log_batch(run_id, metrics=scores_as_metrics(done.scores, step, done.best_checkpoint_model_id))
    return done


def _log_checkpoint_pointer(client: Any, fit: FitResult) -> None:
    """Where the best checkpoint is, beside the learning curves: what ``load_model`` reads."""
    pointer = {"uri": fit.best_checkpoint_uri, "epoch": fit.best_epoch, "run_uri": fit.run_uri, "run_key": fit.run_key}
    client.log_text(fit.mlflow_run_id, json.dumps(pointer, indent=1), f"{EVALUATION_ARTIFACT_DIR}/checkpoint.json")


def log_kept_checkpoints(
    client: Any, opened: OpenRun, kept: dict[str, tuple[str, int]], keys: list[str]
) -> dict[str, str]:
    """Each checkpoint the run kept (``kept``: folder name -> (its URI, its step); no rejected one), as a
    LoggedModel linked to its report's metrics (tracking.outcome.log_checkpoint_models); folder name -> model_id."""
    digests = pinned_digests(client.get_run(opened.run_id).data.tags)
    return log_checkpoint_models(client, opened.experiment_id, opened.run_id, kept, digests, keys)
