"""distributed-fit: run Ray Train's TorchTrainer for one run key, checkpointing every epoch to storage.

The run key names the Ray Train run (``<storage>/runs/<run key>``) and tags the MLflow run. Calling this
again with the same key (a Prefect retry, or ``resume``) continues from the latest registered checkpoint
in the same MLflow run.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import os
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import ray
import ray.train
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.exceptions import MissingContextError, TerminationSignal
from pydantic import BaseModel, ConfigDict
from ray.train.v2.api.callback import RayTrainCallback

from raytrain_tasks.checkpoint import STATE_FILE
from raytrain_tasks.config import TrainingConfig, check_run_key
from raytrain_tasks.data import DATA_TASK_CPUS, USER_DATASET_CPUS, DatasetRef, streams
from raytrain_tasks.errors import (
    CheckpointError,
    ClusterError,
    DatasetError,
    NodeStorageError,
    RepeatedFailureError,
    RunLeaseError,
    RunLeaseLostError,
    TrackingError,
    TrainingError,
    UnsafeCheckpointError,
    UserCodeError,
)
from raytrain_tasks.redact import redacted_errors
from raytrain_tasks.resume import CHECKPOINT_PREFIX, checkpoint_epoch
from raytrain_tasks.tracking import (
    MlflowEpochLogger,
    OpenMlflowEarly,
    checkpoint_name,
    epoch_number,
    pinned_digests,
)
from raytrain_tasks.user_code import resolve
from tasks import evaluation, tracking
from tasks.cluster import (
    WORKER_GROUP_START_TIMEOUT_S,
    alive_node_resources,
    check_resources,
    check_storage_on_nodes,
    ray_session,
    read_mounts,
    sized_for_cluster,
    storage_shared_with_nodes,
)
from tasks.lease import HeldLease, run_lease
from tasks.run_page import EpochProgress
from tasks.storage import RUNS_DIR, StorageLocation, locate

if TYPE_CHECKING:
    from ray.train.torch import TorchTrainer

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
)
ENTRY_POINT = "flows/training.py:training_pipeline"  # as deployments/prefect.yaml names it


class FitResult(BaseModel):
    """What a finished fit left behind, and where."""

    model_config = ConfigDict(frozen=True)

    run_key: str
    run_uri: str
    mlflow_run_id: str
    mlflow_experiment_id: str
    backend: str
    epochs_completed: int
    best_epoch: int  # its number, 1 to epochs (tracking.epoch_number)
    best_checkpoint_uri: str
    best_metrics: dict[str, float]
    final_metrics: dict[str, float]
    history: list[dict[str, float]]
    reopened_mlflow_run: bool
    # The best checkpoint scored once, on the driver: val_accuracy, val_loss, test_accuracy, test_loss.
    scores: dict[str, float] = {}
    # The MLflow LoggedModel that stands for the best checkpoint (tracking.log_checkpoint_models).
    best_checkpoint_model_id: str | None = None


def is_retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition: retry training failures, not configuration problems."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, NOT_RETRYABLE)


@task(
    name="distributed-fit",
    task_run_name="fit-{run_key}",
    cache_policy=NONE,
    retry_condition_fn=is_retryable,
)
def distributed_fit(config: TrainingConfig, dataset: DatasetRef | None, run_key: str) -> FitResult:
    """Train (or continue training) run ``run_key`` and return its best checkpoint and metrics."""
    with redacted_errors():
        check_run_key(run_key)  # it names a folder in storage and goes into MLflow filters
        runs = locate(config.storage_path, config.storage_options).child(RUNS_DIR)
        run_dir = runs.child(run_key)
        if config.launch_mode == "ray_job":
            from tasks.ray_job import fit_as_ray_job

            # The job takes the run's lease itself (fit_in_this_process, run by tasks/fit_job.py on the cluster).
            return fit_as_ray_job(config, dataset, run_key, runs, run_dir, origin=prefect_origin(run_key))
        return fit_in_this_process(config, dataset, run_key, runs, run_dir)


def fit_in_this_process(
    config: TrainingConfig,
    dataset: DatasetRef | None,
    run_key: str,
    runs: StorageLocation,
    run_dir: StorageLocation,
    origin: dict[str, str] | None = None,
) -> FitResult:
    """The fit with this process as Ray Train's driver, under the run's lease. ``origin``: the MLflow run name and
    Prefect tags, when this process is not the Prefect run (a Ray Job); see ``prefect_origin``."""
    with redacted_errors():
        if config.resume and not run_dir.child("checkpoint_manager_snapshot.json").exists():
            check_started_without_checkpoint(config, run_key, run_dir)
        # One driver per run key, whatever host it runs on (tasks/lease.py).
        with run_lease(
            run_dir, run_key, tracking.this_driver(), config.run_lease_seconds, holder_alive=tracking.driver_alive
        ) as lease:
            return _distributed_fit(config, dataset, run_key, runs, run_dir, origin or prefect_origin(run_key), lease)


def check_started_without_checkpoint(config: TrainingConfig, run_key: str, run_dir: StorageLocation) -> None:
    """A resume of a run that has no checkpoint yet trains from its first epoch, in its MLflow run: it stopped
    before its first epoch was committed (the likeliest moment to run out of memory: loading data, the first
    epoch). A run key that never started a fit (no MLflow run, nothing in storage) is a CheckpointError."""
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    experiment = client.get_experiment_by_name(config.experiment_name)
    run = tracking.find_run(client, experiment.experiment_id, run_key) if experiment is not None else None
    if run is None and not run_dir.exists():
        raise CheckpointError(
            f"cannot resume run {run_key}: no MLflow run in experiment {config.experiment_name!r} and no checkpoints "
            f"under {run_dir.uri}; check `resume`, `experiment_name` and `storage_path` (they must match the "
            "interrupted run)"
        )
    run_logger().warning(
        "run %s has no committed checkpoint yet (it stopped before its first epoch ended): training from epoch 1%s",
        run_key,
        f" in MLflow run {run.info.run_id}" if run is not None else "",
    )


def workers_code_dir(config: TrainingConfig) -> str:
    """Where a local Ray's workers find the user's code: the folder it was imported from here. On a cluster
    (``ray_address``) the workers get it through Ray's runtime_env instead (``tasks.cluster.cluster_runtime_env``)."""
    from raytrain_tasks.user_code import code_root

    return "" if config.ray_address else str(code_root(config.train_code) or "")


