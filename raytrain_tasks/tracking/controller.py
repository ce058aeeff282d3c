"""Per-epoch MLflow logging from the Ray Train controller.

Workers never talk to MLflow. The controller calls ``after_report`` once all ranks have reported and the
checkpoint is persisted and registered, so an epoch reaches MLflow only when it can also be resumed from.
Steps already in the run's history are skipped: a restarted or retried run never logs an epoch twice.
``OpenMlflowEarly`` opens the controller's MLflow connection while the worker group starts, so the import and
the store set-up (about 4 s of CPU) do not compete with the workers during the first epochs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ray.train import Checkpoint, UserCallback
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

from raytrain_tasks.redact import redact
from raytrain_tasks.tracking.names import (
    DATASET_DIGEST_KEY,
    DATASET_HASH_TAG,
    GLOBAL_STEP_KEY,
    IN_EPOCH_KEY,
    LAST_CHECKPOINT_TAG,
    LAST_STEP_TAG,
    MANIFEST_METRIC,
    RANK_SCORE_KEY,
    STEP_KEY,
    STEP_LOSS_KEY,
    STEP_SERIES,
    checkpoint_name,
    epoch_number,
    pin_tag,
)
from raytrain_tasks.tracking.pin_journal import JournalEntry, PinJournal

logger = logging.getLogger(__name__)


def logged_steps(client: Any, run_id: str, step_key: str = STEP_KEY) -> set[int]:
    """Epoch numbers already in the run's metric history (MLflow's ``step`` is the epoch number)."""
    return {int(m.step) for m in client.get_metric_history(run_id, step_key)}


def report_step(metrics: dict[str, Any], logged: set[int]) -> int:
    """MLflow's step for a checkpointed report: the epoch number when the report says its ``epoch`` (0-based),
    else the step after the last one logged (each checkpointed report is one step; a resume re-reads them)."""
    if isinstance(metrics.get("epoch"), int | float):
        return epoch_number(metrics["epoch"])
    return max(logged, default=0) + 1


# A report's numbers that are not the epoch's metrics: ``epoch`` is MLflow's step; the others make the step series.
NOT_EPOCH_METRICS = frozenset({"epoch", IN_EPOCH_KEY, GLOBAL_STEP_KEY, STEP_LOSS_KEY, RANK_SCORE_KEY})


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """What MLflow charts per epoch of a report: its numbers, but for ``NOT_EPOCH_METRICS``."""
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and key not in NOT_EPOCH_METRICS
    }


def step_point(metrics: dict[str, Any], timestamp: int) -> tuple[list[Any], list[Any]]:
    """(the step series' point, the last-step tag) of a report that says its global step; ([], []) otherwise."""
    from mlflow.entities import Metric, RunTag

    step, loss = metrics.get(GLOBAL_STEP_KEY), metrics.get(STEP_LOSS_KEY, metrics.get("train_loss"))
    if not isinstance(step, int | float) or isinstance(step, bool):
        return [], []
    epoch = metrics.get("epoch", metrics.get(IN_EPOCH_KEY))
    where = f"{int(step)}, epoch {epoch_number(epoch)}" if isinstance(epoch, int | float) else str(int(step))
    points = [Metric(STEP_SERIES, float(loss), timestamp, int(step))] if isinstance(loss, int | float) else []
    return points, [RunTag(LAST_STEP_TAG, where)]


def log_epoch(
    client: Any,
    run_id: str,
    metrics: dict[str, Any],
    checkpoint_path: str | None,
    step: int | None = None,
) -> None:
    """One batched write per epoch: every number the report holds at ``step`` (the epoch number unless given), and
    the latest checkpoint's location."""
    from mlflow.entities import Metric, RunTag

    step = epoch_number(metrics["epoch"]) if step is None else step
    timestamp = int(time.time() * 1000)
    values = numeric_metrics(metrics)
    batch = [Metric(key, value, timestamp, step) for key, value in values.items()]
    tags = [RunTag(LAST_CHECKPOINT_TAG, checkpoint_path)] if checkpoint_path else []
    points, step_tags = step_point(metrics, timestamp)
    batch += points
    tags += step_tags
    if isinstance(metrics.get(DATASET_DIGEST_KEY), str):  # a TrainSpec's content hash of its splits (trainspec.loop)
        tags.append(RunTag(DATASET_HASH_TAG, metrics[DATASET_DIGEST_KEY]))
    digest = metrics.get(MANIFEST_METRIC)
    if checkpoint_path and isinstance(digest, str):
        tags.append(RunTag(pin_tag(checkpoint_name(checkpoint_path)), digest))
    client.log_batch(run_id, metrics=batch, tags=tags)


def log_within_epoch(
    client: Any, run_id: str, metrics: dict[str, Any], checkpoint_path: str, digest: str | None
) -> None:
    """One batched write for a checkpoint committed within an epoch: the step series' point, the latest
    checkpoint's location and step, and its pin (``digest``; none when it could not be taken: a resume then passes
    the checkpoint over)."""
    from mlflow.entities import RunTag

    points, tags = step_point(metrics, int(time.time() * 1000))
    tags.append(RunTag(LAST_CHECKPOINT_TAG, checkpoint_path))
    if digest is not None:
        tags.append(RunTag(pin_tag(checkpoint_name(checkpoint_path)), digest))
    client.log_batch(run_id, metrics=points, tags=tags)


class OpenMlflowEarly(ControllerCallback):
    """Opens the MLflow store in a background thread of the controller as soon as the controller starts.

    Ray Train calls ``after_report`` on the controller only after the first epoch; opening MLflow there costs
    the controller about 4 s of CPU (imports, SQLAlchemy store) while the workers train, and on 2 cores that
    slowed the epochs and the report barrier. Here it overlaps the worker group's start instead.
    """

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id

    def after_controller_start(self, train_run_context: Any) -> None:
        bound_mlflow_requests()
        threading.Thread(target=self._open, name="mlflow-open", daemon=True).start()

    def _open(self) -> None:
        try:
            from mlflow import MlflowClient

            # The first query opens the store; MLflow caches it per URI, so the epoch logger's client reuses it.
            MlflowClient(self.tracking_uri, registry_uri=self.tracking_uri).get_run(self.run_id)
        except Exception as exc:  # noqa: BLE001 - only a head start; MlflowEpochLogger connects (and reports) itself
            logger.debug("could not open MLflow early: %s", redact(f"{type(exc).__name__}: {exc}"))


# The controller talks to MLflow between epochs: a dead server must cost seconds there, not MLflow's default
# minutes of retries per request. Unset values only; the driver's own settings are passed in its env.
CONTROLLER_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}


