"""launch_mode=ray_job: the fit's driver runs on the cluster as a Ray Job, so the orchestrator may die.

The Prefect task submits ``python -m raytrain_driver.fit_job`` with ``JobSubmissionClient`` (the one adapter for Ray's
job API is this module), streams the job's log into its own, and maps the job's end to its state. The job is
named after the run key: ``prt-fit-<run key>``, then ``-1``, ``-2``... for later attempts. A task that finds
the run key's newest job still PENDING or RUNNING (its flow-run process was killed; this is the continuation)
re-attaches to it instead of starting another, so no epoch is trained twice. A finished or stopped job is
followed by a new one, which resumes from the run's last checkpoint like any resume.

Cancelling the task (Prefect's SIGTERM) or Ctrl-C stops the job; a SIGKILL of the flow-run process cannot, and
the job keeps training. The job holds the run's lease (raytrain_driver/lease.py) while it trains.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import shlex
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import raytrain_driver
import raytrain_tasks
import raytrain_tasks.errors
from raytrain_driver.fit_context import FitContext
from raytrain_driver.hooks import stopped_by
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import CheckpointError, ClusterError, TrainingError
from raytrain_tasks.prepared import RunData
from raytrain_tasks.redact import redact

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

    from raytrain_driver.fit_record import FitResult
    from raytrain_tasks.storage.locations import StorageLocation

ACTIVE = ("PENDING", "RUNNING")
# The last line the job prints when the fit raises: ERROR_MARKER {"type": ..., "message": ...}. The task raises
# the same error class (from raytrain_tasks.errors only), so Prefect's retry condition treats it alike.
ERROR_MARKER = "PRT-FIT-ERROR"
STOP_WAIT_S = 30.0
POLL_S = 1.0


def submission_ids(run_key: str) -> list[str]:
    """The names the run key's jobs get, in order (the first of them, then numbered attempts)."""
    return [f"prt-fit-{run_key}"] + [f"prt-fit-{run_key}-{n}" for n in range(1, 1000)]


def connect(config: TrainingConfig) -> JobSubmissionClient:
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(config.dashboard_url)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(
            f"launch_mode='ray_job' cannot reach the Ray dashboard at {config.dashboard_url}: {redact(str(exc))}; "
            "set `ray_dashboard_url` to the cluster's dashboard (what `ray job submit --address` takes)"
        ) from exc


def jobs_of(client: JobSubmissionClient, run_key: str) -> dict[str, str]:
    """submission id -> status of every job this run key has had on the cluster."""
    try:
        jobs = client.list_jobs()
    except (ConnectionError, RuntimeError) as exc:  # fail closed: without the list, a second job could start
        raise ClusterError(
            f"cannot list the Ray cluster's jobs: {redact(str(exc))}; check `ray_dashboard_url`"
        ) from exc
    names = set(submission_ids(run_key))
    return {job.submission_id: str(job.status.value) for job in jobs if job.submission_id in names}


