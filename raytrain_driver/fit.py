"""The fit of one run key: Ray Train's TorchTrainer, checkpointing every epoch to storage, logged to MLflow.

The run key names the Ray Train run (``<storage>/runs/<run key>``) and tags the MLflow run. Calling this
again with the same key (a Prefect retry, or ``resume``) continues from the latest registered checkpoint
in the same MLflow run. The Prefect task (tasks/fit.py) and a fit's Ray Job (raytrain_driver/fit_job.py) run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

import ray
import ray.train

from raytrain_driver import evaluation
from raytrain_driver.cluster import ray_session
from raytrain_driver.fit_context import FitContext
from raytrain_driver.fit_record import FitResult, OpenRun, finished_fit, write_fit_record
from raytrain_driver.hooks import EpochView, controller_callbacks, progress_page, run_logger, state_dir, stopped_by
from raytrain_driver.lease import run_lease
from raytrain_driver.origin import data_loader_of, run_description, run_tags
from raytrain_driver.preflight import (
    check_cluster,
    check_long_run_settings,
    check_resume,
    check_spec_data,
    check_step_time,
    data_tasks_during_fit,
    resolve_code,
    shown_params,
)
from raytrain_driver.ray_record import refuse_unsafe_record
from raytrain_driver.sizing import FitPlan
from raytrain_tasks.config import TrainingConfig, check_run_key
from raytrain_tasks.errors import (
    RunLeaseLostError,
)
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import redacted_errors
from raytrain_tasks.stop_requests import driver_stop_actor
from raytrain_tasks.storage.locations import StorageLocation
from raytrain_tasks.tracking import pins, run_owner
from raytrain_tasks.tracking import runs as tracking
from raytrain_tasks.tracking.controller import MlflowEpochLogger, OpenMlflowEarly, RestartGuard, SilentRanks
from raytrain_tasks.tracking.names import LAST_STEP_TAG, pinned_digests

if TYPE_CHECKING:
    from collections.abc import Callable

    from raytrain_tasks.api import TrainFunc


def fit_in_this_process(
    config: TrainingConfig,
    dataset: RunData | None,
    run_key: str,
    runs: StorageLocation,
    origin: dict[str, str],
) -> FitResult:
    """The fit with this process as Ray Train's driver, under the run's lease. ``runs``: <storage>/runs;
    ``origin``: the MLflow run's name and the tags that lead back to the Prefect flow run (tasks/fit.py)."""
    run_dir = runs.child(run_key)
    with redacted_errors():
        check_run_key(run_key)  # it names a folder in storage and goes into MLflow filters
        if config.resume:  # before the lease: a resume that cannot go on leaves nothing in storage either
            check_resume(config, run_key, run_dir)
        # One driver per run key, whatever host it runs on (raytrain_driver/lease.py).
        with run_lease(
            run_dir, run_key, run_owner.this_driver(), config.run_lease_seconds, holder_alive=run_owner.driver_alive
        ) as lease:
            # Under the lease (no driver of ours writes the record now), before Ray Train reads it.
            refuse_unsafe_record(run_key, run_dir)
            # Resolved before Ray starts: a failure names train_code.
            spec, client = resolve_code(config), tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
            return _distributed_fit(FitContext(config, dataset, run_key, runs, origin, spec, client, lease))


def _distributed_fit(fit: FitContext) -> FitResult:
    """The fit's phases: pre-flight, open the MLflow run, train, record. Pre-flight goes cheapest first (the user's
    code imports, MLflow answers, Ray is reachable and can host the workers, every node can write storage);
    nothing is created (no MLflow run, no checkpoint) until it holds, and the lease taken by the caller is removed
    with the folders it made if it fails."""
    config, client, run_key = fit.config, fit.client, fit.run_key
    run_id: str | None = None
    with ray_session(config):
        try:
            ray_datasets = check_spec_data(config, fit.spec, fit.dataset)  # a TrainSpec's data() may build them
            check_long_run_settings(config, fit.spec, ray_datasets)
            plan = check_cluster(config, fit.runs, client, run_key, data_tasks_during_fit(fit.spec))
            experiment_id = tracking.ensure_experiment(
                client, config.experiment_name, config.mlflow_tracking_uri, config.storage_path
            )
            run_owner.mark_dead_runs_killed(client, experiment_id, found_by=run_key)
            finished = finished_fit(fit.run_dir, client, experiment_id, run_key)
            if finished is not None:
                return _confirm_finished(fit, experiment_id, finished)
            check_step_time(config, client, experiment_id, run_key)  # before the run it continues is reopened
            run_id, reopened = _start_run(fit, plan, experiment_id, data_loader_of(config, ray_datasets))
            opened = _prepare_resume(fit, OpenRun.new(run_id, experiment_id, reopened, plan.backend))
            result = _train(fit, plan, opened)
            # Pins the controller could not write to MLflow during an outage (kept in the journal meanwhile).
            pins.pins_from_journal(client, run_id, opened.journal)
            return _record_user_code(fit, opened, result, ray_datasets)
        except BaseException as exc:
            if run_id is None:
                raise
            # Inside the Ray session, so before a local Ray is shut down on the way out: a cancellation's runner
            # kills this process 30 s after its SIGTERM, and ray.shutdown() with the fit's thread still waiting on
            # the controller can take that long or end the process.
            _end_unfinished_run(exc, fit, run_id)


