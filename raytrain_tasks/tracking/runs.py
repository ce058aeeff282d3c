"""The MLflow run of a pipeline run: found by its run key, so retries and resumes reuse it."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_tasks.config import RESUME_MAY_CHANGE, check_run_key
from raytrain_tasks.environment import apply_mlflow_client_defaults
from raytrain_tasks.errors import TrackingError
from raytrain_tasks.redact import redact, redact_exception, redact_uri
from raytrain_tasks.tracking.run_owner import DRIVER_TAG, KILLED_TAG, driver_alive, this_driver

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

RUN_KEY_TAG = "prefect_raytrain.run_key"
# The CPUs each worker got (the param is the setting, 0 when sized to the cluster).
CPUS_PER_WORKER_TAG = "prefect_raytrain.cpus_per_worker"
ERROR_TAG = "prefect_raytrain.error"


def connect(tracking_uri: str, s3_endpoint_url: str = "") -> MlflowClient:
    """A client for ``tracking_uri`` that has answered one request, or a TrackingError naming the setting."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    apply_mlflow_client_defaults()  # fail in seconds, not after MLflow's default minutes of retries
    if s3_endpoint_url:
        # MLflow's S3 artifact store reads its endpoint from here; artifacts share the pipeline's S3 store.
        os.environ.setdefault("MLFLOW_S3_ENDPOINT_URL", s3_endpoint_url)
    local_db = _sqlite_path(tracking_uri)
    if local_db is not None:
        local_db.parent.mkdir(parents=True, exist_ok=True)
    # The registry explicitly: left out, MLflow takes MLFLOW_REGISTRY_URI from the environment and sends every
    # registry call there, with this process's MLflow credentials, wherever the tracking URI is pinned.
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    try:
        client.search_experiments(max_results=1)
    except (MlflowException, OSError) as exc:
        if getattr(exc, "error_code", "") in ("UNAUTHENTICATED", "PERMISSION_DENIED") or " 401 " in str(exc):
            raise TrackingError(
                f"MLflow at {redact_uri(tracking_uri)} refused this client's credentials ({redact(str(exc))}); "
                "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the "
                "environment, or fix the user:password in `mlflow_tracking_uri`"
            ) from redact_exception(exc)
        raise TrackingError(
            f"MLflow at {redact_uri(tracking_uri)} is unreachable or refused the request ({redact(str(exc))}); "
            "check `mlflow_tracking_uri` (empty uses a local SQLite store)"
        ) from redact_exception(exc)
    return client


def default_artifact_location(tracking_uri: str, storage_path: str) -> str | None:
    """A local store keeps artifacts beside its database, or in the pipeline's bucket when storage is S3;
    a tracking server chooses its own (its --artifacts-destination)."""
    local_db = _sqlite_path(tracking_uri)
    if local_db is None:
        return None
    if storage_path.startswith("s3://"):
        return f"{storage_path.rstrip('/')}/mlartifacts"
    return (local_db.parent / "mlartifacts").as_uri()


def ensure_experiment(client: MlflowClient, name: str, tracking_uri: str, storage_path: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            raise TrackingError(f"MLflow experiment {name!r} is deleted; restore it in the UI or set `experiment_name`")
        return str(experiment.experiment_id)
    from mlflow.exceptions import MlflowException

    try:
        location = default_artifact_location(tracking_uri, storage_path)
        return str(client.create_experiment(name, artifact_location=location))
    except MlflowException:
        # Another pipeline created it between our lookup and create.
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return str(experiment.experiment_id)


def find_run(client: MlflowClient, experiment_id: str, run_key: str) -> Any | None:
    check_run_key(run_key)  # it goes into a filter string
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=2)
    return runs[0] if runs else None


def existing_store(tracking_uri: str, s3_endpoint_url: str = "") -> MlflowClient | None:
    """``connect`` for a look that writes nothing: None for a local store that does not exist yet, which
    connecting would create."""
    local_db = _sqlite_path(tracking_uri)
    if local_db is not None and not local_db.exists():
        return None
    return connect(tracking_uri, s3_endpoint_url)