def check_rows_per_worker(config: TrainingConfig, dataset: DatasetRef | None) -> None:
    """Every worker needs at least one training row of its own (each takes an equal share of the train split)."""
    workers = config.worker_range[1]
    if dataset is not None and dataset.train_rows < workers:
        raise DatasetError(
            f"the train split of dataset {dataset.content_hash[:16]} has {dataset.train_rows} rows, fewer than the "
            f"{workers} workers that would each train on a share of it; lower `num_workers` (and `max_workers`) "
            "or give `dataset` more rows"
        )


def check_cluster(
    config: TrainingConfig,
    dataset: DatasetRef | None,
    runs: StorageLocation,
    client: Any,
    run_key: str,
    user_datasets: bool = False,
) -> TrainingConfig:
    """With Ray connected: the cluster can host the workers and every node can write the run's storage. Returns
    ``config`` sized to the cluster (``cpus_per_worker`` when unset; an earlier attempt's share of the run, read
    from its MLflow run through ``client``, while it still fits), what the trainer is built from; the user's
    settings, not this copy, are the run's MLflow params. ``user_datasets``: the user's code gives Ray Datasets,
    whose read and transform tasks need a CPU the workers leave free, as the built-in streaming loader's do."""
    check_rows_per_worker(config, dataset)
    available = ray.cluster_resources()
    object_store = available.get("object_store_memory", 0.0)
    streamed = user_datasets or (dataset is not None and streams(config.data_loader, dataset, object_store))
    nodes = alive_node_resources()
    earlier = None if config.cpus_per_worker else tracking.earlier_share(client, config.experiment_name, run_key)
    data_cpus = USER_DATASET_CPUS if user_datasets else DATA_TASK_CPUS
    sized = sized_for_cluster(config, nodes, streamed, earlier, data_cpus)
    check_resources(sized, available, streamed, user_datasets, data_cpus)
    storage_shared_with_nodes(config.storage_path, len(nodes), read_mounts())
    if config.ray_address:  # a local Ray's node is this process's machine, with this process's credentials
        check_storage_on_nodes(runs.uri, config.storage_options)
    if config.train_code:
        from tasks.user_fit import check_importable_on_cluster

        check_importable_on_cluster(config.train_code, workers_code_dir(config))
    if not config.cpus_per_worker:
        run_logger().info(
            "cpus_per_worker unset: %s workers x %g CPUs each, %s the cluster's %g CPUs%s",
            "-".join(map(str, sorted(set(config.worker_range)))),
            sized.cpus_per_worker,
            "as the run's earlier attempt trained, on" if sized.cpus_per_worker == earlier else "sized to",
            available.get("CPU", 0.0),
            f" ({data_cpus:g} left to Ray Data's streaming tasks)" if streamed else "",
        )
    return sized