def fit_as_ray_job(
    config: TrainingConfig,
    dataset: RunData | None,
    run_key: str,
    runs: StorageLocation,
    origin: dict[str, str],
) -> FitResult:
    """Run (or re-attach to) the run key's fit as a Ray Job and return what it recorded."""
    run_dir = runs.child(run_key)
    from raytrain_driver.cluster import ray_session
    from raytrain_driver.fit_record import finished_fit
    from raytrain_driver.hooks import run_logger
    from raytrain_driver.preflight import check_cluster, resolve_code
    from raytrain_tasks.tracking import runs as tracking

    logger = run_logger()
    # The same pre-flight as a driver run, from here: a wrong setting fails before any job is submitted.
    mlflow = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    spec = resolve_code(config)  # fails here, naming train_code, before anything is submitted
    with ray_session(config):
        # The job's own pre-flight on the cluster runs the code's data check (check_spec_data) where its data is,
        # and sizes for a TrainSpec's lazy Ray Dataset splits (data_tasks_during_fit), which this one cannot see.
        check_cluster(config, runs, mlflow, run_key, spec.datasets is not None)
    client = connect(config)
    submission_id = _attach_or_submit(client, FitContext(config, dataset, run_key, runs, origin, spec, mlflow))
    status, message = follow(client, submission_id, logger)
    if status == "SUCCEEDED":
        experiment = mlflow.get_experiment_by_name(config.experiment_name)
        fit = finished_fit(run_dir, mlflow, experiment.experiment_id, run_key) if experiment else None
        if fit is None:  # fail closed: nothing unverified goes on to the promotion gate
            raise TrainingError(
                f"Ray Job {submission_id} succeeded but run {run_key} has no fit record whose digest MLflow "
                f"holds under {run_dir.uri}; check that `storage_path` and `mlflow_tracking_uri` name the same "
                "storage and server from the cluster as from here"
            )
        return fit
    raise job_error(client, submission_id, status, message, run_key)


def _attach_or_submit(client: JobSubmissionClient, fit: FitContext) -> str:
    """The run key's job to follow: the one still training (or done while nobody watched), else a new one that
    resumes from the last checkpoint."""
    from raytrain_driver.hooks import run_logger

    config, dataset, run_key, run_dir, logger = fit.config, fit.dataset, fit.run_key, fit.run_dir, run_logger()
    existing = jobs_of(client, run_key)
    newest = next((name for name in reversed(submission_ids(run_key)) if name in existing), None)
    if newest is not None and existing[newest] in (*ACTIVE, "SUCCEEDED"):
        # Still training (or done while nobody watched): follow it; a second job would train epochs twice.
        submission_id = newest
        logger.info(
            "re-attaching to Ray Job %s (%s), which went on without this process, for run key %s",
            newest,
            existing[newest],
            run_key,
        )
    else:
        if config.resume and not run_dir.child("checkpoint_manager_snapshot.json").exists() and newest is None:
            raise CheckpointError(
                f"cannot resume run {run_key}: no checkpoints under {run_dir.uri} and no Ray Job for it on the "
                "cluster; check `resume`, `storage_path` and `ray_address` (they must match the interrupted run)"
            )
        submission_id = submission_ids(run_key)[len(existing)]
        payload = {
            # The job runs the fit as a driver on the cluster, where RAY_ADDRESS (set by Ray) reaches it.
            "config": config.model_copy(update={"launch_mode": "driver"}).model_dump(mode="json"),
            # None: train_code without prepare reads its own data
            "dataset": dataset.model_dump(mode="json") if dataset is not None else None,
            "run_key": run_key,
            "origin": {**fit.origin, "prefect_raytrain.ray_job": submission_id},
        }
        _submit(client, config, submission_id, payload)
        logger.info(
            "submitted Ray Job %s for run key %s to %s%s",
            submission_id,
            run_key,
            config.dashboard_url,
            f" (after {newest}, {existing[newest]})" if newest else "",
        )
    return submission_id


def _submit(client: JobSubmissionClient, config: TrainingConfig, submission_id: str, payload: dict[str, Any]) -> None:
    from raytrain_driver.cluster import cluster_runtime_env
    from raytrain_tasks.user_code import shipped_module

    # This checkout's code, as the driver's workers get raytrain_tasks, and the user's own package (train_code):
    # the job's driver imports it from there and its workers inherit it. Third-party packages come from the
    # cluster's image. Credentials only with `forward_credentials_to_cluster` (raytrain_driver/cluster.py).
    modules = [str(Path(raytrain_driver.__file__).parent), str(Path(raytrain_tasks.__file__).parent)]
    user_module = shipped_module(config.train_code) if config.train_code else None
    runtime_env = {
        "py_modules": modules + ([user_module] if user_module else []),
        "env_vars": cluster_runtime_env(config)["env_vars"],
    }
    entrypoint = f"python -m raytrain_driver.fit_job {shlex.quote(json.dumps(payload, separators=(',', ':')))}"
    try:
        client.submit_job(
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env=runtime_env,
            metadata={"prefect_raytrain.run_key": payload["run_key"]},
        )
    except (ConnectionError, RuntimeError) as exc:
        # Another submitter won the name (Ray refuses a duplicate id): that job is this run's, nothing is lost.
        raise ClusterError(f"could not submit Ray Job {submission_id}: {redact(str(exc))}") from exc