def experiments_with_run(client: MlflowClient, run_key: str) -> list[str]:
    """The names of the store's experiments that hold a run of ``run_key``."""
    check_run_key(run_key)  # it goes into a filter string
    names = {experiment.experiment_id: experiment.name for experiment in client.search_experiments()}
    if not names:
        return []
    runs = client.search_runs(list(names), filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=10)
    return sorted({names[run.info.experiment_id] for run in runs})


def earlier_share(client: MlflowClient, experiment_name: str, run_key: str) -> float | None:
    """The CPUs per worker an earlier attempt of ``run_key`` trained with; None for a new run, or a tag that is
    not a number (the share is then sized anew). Reads only: nothing is created for a run that has not started."""
    experiment = client.get_experiment_by_name(experiment_name)
    run = find_run(client, experiment.experiment_id, run_key) if experiment is not None else None
    try:
        share = float(run.data.tags[CPUS_PER_WORKER_TAG]) if run is not None else None
    except (KeyError, ValueError):
        return None
    return share if share is not None and math.isfinite(share) else None


_OPENED_RUN_KEYS: set[str] = set()


def opened_here(run_key: str) -> bool:
    """Whether this process opened (started or reopened) the MLflow run of ``run_key``: only then does a resume
    of the run key find a run to continue."""
    return run_key in _OPENED_RUN_KEYS


def start_or_reopen_run(
    client: MlflowClient,
    experiment_id: str,
    run_key: str,
    run_name: str,
    tags: dict[str, str],
    params: dict[str, Any],
) -> tuple[str, bool]:
    """The run for ``run_key``, RUNNING, with params and tags set; True when it already existed.

    A resume is checked before anything is written: changed settings, or a driver on this host that is still
    training the run, leave the earlier run exactly as it was.
    """
    existing = find_run(client, experiment_id, run_key)
    if existing is None:
        run = client.create_run(experiment_id, run_name=run_name, tags={RUN_KEY_TAG: run_key, **tags})
        run_id, reopened = run.info.run_id, False
        _log_params(client, run_id, params)
        _OPENED_RUN_KEYS.add(run_key)
        return run_id, reopened
    _check_params_unchanged(existing.data.params, params, run_key)
    _check_dataset_unchanged(existing.data.tags, tags.get(DATASET_HASH_TAG), run_key)
    driver = existing.data.tags.get(DRIVER_TAG, "")
    if existing.info.status == "RUNNING" and driver != this_driver() and driver_alive(driver) is True:
        raise TrackingError(
            f"run {run_key} is still being trained by process {driver} (MLflow run {existing.info.run_id}); "
            "wait for it or stop it before resuming"
        )
    run_id = existing.info.run_id
    client.update_run(run_id, status="RUNNING")
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    new = {k: v for k, v in params.items() if k not in existing.data.params}
    _log_params(client, run_id, new)
    _OPENED_RUN_KEYS.add(run_key)
    return run_id, True


def check_resumable(
    client: MlflowClient, experiment_id: str, run_key: str, params: dict[str, Any], dataset_hash: str | None
) -> None:
    """Raise TrackingError when ``run_key``'s MLflow run was started with other settings or other data (the
    prepared dataset's content hash; None: no prepared dataset to compare); writes nothing."""
    existing = find_run(client, experiment_id, run_key)
    if existing is not None:
        _check_params_unchanged(existing.data.params, params, run_key)
        _check_dataset_unchanged(existing.data.tags, dataset_hash, run_key)


# Set by raytrain_driver.fit at the run's start; a resume must match it.
DATASET_HASH_TAG = "prefect_raytrain.dataset_hash"


FIT_RECORD_TAG = "prefect_raytrain.fit_record_sha256"


NOTE_TAG = "mlflow.note.content"  # the run's description in the MLflow UI (Markdown)