def _confirm_finished(fit: FitContext, experiment_id: str, finished: FitResult) -> FitResult:
    """Everything was trained and recorded earlier: check the settings and the data match, train nothing."""
    config, spec = fit.config, fit.spec
    dataset_hash = fit.dataset.content_hash if fit.dataset is not None else _spec_data_digest(config, spec)
    tracking.check_resumable(fit.client, experiment_id, fit.run_key, shown_params(config, spec), dataset_hash)
    tracking.finish_run(fit.client, finished.mlflow_run_id)
    run_logger().info("run key %s finished all %d epochs earlier; nothing to train", fit.run_key, config.epochs)
    return finished


def _spec_data_digest(config: TrainingConfig, spec: TrainFunc) -> str | None:
    """A TrainSpec's own data (no ``prepare``), hashed here as its workers hash it: a finished run's resume trains
    nothing, so no worker would see that it changed. None for other code, for data pinned by ``prepare``'s stored
    version, and for Ray Datasets (hashing them would read them whole)."""
    from raytrain_tasks.trainspec.checkpoint import capture_rng_state, restore_rng_state
    from raytrain_tasks.trainspec.data import data_digest
    from raytrain_tasks.trainspec.loop import SpecTrainFunc, seed_as_workers
    from raytrain_tasks.user_code import user_config

    func = spec.train_func
    if not isinstance(func, SpecTrainFunc) or func.spec.prepare is not None or func.ray_data:
        return None
    # The workers seed before they call data(): a data() that draws (random_split, synthetic rows) draws alike.
    state = capture_rng_state()
    try:
        seed_as_workers(config.seed)
        return data_digest(func.spec.data(user_config(config, spec)))  # check_data has checked what it gives
    finally:
        restore_rng_state(state)


def _start_run(fit: FitContext, plan: FitPlan, experiment_id: str, data_loader: str) -> tuple[str, bool]:
    """A new MLflow run for the run key, or its earlier one reopened (a resume, a retry): (run id, reopened). A
    resume that runs other code than the run started with says so, in the log and in CODE_CHANGED_TAG."""
    from raytrain_driver.code_identity import CODE_CHANGED_TAG, code_change

    config, run_key, run_dir, origin, client = fit.config, fit.run_key, fit.run_dir, fit.origin, fit.client
    tags = (
        run_tags(config, fit.dataset, run_key, run_dir, plan.backend, data_loader)
        | {tracking.CPUS_PER_WORKER_TAG: f"{plan.cpus_per_worker:g}"}
        | {k: v for k, v in origin.items() if k != "run_name"}
        | {tracking.NOTE_TAG: run_description(config, run_key, run_dir, origin, data_loader)}
    )
    earlier = tracking.find_run(client, experiment_id, run_key)  # its tags, before the reopened run's replace them
    run_id, reopened = tracking.start_or_reopen_run(
        client,
        experiment_id,
        run_key,
        run_name=origin.get("run_name", run_key),
        tags=tags,
        params=shown_params(config, fit.spec),
    )
    if earlier is not None and (change := code_change(earlier.data.tags, tags, run_key)):
        run_logger().warning("%s", change)
        client.set_tag(run_id, CODE_CHANGED_TAG, change)
    if not reopened and fit.dataset is not None:
        evaluation.log_dataset_input(client, run_id, fit.dataset)
    run_logger().info(
        "run key %s: %s MLflow run %s; checkpoints in %s",
        run_key,
        "continuing" if reopened else "new",
        run_id,
        run_dir.uri,
    )
    return run_id, reopened