def bound_mlflow_requests() -> None:
    for key, value in CONTROLLER_HTTP_ENV.items():
        os.environ.setdefault(key, value)


class MlflowEpochLogger(UserCallback):
    """Logs each committed epoch of rank 0 to one MLflow run.

    An MLflow error skips that epoch's live write only: the next report tries again (and first re-reads
    which epochs the run already has), and the driver logs whatever is still missing once ``fit()`` returns.

    For your own code it also keeps the latest checkpoint committed in this fit with its digest then, which
    ``RestartGuard`` checks before a restarted worker group is given it.
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        step_key: str = STEP_KEY,
        journal: PinJournal | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        # Every pin is also appended here first, so an MLflow outage does not leave committed checkpoints unpinned.
        self.journal = journal
        # Every number the code reports is logged; its metric (``step_key``) says which steps MLflow has.
        self.step_key = step_key
        self._client: Any = None
        self._logged: set[int] | None = None
        # The latest checkpoint committed in this fit, and its digest then (None: it could not be taken).
        self.latest_committed: tuple[Checkpoint, str | None] | None = None

    def _digest(self, checkpoint: Checkpoint) -> str | None:
        """The pin of ``checkpoint``: the digest of every rank's files as persisted (integrity.py); None for a
        checkpoint that names no filesystem to read them from."""
        if checkpoint.filesystem is None:
            return None
        from raytrain_tasks.integrity import folder_digest

        return folder_digest(checkpoint.filesystem, checkpoint.path)

    def _journal(self, metrics: dict[str, Any], checkpoint: Checkpoint, digest: str) -> None:
        """Append the pin, with the epoch's step and metrics, to the journal; only for a report that says its
        ``epoch`` (the step is then known without asking MLflow, and a resume can log the epoch it holds) or the
        epoch it was committed within (its pin alone: it has no epoch's metrics)."""
        epoch = metrics.get("epoch", metrics.get(IN_EPOCH_KEY))
        if self.journal is None or not isinstance(epoch, int | float) or isinstance(epoch, bool):
            return
        figures = {} if IN_EPOCH_KEY in metrics else numeric_metrics(metrics)
        entry = JournalEntry(checkpoint_name(checkpoint.path), digest, epoch_number(epoch), figures)
        self.journal.append(self.run_id, entry)

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        if checkpoint is None or not metrics:
            # Only epochs with a persisted checkpoint count; anything else would be redone on resume.
            return
        epoch_metrics = metrics[0]
        self.latest_committed = (checkpoint, None)  # unverifiable until its digest is taken
        try:
            digest = self._digest(checkpoint)
            self.latest_committed = (checkpoint, digest)
            if digest is not None:
                self._journal(epoch_metrics, checkpoint, digest)  # before MLflow, which may be down
            if self._client is None:
                from mlflow import MlflowClient

                bound_mlflow_requests()
                self._client = MlflowClient(self.tracking_uri, registry_uri=self.tracking_uri)
            if IN_EPOCH_KEY in epoch_metrics:  # a checkpoint within an epoch: its pin and step, no epoch's metrics
                log_within_epoch(self._client, self.run_id, epoch_metrics, checkpoint.path, digest)
                return
            if self._logged is None:
                self._logged = logged_steps(self._client, self.run_id, self.step_key)
            step = report_step(epoch_metrics, self._logged)
            if digest is not None:
                if step in self._logged:
                    # A folder that trains an epoch again (epoch-NNNN-rK after a failure): MLflow has the epoch's
                    # metrics, not this folder's pin; without it a crash now would pass the folder over.
                    self._client.set_tag(self.run_id, pin_tag(checkpoint_name(checkpoint.path)), digest)
                    return
                epoch_metrics = {**epoch_metrics, MANIFEST_METRIC: digest}
            if step in self._logged:
                return
            log_epoch(self._client, self.run_id, epoch_metrics, checkpoint.path, step)
            self._logged.add(step)
        except Exception as exc:  # noqa: BLE001 - tracking must never kill training; tested in test_tracking_outage
            self._logged = None  # unknown after a failed write: re-read at the next report
            # No traceback: MLflow's messages embed the tracking URL, and this goes to the Ray worker logs.
            logger.warning(
                "could not log epoch metrics to MLflow run %s; the next report retries: %s",
                self.run_id,
                redact(f"{type(exc).__name__}: {exc}"),
            )


class RestartGuard(WorkerGroupCallback):
    """Guards a restart inside the fit, for your own code: the checkpoint Ray Train hands a restarted worker group
    is the latest one committed in this fit, and its files must still hash to the digest ``logger`` took when it was
    committed. (The driver checks a run's checkpoints only where a fit starts.) A separate object: Ray Train calls a
    ``UserCallback`` only through its report and exception hooks. Both reach the controller in one list, so this one
    reads the logger's state there."""

    def __init__(self, logger: MlflowEpochLogger) -> None:
        self.logger = logger

    def before_init_train_context(self, workers: list[Any]) -> dict[str, list[Any]]:
        """CheckpointError (the fit stops, not retried: nothing of the checkpoint is loaded) when the latest
        checkpoint committed in this fit no longer hashes to its digest at commit; UnverifiedCheckpointError (the
        fit stops; Prefect's retry resumes from the newest checkpoint that verifies) when it cannot be read now, or
        its digest could not be taken at commit."""
        latest = self.logger.latest_committed
        if latest is None:
            return {}  # no commit in this fit yet: the workers get what the driver verified where the fit started
        from raytrain_tasks.errors import CheckpointError, UnverifiedCheckpointError
        from raytrain_tasks.integrity import folder_digest

        checkpoint, committed = latest
        refused = f"the restarted workers were not given checkpoint {checkpoint.path}"
        if committed is None:
            raise UnverifiedCheckpointError(f"{refused}: its digest could not be taken when it was committed")
        try:
            now = folder_digest(checkpoint.filesystem, checkpoint.path)
        except OSError as exc:
            raise UnverifiedCheckpointError(f"{refused}: it could not be read to verify it ({exc})") from exc
        if now != committed:
            raise CheckpointError(
                f"{refused}: its files no longer hash to the digest taken when it was committed. Nothing of it was "
                "loaded. Check who can write `storage_path`; a resume starts from the newest checkpoint that verifies"
            )
        return {}


class SilentRanks(WorkerGroupCallback):
    """Records in the MLflow run which rank on which host had stopped answering, and for how long, when its worker
    group fails. A frozen rank (SIGSTOP, a stuck system call, a dead network card) answers neither its peers'
    collectives nor Ray Train's polls: its peers fail after ``hang_timeout_s`` and Ray Train restarts the group;
    this says who it was. Reads Ray Train's own record of the polls it is waiting on (2.60's WorkerGroup); records
    nothing if that has another shape."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._group: Any = None
        self._recorded = False

    def after_worker_group_start(self, worker_group: Any) -> None:
        self._group, self._recorded = worker_group, False

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        if self._recorded or self._group is None or not worker_group_status.errors:
            return
        self._recorded = True
        try:
            from ray.train.v2._internal.util import time_monotonic

            from raytrain_tasks.long_runs import silent_ranks

            polls = self._group._world_rank_to_ongoing_poll
            workers = self._group.get_workers()
            silent = silent_ranks({rank: poll.start_time for rank, poll in polls.items()}, time_monotonic())
            said = [_silent_line(rank, seconds, workers[rank].metadata) for rank, seconds in silent]
        except (AttributeError, ImportError, IndexError, TypeError):
            return
        if not said:
            return
        text = "; ".join(said)
        logger.warning("the worker group failed with %s", text)
        try:
            from mlflow import MlflowClient

            bound_mlflow_requests()
            MlflowClient(self.tracking_uri, registry_uri=self.tracking_uri).set_tag(self.run_id, SILENT_TAG, text)
        except Exception as exc:  # noqa: BLE001 - a record of the failure must not add one; test_tracking_outage
            logger.warning("could not record the silent rank in MLflow: %s", redact(f"{type(exc).__name__}: {exc}"))


SILENT_TAG = "prefect_raytrain.silent_ranks"


def _silent_line(rank: int, seconds: float, metadata: Any) -> str:
    """``rank 1 on host node-2 (10.0.0.7, pid 4242) silent for 31.2 s``."""
    return (
        f"rank {rank} on host {metadata.hostname} ({metadata.node_ip}, pid {metadata.pid}) silent for {seconds:.1f} s"
    )