def release_interrupted_reads(error: BaseException) -> None:
    """Let go of what the frames ``error`` came through still hold (and those of the errors it chains).

    A signal's exception (Prefect's TerminationSignal, KeyboardInterrupt) is raised wherever the main thread is,
    and SQLAlchemy closes a query's cursor only on an ``Exception`` (sqlalchemy.orm.loading.instances, 2.0): stopped
    between an MLflow query's execute and its fetch, the cursor stays open in the frame it was interrupted in, and
    with it its SQLite read lock, for as long as the traceback lives, which is while the stop is handled. Writing
    the run's end then waited 20 s (MLflow's busy timeout) for a lock this very process held, and failed: the run
    stayed RUNNING past the stop's deadline (test_signals, register-model, in CI). The frames keep their code and
    lines for the logs.
    """
    seen: set[int] = set()
    chained: list[BaseException | None] = [error]
    while chained:
        current = chained.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # the frames still executing (this handler's) are kept
        chained += [current.__cause__, current.__context__, *getattr(current, "exceptions", ())]


@contextmanager
def releasing_interrupted_reads() -> Iterator[None]:
    """For a block whose way out writes to MLflow (a ``finally``, an exit that ends the run): a stop raised in it
    (an exception that is no ``Exception``) lets go of the query it interrupted first."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, Exception):
            release_interrupted_reads(exc)
        raise


def finish_run(client: MlflowClient, run_id: str) -> None:
    client.set_terminated(run_id, status="FINISHED")


def fail_run(client: MlflowClient, run_id: str, error: BaseException) -> None:
    """Mark the run FAILED with the error (redacted) in ERROR_TAG; an unreachable MLflow is logged, not raised,
    so the original error stays the one the task fails with."""
    from mlflow.exceptions import MlflowException

    try:
        client.set_tag(run_id, ERROR_TAG, redact(f"{type(error).__name__}: {error}")[:4000])
        client.set_terminated(run_id, status="FAILED")
    except (MlflowException, OSError) as exc:
        logger.warning("could not mark MLflow run %s FAILED (%s); the next run of the experiment marks it", run_id, exc)


def stop_run(client: MlflowClient, run_id: str, reason: str, stop: BaseException) -> None:
    """Mark the run KILLED with ``reason`` in KILLED_TAG: it was stopped from outside (``stop``: a cancellation's
    TerminationSignal, a KeyboardInterrupt), it did not fail; its checkpoints stay for a resume. An unreachable
    MLflow is logged, not raised."""
    from mlflow.exceptions import MlflowException

    release_interrupted_reads(stop)
    try:
        client.set_tag(run_id, KILLED_TAG, redact(reason)[:4000])
        client.set_terminated(run_id, status="KILLED")
    except (MlflowException, OSError) as exc:
        logger.warning("could not mark MLflow run %s KILLED (%s); the next run of the experiment marks it", run_id, exc)


def stop_own_run(client: MlflowClient, experiment_name: str, run_key: str, reason: str) -> bool:
    """Mark ``run_key``'s MLflow run KILLED with ``reason`` when it is RUNNING and this process drives it (its
    DRIVER_TAG); True when it did. A run another process drives (a Ray Job's driver, a resume elsewhere) is
    left to that process. Errors are raised: the caller bounds and reports them."""
    experiment = client.get_experiment_by_name(experiment_name)
    run = find_run(client, experiment.experiment_id, run_key) if experiment is not None else None
    if run is None or run.info.status != "RUNNING" or run.data.tags.get(DRIVER_TAG) != this_driver():
        return False
    client.set_tag(run.info.run_id, KILLED_TAG, redact(reason)[:4000])
    client.set_terminated(run.info.run_id, status="KILLED")
    return True


# The URIs of the using_tracking_uri blocks open in this process (two pipelines may register in two threads), and
# what MLflow's globals and environment held before the first of them opened.
_URI_BLOCKS: list[str] = []
_URI_LOCK = threading.Lock()
_BEFORE_BLOCKS: list[Any] = []


@contextmanager
def using_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API pointed at `uri` for the block, its registry too (``models:/`` loads, the champion's
    download), whatever MLFLOW_REGISTRY_URI says; the previous URIs and environment come back after the last block
    open in the process ends (a thread's block ending leaves another thread's in place)."""
    # MLflow 3.17 keeps each URI in a module global and exports it to the environment; the public getters resolve
    # the environment too, so the globals are read to restore them exactly.
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    def point_at(tracking: str | None, registry: str | None) -> None:
        tracking_utils.set_tracking_uri(tracking)  # type: ignore[arg-type]  # None unsets it, as at start
        registry_utils.set_registry_uri(registry)  # type: ignore[arg-type]

    with _URI_LOCK:
        if not _URI_BLOCKS:
            env = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
            _BEFORE_BLOCKS[:] = [tracking_utils._tracking_uri, registry_utils._registry_uri, env]
        _URI_BLOCKS.append(uri)
        point_at(uri, uri)
    try:
        yield
    finally:
        with _URI_LOCK:
            _URI_BLOCKS.remove(uri)
            if _URI_BLOCKS:
                point_at(_URI_BLOCKS[-1], _URI_BLOCKS[-1])
            else:
                point_at(_BEFORE_BLOCKS[0], _BEFORE_BLOCKS[1])
                for name, value in _BEFORE_BLOCKS[2].items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value


@contextmanager
def system_metrics(enabled: bool, tracking_uri: str, run_id: str, resumed: bool) -> Iterator[None]:
    """Sample this node's CPU/memory/GPU into the run while the block runs (MLflow's own monitor)."""
    if not enabled:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=5, resume_logging=resumed, tracking_uri=tracking_uri)
    monitor.start()
    try:
        with releasing_interrupted_reads():  # finish() logs the last samples
            yield
    finally:
        monitor.finish()