def _prepare_resume(fit: FitContext, opened: OpenRun) -> OpenRun:
    """``opened`` with what this fit may resume from: the newest checkpoint whose files still hash to the digest
    MLflow recorded when it was committed (``fit_steps.choose_resume_point``); storage alone vouches for nothing."""
    config, run_key, run_dir, client = fit.config, fit.run_key, fit.run_dir, fit.client
    run_id, reopened = opened.run_id, opened.reopened
    logger = run_logger()
    journal = pins.pin_journal(config, run_key, state_dir())
    if reopened and (recovered := pins.pins_from_journal(client, run_id, journal)):
        logger.info(
            "recorded in MLflow the pins of %s from this machine's pin journal (MLflow was down when they "
            "were committed)",
            ", ".join(recovered),
        )
    pinned = pinned_digests(client.get_run(run_id).data.tags) if reopened else {}
    from raytrain_driver.fit_steps import choose_resume_point

    resume_point = choose_resume_point(run_dir, pinned)
    if resume_point.rejected:
        logger.warning(
            "run %s resumes from checkpoint %s, not a newer one: %s", run_key, resume_point.fallback, resume_point.why
        )
        client.set_tag(run_id, "prefect_raytrain.resume_fallback", resume_point.why[:4000])
    if resume_point.start:  # after a fallback too: where the run goes on, in the same words as ever
        uri = run_dir.child(resume_point.start).uri
        say_resume(logger, config, uri, resume_point.epoch, "; its files hash to the digest recorded at commit")
    return dataclasses.replace(opened, journal=journal, pinned=pinned, resume_point=resume_point)


def _train(fit: FitContext, plan: FitPlan, opened: OpenRun) -> ray.train.Result:
    """Ray Train's fit, its reports logged to the MLflow run as they come, the run page following it."""
    from raytrain_driver.fit_steps import left_off
    from raytrain_driver.trainer import build_trainer, fit_interruptibly
    from raytrain_tasks.trainspec.loop import SpecTrainFunc

    config, spec, lease = fit.config, fit.spec, fit.lease
    uri, run_id = config.mlflow_tracking_uri, opened.run_id
    callbacks: list[Any] = [OpenMlflowEarly(uri, run_id)]
    from raytrain_tasks.user_code import code_error_stopper

    epochs = MlflowEpochLogger(uri, run_id, step_key=spec.selection.name, journal=opened.journal)
    # The stopper first: a checkpoint it refuses is never logged or pinned, so no resume starts from it.
    callbacks += [code_error_stopper(config.train_code, spec.selection.name), epochs, RestartGuard(epochs)]
    callbacks.append(SilentRanks(uri, run_id))  # which rank a hang timeout found silent
    callbacks += controller_callbacks()  # a sweep's trial reports each epoch to Ray Tune (raytrain_driver.tuning)
    # A TrainSpec's workers commit a checkpoint before a signal stops this driver (raytrain_tasks.stop_requests).
    # Not in a Ray Job: its supervisor kills the driver 3 s after its SIGTERM, before a checkpoint could be pinned,
    # and the fit's orchestrator re-attaches to the job instead of stopping it.
    saves = isinstance(spec.train_func, SpecTrainFunc) and config.launch_mode == "driver"
    stop = driver_stop_actor() if saves else None
    trainer = build_trainer(fit, plan, opened.resume_point, callbacks, stop)
    # Off a Prefect run (a Ray Job) there is no run page to update: the job's submitter shows the progress.
    view = EpochView(expects=tuple(dict.fromkeys((spec.selection.name, spec.gate.name))), left_off=left_off(spec))
    page = progress_page()
    progress = page(fit.client, run_id, config.epochs, run_logger(), view) if page else None
    # Again as late as the driver can: Ray Train's controller reads the record once, as it starts.
    refuse_unsafe_record(fit.run_key, fit.run_dir)
    with (
        tracking.system_metrics(config.system_metrics, uri, run_id, opened.reopened),
        progress or contextlib.nullcontext(),
    ):
        return fit_interruptibly(trainer, lease, saves_first(fit.client, run_id, stop) if stop is not None else None)


# How long a stopping driver waits for its workers' last checkpoint: within the CLI's 10 s deadline on stopping.
SAVE_FIRST_S = 5.0