def run_logger() -> logging.Logger | logging.LoggerAdapter[Any]:
    """The Prefect task's logger; a plain one where no Prefect run is (the fit's Ray Job on a cluster)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("prefect_raytrain.fit")


def _in_prefect_run() -> bool:
    from prefect.context import TaskRunContext

    return TaskRunContext.get() is not None


def _distributed_fit(
    config: TrainingConfig,
    dataset: DatasetRef | None,
    run_key: str,
    runs: StorageLocation,
    run_dir: StorageLocation,
    origin: dict[str, str],
    lease: HeldLease | None = None,
) -> FitResult:
    logger = run_logger()
    # Pre-flight, cheapest first: MLflow answers, Ray is reachable and can host the workers (and, on a cluster,
    # every node can write storage). Nothing is created (no MLflow run, no checkpoint) until they hold; the
    # lease taken above is removed with the folders it made if they fail.
    spec = resolve(config.train_code) if config.train_code else None  # fails before Ray, naming train_code
    if spec is not None and config.register and not spec.can_register:
        raise UserCodeError(
            f"train_code {config.train_code!r} gives no load_model/input_example, so nothing it trains can be "
            "registered: add them to its TrainFunc, or set `register` off (--no-register)"
        )
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    run_id: str | None = None
    try:
        with ray_session(config):
            user_datasets = spec is not None and spec.datasets is not None
            sized = check_cluster(config, dataset, runs, client, run_key, user_datasets)
            experiment_id = tracking.ensure_experiment(
                client, config.experiment_name, config.mlflow_tracking_uri, config.storage_path
            )
            tracking.mark_dead_runs_killed(client, experiment_id, found_by=run_key)
            finished = _finished_fit(run_dir, client, experiment_id, run_key)
            if finished is not None:
                # Everything was trained and recorded earlier: check the settings match, train nothing.
                dataset_hash = dataset.content_hash if dataset is not None else None
                tracking.check_resumable(client, experiment_id, run_key, config.public_params(), dataset_hash)
                tracking.finish_run(client, finished.mlflow_run_id)
                logger.info("run key %s finished all %d epochs earlier; nothing to train", run_key, config.epochs)
                return finished
            backend = "nccl" if config.use_gpu else "gloo"
            run_id, reopened = tracking.start_or_reopen_run(
                client,
                experiment_id,
                run_key,
                run_name=origin.get("run_name", run_key),
                tags=_run_tags(config, dataset, run_key, run_dir, backend)
                | {tracking.CPUS_PER_WORKER_TAG: f"{sized.cpus_per_worker:g}"}
                | {k: v for k, v in origin.items() if k != "run_name"}
                | {tracking.NOTE_TAG: run_description(config, run_key, run_dir, origin)},
                params=config.public_params(),
            )
            if not reopened and dataset is not None:
                evaluation.log_dataset_input(client, run_id, dataset)
            logger.info(
                "run key %s: %s MLflow run %s; checkpoints in %s",
                run_key,
                "continuing" if reopened else "new",
                run_id,
                run_dir.uri,
            )
            # What existed before this fit is trusted only as far as MLflow vouches for it (resume.CheckpointPins):
            # every name, not only `epoch-*` ones, since anyone who can write storage can point Ray Train's
            # checkpoint snapshot at a folder of another name.
            preexisting = frozenset(run_dir.list_names())
            journal = tracking.pin_journal(config, run_key)
            if reopened and (recovered := tracking.pins_from_journal(client, run_id, journal)):
                logger.info(
                    "recorded in MLflow the pins of %s from this machine's pin journal (MLflow was down when they "
                    "were committed)",
                    ", ".join(recovered),
                )
            pinned = pinned_digests(client.get_run(run_id).data.tags) if reopened else {}
            resume_point = None
            if spec is not None:
                from tasks.user_fit import choose_resume_point

                resume_point = choose_resume_point(run_dir, pinned)
                if resume_point.rejected:
                    logger.warning(
                        "run %s resumes from checkpoint %s, not a newer one: %s",
                        run_key,
                        resume_point.fallback,
                        resume_point.why,
                    )
                    client.set_tag(run_id, "prefect_raytrain.resume_fallback", resume_point.why[:4000])
            else:
                announce_resume(logger, config, run_dir, preexisting, pinned)
            callbacks: list[Any] = [OpenMlflowEarly(config.mlflow_tracking_uri, run_id)]
            if spec is None:
                callbacks.append(MlflowEpochLogger(config.mlflow_tracking_uri, run_id, journal=journal))
            else:
                from raytrain_tasks.user_code import code_error_stopper

                callbacks.append(
                    MlflowEpochLogger(
                        config.mlflow_tracking_uri, run_id, step_key=spec.metric.name, keys=None, journal=journal
                    )
                )
                callbacks.append(code_error_stopper(config.train_code))
            trainer = build_trainer(
                sized,
                dataset,
                run_key,
                runs,
                *callbacks,
                pins=(preexisting, pinned),
                spec=spec,
                resume_point=resume_point,
            )
            # Off a Prefect run (a Ray Job) there is no run page to update: the job's submitter shows the progress.
            progress = (
                EpochProgress(
                    client,
                    run_id,
                    config.epochs,
                    logger,
                    builtin=spec is None,
                    expects=tuple(dict.fromkeys((spec.metric.name, spec.gate.name))) if spec is not None else (),
                )
                if _in_prefect_run()
                else None
            )
            with (
                tracking.system_metrics(config.system_metrics, config.mlflow_tracking_uri, run_id, reopened),
                progress or contextlib.nullcontext(),
            ):
                result = fit_interruptibly(trainer, lease)

        # Pins the controller could not write to MLflow during an outage (kept in the journal meanwhile).
        tracking.pins_from_journal(client, run_id, journal)
        if spec is not None or dataset is None:
            assert spec is not None, "the built-in loop trains on a prepared dataset"
            rejected = resume_point.rejected if resume_point is not None else frozenset()
            fit = _record_user_fit(
                client, result, spec, config, run_key, run_dir, run_id, experiment_id, backend, reopened, rejected
            )
            _write_fit_record(run_dir, client, run_id, fit, lease)  # what a Ray Job's submitter reads back
            tracking.finish_run(client, run_id)
            return fit
        reported = [
            (checkpoint_name(checkpoint.path), metrics) for checkpoint, metrics in result.best_checkpoints or []
        ]
        if foreign := sorted(name for name, _ in reported if not name.startswith(CHECKPOINT_PREFIX)):
            raise UnsafeCheckpointError(
                f"Ray Train's checkpoint record of run {run_key} (checkpoint_manager_snapshot.json in {run_dir.uri}) "
                f"lists {', '.join(foreign)}, which this pipeline never writes (its checkpoints are "
                f"{CHECKPOINT_PREFIX}NNNN): someone or something changed the run's storage. Nothing is registered "
                "from it; check who can write `storage_path`, then start a new run (without `resume`)"
            )
        tracking.pin_checkpoints(client, run_id, [(n, m) for n, m in reported if n not in preexisting])
        fit = summarize(result, config, run_key, run_dir, run_id, experiment_id, backend, reopened)
        added = tracking.reconcile_epochs(client, run_id, fit.history)
        if added:
            logger.warning("logged %d epoch(s) to MLflow that the controller could not log live", added)
        tracking.log_summary(client, run_id, fit.history, config.selection.name, fit.best_epoch)
        kept = {
            checkpoint_name(checkpoint.path): _checkpoint_uri(run_dir, checkpoint)
            for checkpoint, _ in result.best_checkpoints or []
        }
        model_ids = tracking.log_checkpoint_models(
            client, experiment_id, run_id, kept, pinned_digests(client.get_run(run_id).data.tags)
        )
        model_id = model_ids.get(checkpoint_name(fit.best_checkpoint_uri))
        pointer = {"uri": fit.best_checkpoint_uri, "epoch": fit.best_epoch, "run_uri": fit.run_uri, "run_key": run_key}
        digest = tracking.recorded_digest(client, run_id, fit.best_checkpoint_uri)
        scores = evaluation.log_evaluation(
            client, run_id, dataset, fit, pointer, config.storage_options, digest, model_id
        )
        fit = fit.model_copy(update={"scores": scores, "best_checkpoint_model_id": model_id})
        _write_fit_record(run_dir, client, run_id, fit, lease)
    except BaseException as exc:
        if run_id is None:
            raise
        if lease is not None and lease.lost() is not None:
            # The run and its MLflow run belong to the lease's new holder now: marking it KILLED or FAILED here
            # would end the run that driver is training.
            logger.error("run %s: this driver lost the lease; MLflow run %s is left to its holder", run_key, run_id)
            if isinstance(exc, RunLeaseLostError):
                raise
            try:
                lease.check()
            except RunLeaseLostError as lost:
                raise lost from exc
        if isinstance(exc, TerminationSignal | KeyboardInterrupt):  # a Prefect cancellation (SIGTERM), Ctrl-C
            how = f"signal {exc.signal}" if isinstance(exc, TerminationSignal) else "Ctrl-C"
            tracking.stop_run(
                client,
                run_id,
                f"stopped by {how} at {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC (a cancellation from Prefect, an "
                f"interrupt, or the machine shutting down); its checkpoints are kept: continue it with "
                f"resume={run_key}",
            )
            raise
        error = training_error(exc, run_key, config)
        tracking.fail_run(client, run_id, error)
        if error is exc:
            raise
        raise error from exc
    tracking.finish_run(client, run_id)
    logger.info(
        "best epoch %d by %s: %s, test %s at %s",
        fit.best_epoch,
        config.promotion_metric,
        ", ".join(f"{k}={v:.4f}" for k, v in fit.best_metrics.items() if k.startswith("val_")),
        ", ".join(f"{k}={v:.4f}" for k, v in fit.scores.items() if k.startswith("test_")),
        fit.best_checkpoint_uri,
    )
    return fit


FIT_RECORD = "fit.json"


def _write_fit_record(
    run_dir: StorageLocation, client: Any, run_id: str, fit: FitResult, lease: HeldLease | None
) -> None:
    """The record goes last: a run with it is complete, and a resume of it trains and logs nothing again. Its
    digest goes to MLflow after it: a record without one is not trusted (see _finished_fit)."""
    if lease is not None:
        lease.check()  # a driver that lost the run writes nothing more into it
    record = fit.model_dump_json(indent=1)
    run_dir.child(FIT_RECORD).write_text(record)
    client.set_tag(run_id, tracking.FIT_RECORD_TAG, hashlib.sha256(record.encode()).hexdigest())


def _record_user_fit(
    client: Any,
    result: ray.train.Result,
    spec: Any,
    config: TrainingConfig,
    run_key: str,
    run_dir: StorageLocation,
    run_id: str,
    experiment_id: str,
    backend: str,
    reopened: bool,
    rejected: frozenset[str] = frozenset(),
) -> FitResult:
    """What the user's reports said: the best checkpoint by their metric, and the run's history as MLflow holds
    it. Their metric is the score the gate compares (no held-out split of the pipeline's own here)."""
    from tasks.user_fit import best_checkpoint, history_of, log_user_summary, logged_history, step_of

    checkpoint, metrics = best_checkpoint(result, spec, run_key, rejected)
    history = history_of(result, logged_history(client, run_id, spec))
    step = step_of(metrics, history)
    best = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    best.pop("epoch", None)
    log_user_summary(run_logger(), spec, step, best)
    fit = FitResult(
        run_key=run_key,
        run_uri=run_dir.uri,
        mlflow_run_id=run_id,
        mlflow_experiment_id=experiment_id,
        backend=backend,
        epochs_completed=len(history),
        best_epoch=step,
        best_checkpoint_uri=_checkpoint_uri(run_dir, checkpoint),
        best_metrics=best,
        final_metrics={k: v for k, v in history[-1].items() if k != "epoch"} if history else best,
        history=history,
        reopened_mlflow_run=reopened,
        scores={spec.gate.name: best[spec.gate.name]},
    )
    client.set_tag(run_id, "summary.best_epoch", str(step))
    client.set_tag(run_id, f"summary.best_{spec.metric.name}", f"{best[spec.metric.name]:.6f}")
    return fit


def announce_resume(
    logger: Any, config: TrainingConfig, run_dir: StorageLocation, preexisting: frozenset[str], pinned: dict[str, str]
) -> None:
    """Say which checkpoint a continued run resumes from, on the driver, where the default console shows it.

    The workers resume from the newest checkpoint that is both in storage and pinned in MLflow (an unpinned one
    is passed over, see ``resume.CheckpointPins``); a damaged one makes them fall back further and say so in
    the Ray logs.
    """
    trusted = sorted(name for name in preexisting if name in pinned)
    if not trusted:
        return
    epoch, uri = checkpoint_epoch(trusted[-1]), run_dir.child(trusted[-1]).uri
    if epoch >= config.epochs:
        logger.info("resuming from checkpoint %s: epoch %d, the last, was committed; finishing the run", uri, epoch)
    else:
        logger.info("resuming from checkpoint %s (epoch %d of %d): next epoch %d", uri, epoch, config.epochs, epoch + 1)


def training_error(exc: BaseException, run_key: str, config: TrainingConfig) -> BaseException:
    """What the task raises for ``exc``: a worker's CheckpointError stays one (no retry can fix it)."""
    if not isinstance(exc, ray.train.TrainingFailedError):
        return exc
    stopped = getattr(exc, "controller_failure", None)
    if isinstance(stopped, UserCodeError):  # raytrain_tasks.user_code.code_error_stopper
        return UserCodeError(f"training run {run_key}: {stopped}")
    for failure in getattr(exc, "worker_failures", {}).values():
        cause: BaseException | None = failure
        while cause is not None:
            if isinstance(cause, CheckpointError):
                return type(cause)(f"training run {run_key}: {cause}")  # UnsafeCheckpointError stays one
            cause = cause.__cause__ or getattr(cause, "cause", None)
    repeated = getattr(exc, "controller_failure", None)
    if isinstance(repeated, RepeatedFailureError):  # raytrain_tasks.failures.StopOnRepeatedFailure
        return RepeatedFailureError(f"training run {run_key} stopped: {repeated}")
    from tasks.trainer import START_TIMEOUT_ENV, waited_for_resources

    timeout = waited_for_resources(exc)
    if timeout is not None:
        low, high = config.worker_range
        waited = os.environ.get(START_TIMEOUT_ENV, WORKER_GROUP_START_TIMEOUT_S)
        return TrainingError(
            f"training run {run_key}: the cluster no longer has the resources for {timeout.num_workers} workers "
            f"(a node lost?); after {config.max_failures} worker-group restarts (`max_failures`) each waited "
            f"{START_TIMEOUT_ENV} (Ray Train's setting, {waited} s here) for them. "
            + (
                "Set `max_workers` above `num_workers` to train on what is left, lower `num_workers`, or add nodes; "
                if high == low
                else f"not even `num_workers` ({low}) could start; add nodes or lower `num_workers`; "
            )
            + f"it can continue from its last checkpoint with `resume={run_key}`"
        )
    return TrainingError(
        f"training run {run_key} failed after {config.max_failures} worker-group restarts: {exc}. "
        f"It can continue from its last checkpoint with `resume={run_key}`"
    )


def _finished_fit(run_dir: StorageLocation, client: Any, experiment_id: str, run_key: str) -> FitResult | None:
    """The run's FIT_RECORD if it is the one this run wrote (its digest is in the MLflow run); None otherwise.

    Without a recorded digest (the process died between writing the record and tagging it) the record is ignored
    and the fit runs again: Ray Train finds every epoch done and the summary steps are redone. A record whose
    digest differs was replaced in storage, and the fit stops: its scores would feed the promotion gate.
    """
    record = run_dir.child(FIT_RECORD)
    if not record.exists():
        return None
    text = record.read_text()
    run = tracking.find_run(client, experiment_id, run_key)
    expected = run.data.tags.get(tracking.FIT_RECORD_TAG) if run is not None else None
    if expected is None:
        run_logger().warning("%s of run %s has no digest in MLflow; finishing the run again", FIT_RECORD, run_key)
        return None
    if hashlib.sha256(text.encode()).hexdigest() != expected:
        raise UnsafeCheckpointError(
            f"{record.uri} is not the record run {run_key} wrote (its SHA-256 differs from the one in MLflow run "
            f"{run.info.run_id if run else '?'}); someone or something changed it in storage. Check who can write "
            "`storage_path`; delete the file to have the run finish again from its checkpoints"
        )
    return FitResult.model_validate_json(text)


def fit_interruptibly(trainer: TorchTrainer, lease: HeldLease | None = None) -> ray.train.Result:
    """``trainer.fit()``, with this thread free to take a SIGTERM (a Prefect cancellation) or Ctrl-C at once.

    ``fit()`` waits on the controller inside one ``ray.get``, and a thread blocked there runs Python's signal
    handlers only when the call returns. Seen: a SIGTERM after epoch 2 of 6 surfaced after epoch 6, as a
    ``SystemError`` that Prefect took for a failure and retried. So ``fit()`` runs in a helper thread (with this
    thread's context: Prefect's run context, for logging) and this one waits in short steps. An exception raised
    here (TerminationSignal, KeyboardInterrupt) leaves the helper behind: ending the process (or ``ray_session``
    shutting the local Ray down) ends the controller and its workers. Off the main thread, Ray Train installs
    no SIGINT handler of its own either (one that kept the controller alive after the fit).

    A lost run lease (``lease``) ends the fit at once: its controller is killed, with its workers, whatever Ray
    this is (a cluster outlives the driver's connection), and RunLeaseLostError is raised.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - handed over to the waiting thread as it is, whatever it is
            outcome["error"] = exc

    context = contextvars.copy_context()
    helper = threading.Thread(target=context.run, args=(run,), name="ray-train-fit", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(timeout=0.2)
        if lease is not None and lease.lost() is not None:
            abort = getattr(trainer, "abort", None)
            if abort is not None:
                abort()
            lease.check()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def build_trainer(
    config: TrainingConfig,
    dataset: DatasetRef | None,
    run_key: str,
    runs: StorageLocation,
    *callbacks: RayTrainCallback,  # UserCallbacks and ControllerCallbacks; they run on the controller
    pins: tuple[frozenset[str], dict[str, str]] = (frozenset(), {}),
    spec: Any = None,
    resume_point: Any = None,
) -> TorchTrainer:
    # torch loads here, not when the flow module is imported: a Prefect worker needs no CUDA to plan runs.
    from ray.train.torch import TorchConfig

    from raytrain_tasks.failures import StopOnRepeatedFailure
    from raytrain_tasks.train_loop import WorkerSpec, train_loop_per_worker
    from tasks.trainer import RunTrainer

    if not config.cpus_per_worker:
        raise ValueError("cpus_per_worker is unset: build the trainer from check_cluster's sized config")
    low, high = config.worker_range
    data: dict[str, Any] = {}
    train_func: Any = train_loop_per_worker
    score_attribute, score_order = config.selection.name, config.selection.order
    if spec is not None:
        from tasks.user_fit import trainer_function

        train_func, loop_config, data = trainer_function(config, spec, workers_code_dir(config), resume_point)
        score_attribute, score_order = spec.metric.name, spec.metric.order
    else:
        assert dataset is not None
        loop_config = WorkerSpec(config=config, dataset=dataset, preexisting=pins[0], pinned=pins[1]).model_dump(
            mode="json"
        )
    if dataset is not None and config.data_loader == "ray_data":
        from raytrain_tasks.ingest import data_config, ray_datasets

        datasets = ray_datasets(config, dataset, run_logger())
        data = {"datasets": datasets, "dataset_config": data_config(datasets["train"], low if low == high else 0)}
    return RunTrainer(
        train_func,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="nccl" if config.use_gpu else "gloo"),
        **data,
        scaling_config=ray.train.ScalingConfig(
            # A (min, max) pair makes the worker group elastic (Ray Train V2).
            num_workers=(low, high) if high > low else low,  # type: ignore[arg-type]
            use_gpu=config.use_gpu,
            resources_per_worker={"CPU": config.cpus_per_worker, **({"GPU": 1} if config.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=run_key,
            storage_path=runs.path,
            storage_filesystem=runs.filesystem,
            failure_config=ray.train.FailureConfig(
                max_failures=config.max_failures,
                # Ray's default (-1) retries a worker group that cannot start forever.
                controller_failure_limit=max(1, config.max_failures),
            ),  # type: ignore[call-arg]  # mypy resolves ray.train to the V1 classes; V2 is used at runtime
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=config.checkpoints_to_keep,
                checkpoint_score_attribute=score_attribute,
                checkpoint_score_order=score_order,
            ),
            callbacks=[*callbacks, StopOnRepeatedFailure(run_key)],  # type: ignore[arg-type,list-item]  # V2, see above
        ),
    )


def summarize(
    result: ray.train.Result,
    config: TrainingConfig,
    run_key: str,
    run_dir: StorageLocation,
    run_id: str,
    experiment_id: str,
    backend: str,
    reopened: bool,
) -> FitResult:
    latest = result.checkpoint
    if latest is None:
        raise TrainingError(f"training run {run_key} finished without a checkpoint; nothing to register")
    history = _read_history(latest)
    metric = config.selection.name
    sign = 1.0 if config.selection.higher_is_better else -1.0  # higher is better after the sign
    scored = [
        (sign * metrics.get(metric, sign * float("-inf")), checkpoint)
        for checkpoint, metrics in result.best_checkpoints or []
    ]
    best_checkpoint = max(scored, key=lambda pair: pair[0])[1] if scored else latest
    best = _read_state(best_checkpoint)
    return FitResult(
        run_key=run_key,
        run_uri=run_dir.uri,
        mlflow_run_id=run_id,
        mlflow_experiment_id=experiment_id,
        backend=backend,
        epochs_completed=len(history),
        best_epoch=epoch_number(best["epoch"]),
        best_checkpoint_uri=_checkpoint_uri(run_dir, best_checkpoint),
        best_metrics={k: float(v) for k, v in best["metrics"].items()},
        final_metrics=history[-1] if history else {},
        history=history,
        reopened_mlflow_run=reopened,
    )


def _read_state(checkpoint: ray.train.Checkpoint) -> dict[str, Any]:
    path = f"{checkpoint.path.rstrip('/')}/{STATE_FILE}"
    assert checkpoint.filesystem is not None  # Ray Train always attaches the storage filesystem
    with checkpoint.filesystem.open_input_stream(path) as stream:
        return json.loads(stream.read())


def _read_history(checkpoint: ray.train.Checkpoint) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in entry.items()} for entry in _read_state(checkpoint)["history"]]


def _checkpoint_uri(run_dir: StorageLocation, checkpoint: ray.train.Checkpoint) -> str:
    return run_dir.child(checkpoint_name(checkpoint.path)).uri


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


def run_description(config: TrainingConfig, run_key: str, run_dir: StorageLocation, origin: dict[str, str]) -> str:
    """The MLflow run's description (``mlflow.note.content``, Markdown): what ran, from where, and how to go on."""
    workers = f"{config.num_workers}" + (f"-{config.max_workers}" if config.max_workers else "")
    what = f"`{config.train_code}`" if config.train_code else f"**{config.model}** on `{config.dataset}`"
    lines = [
        f"{what}: {config.epochs} epochs, {workers} Ray Train workers "
        f"({'GPU, nccl' if config.use_gpu else 'CPU, gloo'}), data loader `{config.data_loader}`.",
        "",
        f"- run key `{run_key}`: continue an interrupted run with `resume={run_key}`",
        f"- checkpoints: `{run_dir.uri}`",
    ]
    flow_run = origin.get("prefect.flow_run_url") or origin.get("prefect.flow_run_id")
    if flow_run:
        via = f" of deployment `{origin['prefect.deployment_name']}`" if "prefect.deployment_name" in origin else ""
        lines.append(f"- Prefect flow run{via}: {flow_run} (the latest one that trained this run)")
    lines.append(f"- code: `{ENTRY_POINT}` at commit `{tracking.code_version()}`")
    return "\n".join(lines)


def _run_tags(
    config: TrainingConfig, dataset: DatasetRef | None, run_key: str, run_dir: StorageLocation, backend: str
) -> dict[str, str]:
    lineage = (
        {"prefect_raytrain.dataset_hash": dataset.content_hash, "prefect_raytrain.dataset_uri": dataset.uri}
        if dataset is not None
        else {"prefect_raytrain.train_code": config.train_code}
    )
    tags = {
        tracking.DRIVER_TAG: tracking.this_driver(),
        "prefect_raytrain.ray_run_name": run_key,
        "prefect_raytrain.storage": run_dir.uri,
        **lineage,
        "prefect_raytrain.num_workers": str(config.num_workers),
        "prefect_raytrain.use_gpu": str(config.use_gpu).lower(),
        "prefect_raytrain.backend": backend,
        "prefect_raytrain.data_loader": config.data_loader,
        "prefect_raytrain.ray_cluster": ray.get_runtime_context().gcs_address,
        "mlflow.source.git.commit": tracking.code_version(),
    }
    return tags