def code_version() -> str:
    """The git commit the pipeline runs from, when it runs from a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def _log_params(client: MlflowClient, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)) for k, v in sorted(params.items())]
    for start in range(0, len(items), 100):
        client.log_batch(run_id, params=items[start : start + 100])


def _check_params_unchanged(logged: dict[str, str], params: dict[str, Any], run_key: str) -> None:
    # A resumed run must train what it started with, or its checkpoints and metrics would not add up.
    changed = {
        key: (logged[key], str(value))
        for key, value in params.items()
        if key in logged and key not in RESUME_MAY_CHANGE and logged[key] != str(value)
    }
    # A setting of the code's that it no longer has (a default removed from the code) trains differently too.
    changed |= {key: (logged[key], "(none)") for key in logged if key.startswith("train_config.") and key not in params}
    if changed:
        details = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in sorted(changed.items()))
        if changed.get("train_code", ("-",))[0] == "":
            # Started by the built-in classifier of releases up to 0.2, whose code is gone (CHANGELOG.md).
            raise TrackingError(
                f"run {run_key} was started by the built-in classifier of releases up to 0.2 (train_code ''), which "
                "is gone: it cannot be resumed. Start a new run without `resume`: the default train_code, the table "
                "classifier, trains the same model"
            )
        raise TrackingError(
            f"run {run_key} was started with other settings ({details}); resume with the same config, "
            "or start a new run without `resume`"
        )


def _check_dataset_unchanged(tags: dict[str, str], dataset_hash: str | None, run_key: str) -> None:
    # `dataset` (or what prepare reads) is a path: the same path may hold other rows now. Old weights on new data
    # (and new standardisation) would train on, and a finished fit would register its old scores wrapped in the new
    # mean and std.
    recorded = tags.get(DATASET_HASH_TAG)
    if recorded is not None and dataset_hash is not None and recorded != dataset_hash:
        raise TrackingError(
            f"run {run_key} was trained on dataset {recorded}, but its data is dataset {dataset_hash} now (the "
            "content of `dataset`, what train_code's prepare writes, or what its data() gives, changed); resume "
            "with the data it started with, or start a new run without `resume`"
        )


def _sqlite_path(tracking_uri: str) -> Path | None:
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri.removeprefix("sqlite:///"))