def saves_first(client: Any, run_id: str, stop: Any) -> Callable[[], None]:
    """What the driver does when a signal stops it mid-fit: ask the workers (``stop``, their ``DriverStop``) to
    commit a checkpoint at their next step, and wait until MLflow holds it (the controller pins a checkpoint there
    once Ray Train has registered it: a resume starts from it), at most ``SAVE_FIRST_S``."""

    def save() -> None:
        logger = run_logger()
        stop.ask.remote()
        logger.warning(
            "stopping: the workers commit a checkpoint at their next step first (at most %g s)", SAVE_FIRST_S
        )
        deadline = time.monotonic() + SAVE_FIRST_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
            step = _saved_step(stop)
            pinned = _last_step(client, run_id) if step is not None else None
            if pinned is not None and pinned.startswith(f"{step},"):
                logger.warning("checkpoint at step %s committed before stopping", pinned)
                return
        logger.warning("no checkpoint was committed within %g s: the run continues from its last one", SAVE_FIRST_S)

    return save


def _saved_step(stop: Any) -> int | None:
    """The global step of the checkpoint the workers committed for the driver's stop; None before (or if the
    actor cannot answer now)."""
    try:
        return ray.get(stop.saved_step.remote(), timeout=1.0)  # type: ignore[no-any-return]
    except ray.exceptions.RayError:
        return None


def _last_step(client: Any, run_id: str) -> str | None:
    """The step of the run's newest pinned checkpoint, as MLflow has it; None when it cannot say now."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id).data.tags.get(LAST_STEP_TAG)  # type: ignore[no-any-return]
    except (MlflowException, OSError):
        return None


def _record_user_code(fit: FitContext, opened: OpenRun, result: ray.train.Result, ray_datasets: bool) -> FitResult:
    from raytrain_driver.fit_steps import record_fit

    done = record_fit(fit, result, opened).model_copy(update={"ray_datasets": ray_datasets})
    write_fit_record(fit.run_dir, fit.client, opened.run_id, done, fit.lease)  # what a Ray Job's submitter reads
    tracking.finish_run(fit.client, opened.run_id)
    return done


def _end_unfinished_run(exc: BaseException, fit: FitContext, run_id: str) -> NoReturn:
    """The MLflow run of a fit that raised ``exc``: left to the lease's new holder, KILLED (a signal), or FAILED."""
    config, run_key, client, lease = fit.config, fit.run_key, fit.client, fit.lease
    if lease is not None and lease.lost() is not None:
        # The run and its MLflow run belong to the lease's new holder now: marking it KILLED or FAILED here
        # would end the run that driver is training.
        run_logger().error("run %s: this driver lost the lease; MLflow run %s is left to its holder", run_key, run_id)
        if isinstance(exc, RunLeaseLostError):
            raise exc
        try:
            lease.check()
        except RunLeaseLostError as lost:
            raise lost from exc
    if (how := stopped_by(exc)) is not None:  # a Prefect cancellation (SIGTERM), Ctrl-C
        tracking.stop_run(
            client,
            run_id,
            f"stopped by {how} at {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC (a cancellation from Prefect, an "
            f"interrupt, or the machine shutting down); its checkpoints are kept: continue it with "
            f"resume={run_key}",
            exc,
        )
        raise exc
    from raytrain_driver.trainer import training_error

    error = training_error(exc, run_key, config)
    if isinstance(error, RunLeaseLostError):  # its workers saw the lease taken before this driver did
        run_logger().error(
            "run %s: its lease is another driver's; MLflow run %s is left to its holder", run_key, run_id
        )
        raise error from exc
    tracking.fail_run(client, run_id, error)
    if error is exc:
        raise exc
    raise error from exc


def say_resume(logger: Any, config: TrainingConfig, uri: str, epoch: int | None, verified: str = "") -> None:
    """``resuming from checkpoint <uri> (epoch 2 of 4): next epoch 3``, for any code: the epoch (from 1) it holds,
    where known (a ``train_func`` that reports none: the folder alone), and how it was verified (``verified``)."""
    if epoch is None:
        logger.info("resuming from checkpoint %s%s", uri, verified)
    elif epoch >= config.epochs:
        logger.info(
            "resuming from checkpoint %s: epoch %d, the last, was committed; finishing the run%s", uri, epoch, verified
        )
    else:
        logger.info(
            "resuming from checkpoint %s (epoch %d of %d): next epoch %d%s",
            uri,
            epoch,
            config.epochs,
            epoch + 1,
            verified,
        )