def follow(client: JobSubmissionClient, submission_id: str, logger: Any, poll_s: float = POLL_S) -> tuple[str, str]:
    """Stream the job's log into ``logger`` until the job ends; return its final status and message.

    A stop from outside here (a Prefect cancellation's TerminationSignal, Ctrl-C; see ``logs.stopped_by``) stops
    the job, then is raised again.
    """
    stop_tail = threading.Event()
    tail = threading.Thread(
        target=contextvars.copy_context().run,
        args=(_tail, client, submission_id, logger, stop_tail),
        name=f"tail-{submission_id}",
        daemon=True,
    )
    tail.start()
    try:
        while True:
            info = client.get_job_info(submission_id)
            status = str(info.status.value)
            if status not in ACTIVE:
                tail.join(timeout=10)  # the rest of the log
                return status, info.message or ""
            time.sleep(poll_s)
    except BaseException as exc:
        if stopped_by(exc) is None:
            raise
        logger.warning("stopping Ray Job %s (the task was cancelled or interrupted)", submission_id)
        stop(client, submission_id, logger)
        raise
    finally:
        stop_tail.set()


def stop(client: JobSubmissionClient, submission_id: str, logger: Any) -> None:
    """Ask Ray to stop the job (SIGTERM to its driver, which marks its MLflow run KILLED) and wait for it."""
    client.stop_job(submission_id)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        if str(client.get_job_status(submission_id).value) not in ACTIVE:
            logger.warning("Ray Job %s stopped; its checkpoints are kept", submission_id)
            return
        time.sleep(0.5)
    logger.error("Ray Job %s did not stop within %.0f s; check it on the dashboard", submission_id, STOP_WAIT_S)


def _tail(client: JobSubmissionClient, submission_id: str, logger: Any, stop_tail: threading.Event) -> None:
    async def pump() -> None:
        async for chunk in client.tail_job_logs(submission_id):
            for line in chunk.splitlines():
                if line.strip():
                    logger.info("[%s] %s", submission_id, redact(line))
            if stop_tail.is_set():
                return

    try:
        asyncio.run(pump())
    except Exception as exc:  # noqa: BLE001 - the log stream is a view; the job's status decides the task
        logger.warning("stopped streaming the log of Ray Job %s: %s", submission_id, redact(str(exc)))


def job_error(client: JobSubmissionClient, submission_id: str, status: str, message: str, run_key: str) -> Exception:
    """The error the job's fit raised (its class from raytrain_tasks.errors, by name), or a TrainingError."""
    try:
        logs = client.get_job_logs(submission_id)
    except (ConnectionError, RuntimeError):
        logs = ""
    for line in reversed(logs.splitlines()):
        if line.startswith(ERROR_MARKER):
            try:
                raised = json.loads(line.removeprefix(ERROR_MARKER))
                kind = getattr(raytrain_tasks.errors, str(raised["type"]), None)
                text = str(raised["message"])
            except (ValueError, KeyError, TypeError):
                break
            if isinstance(kind, type) and issubclass(kind, Exception):
                return kind(f"{text} (in Ray Job {submission_id})")
            return TrainingError(f"Ray Job {submission_id}: {raised.get('type')}: {text}")
    return TrainingError(
        f"Ray Job {submission_id} for run {run_key} ended {status}: {redact(message)}. It can continue from its "
        f"last checkpoint with `resume={run_key}`"
    )
