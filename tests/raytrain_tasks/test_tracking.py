"""MLflow run states and live logging against real stores: a killed driver's run, an MLflow outage mid-fit."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from raytrain_tasks.tracking import pins, run_owner
from raytrain_tasks.tracking import runs as tracking
from raytrain_tasks.tracking.controller import MlflowEpochLogger
from tests.helpers import (
    a_stop_in_the_next_mlflow_query,
    free_port,
    seed_mlflow_store,
    start_mlflow_server,
    stop_process_group,
)


def test_a_run_whose_driver_died_is_marked_killed_by_the_next_pipeline(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("killed")
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive_driver = run_owner.this_driver()
        dead_driver = alive_driver.replace(f":{os.getpid()}:", f":{dead.pid}:").rsplit(":", 1)[0]
        dead_driver += ":" + run_owner._process_start(dead.pid)
    finally:
        dead.kill()
        dead.wait()
    orphan = client.create_run(experiment, tags={run_owner.DRIVER_TAG: dead_driver}).info.run_id
    live = client.create_run(experiment, tags={run_owner.DRIVER_TAG: alive_driver}).info.run_id
    elsewhere = client.create_run(experiment, tags={run_owner.DRIVER_TAG: "other-host:1:1"}).info.run_id

    assert run_owner.mark_dead_runs_killed(client, experiment, found_by="20261123-000000-abcdef") == [orphan]
    killed = client.get_run(orphan)
    assert killed.info.status == "KILLED"
    assert "ended without finishing" in killed.data.tags[run_owner.KILLED_TAG]
    assert client.get_run(live).info.status == "RUNNING"  # its driver (this process) still runs
    assert client.get_run(elsewhere).info.status == "RUNNING"  # another host: nobody here can tell


def test_a_run_stopped_in_the_middle_of_an_mlflow_query_is_marked_killed(tmp_path: Path) -> None:
    """Seen in CI (test_signals, register-model): a SIGTERM raised between a query's execute and its fetch left the
    query's SQLite read lock held by the traceback, so marking the run KILLED waited out MLflow's 20 s busy
    timeout, failed, and left the run RUNNING past the stop's deadline."""
    from prefect.exceptions import TerminationSignal

    client = tracking.connect(f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}")
    run_id = client.create_run(client.create_experiment("stopped"), tags={"a": "1", "b": "2"}).info.run_id
    with pytest.raises(TerminationSignal):
        try:
            with a_stop_in_the_next_mlflow_query():
                client.get_run(run_id)
        except TerminationSignal as stop:  # as the fit and register-model handle it: the traceback alive
            tracking.stop_run(client, run_id, "stopped by SIGTERM", stop)
            raise
    stopped = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert stopped.info.status == "KILLED"
    assert stopped.data.tags[run_owner.KILLED_TAG] == "stopped by SIGTERM"


def test_a_stop_raised_in_a_query_holds_no_sqlite_lock_once_out_of_a_releasing_block(tmp_path: Path) -> None:
    """What the blocks whose way out writes to MLflow rely on (the registry lock's ticket deletion, start_run's
    exit in register-model, the system-metrics monitor's last samples): once a stop has left the block, the
    query it interrupted holds no read lock, whichever pooled connection the next write gets."""
    import sqlite3

    from prefect.exceptions import TerminationSignal

    db = seed_mlflow_store(tmp_path / "mlflow.db")
    client = tracking.connect(f"sqlite:///{db}")
    run_id = client.create_run(client.create_experiment("stopped"), tags={"a": "1", "b": "2"}).info.run_id
    other = sqlite3.connect(db, timeout=0, isolation_level=None)  # another writer, as the next pooled connection
    with pytest.raises(TerminationSignal):
        try:
            with tracking.releasing_interrupted_reads(), a_stop_in_the_next_mlflow_query():
                client.get_run(run_id)
        except TerminationSignal:
            other.execute("BEGIN EXCLUSIVE")  # 'database is locked' while any read is open
            other.execute("ROLLBACK")
            raise
    other.close()


class _Checkpoint:
    path = "/storage/runs/key/epoch-0000"
    filesystem = None  # no files to pin: the epoch's metrics alone


def _epoch(step: int) -> list[dict[str, Any]]:
    return [{"epoch": step, "train_loss": 1.0, "val_loss": 1.0, "val_accuracy": 0.5}]


@pytest.mark.slow
def test_live_epoch_logging_survives_an_mlflow_outage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller's logger: a dead server costs seconds per report, and logging resumes when it is back."""
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = MlflowClient(db).create_run(MlflowClient(db).create_experiment("outage")).info.run_id
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logger = MlflowEpochLogger(url, run_id)
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
        monkeypatch.delenv(name, raising=False)  # the controller's defaults, not the test process's

    # The server is down: logged as an error, not raised (how long it takes: `python -m bench.waits`).
    logger.after_report(None, _epoch(0), _Checkpoint())

    server = start_mlflow_server(tmp_path, port)  # on the run's own store
    try:
        logger.after_report(None, _epoch(1), _Checkpoint())
        logger.after_report(None, _epoch(2), _Checkpoint())
        steps = sorted(m.step for m in MlflowClient(url).get_metric_history(run_id, "val_accuracy"))
        assert steps == [2, 3]  # epoch 1 (step 1) is the driver's to backfill (reconcile_epochs) after fit()
    finally:
        stop_process_group(server)


def test_the_pin_the_controller_records_is_found_for_every_spelling_of_the_checkpoint_uri(tmp_path: Path) -> None:
    """The controller pins a checkpoint under the path Ray reports (a bucket key on S3, maybe with a trailing
    slash); evaluation and registration look it up by the URI the fit returns: both must reach the same pin."""
    from raytrain_tasks.tracking.controller import log_epoch
    from raytrain_tasks.tracking.names import MANIFEST_METRIC

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("pins")).info.run_id
    metrics = {"epoch": 1, "train_loss": 0.5, MANIFEST_METRIC: "a" * 64}
    log_epoch(client, run_id, metrics, "bucket/runs/key/epoch-0002/")
    for uri in ("s3://bucket/runs/key/epoch-0002", "s3://bucket/runs/key/epoch-0002/", "/local/runs/key/epoch-0002"):
        assert pins.recorded_digest(client, run_id, uri) == "a" * 64
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [2]


def test_a_resume_on_data_with_another_content_hash_is_refused_naming_both(tmp_path: Path) -> None:
    """`dataset` is a path: if the file behind it changed, the run (reopened, or finished and about to register)
    is refused before anything is written, naming the recorded hash, the new one and the setting."""
    import pytest

    from raytrain_tasks.errors import TrackingError

    tag = "prefect_raytrain.dataset_hash"  # what raytrain_driver.fit tags every run with at its start
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("pinned-data")
    key, params = "20261125-030000-cccccc", {"dataset": "data.csv", "epochs": 2}
    run_id, reopened = tracking.start_or_reopen_run(client, experiment, key, key, {tag: "a1" * 8}, params)
    assert not reopened
    client.set_terminated(run_id, status="FAILED")
    with pytest.raises(TrackingError) as refused:
        tracking.start_or_reopen_run(client, experiment, key, key, {tag: "b2" * 8}, params)
    assert all(part in str(refused.value) for part in ("a1" * 8, "b2" * 8, "`dataset`", key)), refused.value
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags[tag] == "a1" * 8  # nothing written
    with pytest.raises(TrackingError, match="b2" * 8):
        tracking.check_resumable(client, experiment, key, params, "b2" * 8)  # a finished run, before registering
    tracking.check_resumable(client, experiment, key, params, "a1" * 8)
    assert tracking.start_or_reopen_run(client, experiment, key, key, {tag: "a1" * 8}, params)[1]


def test_the_pin_journal_keeps_pins_for_the_mlflow_run_they_belong_to_and_fills_in_only_what_mlflow_lacks(
    tmp_path: Path,
) -> None:
    """Pins appended while MLflow is down are read back for their run only; a record
    cut short by a crash costs that record alone, not the next; the driver copies into MLflow only the pins and
    epoch metrics it lacks, never over what it has; a journal anyone else could have written is not read; a
    controller on another machine than the driver writes none there."""
    import dataclasses

    from raytrain_tasks.tracking.names import pin_tag, pinned_digests
    from raytrain_tasks.tracking.pin_journal import JournalEntry, PinJournal

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("journal")
    run_id, other_run = (client.create_run(experiment).info.run_id for _ in range(2))
    journal = PinJournal.for_run(tmp_path / "journal", "20260101-000000-abcdef")

    def entry(epoch: int) -> JournalEntry:
        return JournalEntry(f"epoch-{epoch:04d}", str(epoch) * 64, epoch, {"val_loss": 1.0 / epoch})

    assert journal.append(run_id, entry(1)) and journal.append(run_id, entry(2))
    with open(journal.path, "a") as cut_short:  # a crash in the middle of a record
        cut_short.write('{"run_id": "' + run_id + '", "checkpoint": "epoch-00')
    assert journal.append(run_id, entry(3)) and journal.append(other_run, entry(4))
    assert oct(Path(journal.path).stat().st_mode & 0o777) == "0o600"
    assert [e.checkpoint for e in journal.entries(run_id)] == ["epoch-0001", "epoch-0002", "epoch-0003"]

    client.set_tag(run_id, pin_tag("epoch-0001"), "f" * 64)  # what MLflow recorded stands
    client.log_metric(run_id, "val_loss", 0.9, step=2)
    assert pins.pins_from_journal(client, run_id, journal) == ["epoch-0002", "epoch-0003"]
    pinned = pinned_digests(client.get_run(run_id).data.tags)
    assert pinned == {"epoch-0001": "f" * 64, "epoch-0002": "2" * 64, "epoch-0003": "3" * 64}
    history = {m.step: m.value for m in client.get_metric_history(run_id, "val_loss")}
    assert history == {2: 0.9, 3: pytest.approx(1 / 3)}  # epoch 3 filled in; MLflow's epoch 2 kept
    assert pins.pins_from_journal(client, run_id, journal) == []
    assert pinned_digests(client.get_run(other_run).data.tags) == {}

    Path(journal.path).chmod(0o666)  # writable by anyone: not evidence of anything
    assert journal.entries(run_id) == []
    elsewhere = dataclasses.replace(journal, path=str(tmp_path / "elsewhere.jsonl"), host="another-machine")
    assert not elsewhere.append(run_id, entry(5)) and not Path(elsewhere.path).exists()


def test_no_pin_journal_inside_a_local_storage_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal vouches for storage, so it never lives in it (e.g. PREFECT_HOME=.pipeline/prefect and
    storage_path=.pipeline)."""
    from raytrain_driver.hooks import RunHooks, run_hooks, state_dir
    from raytrain_tasks.config import TrainingConfig

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "state" / "prefect"))
    inside = TrainingConfig(storage_path=str(tmp_path / "state"))
    assert pins.pin_journal(inside, "20260101-000000-abcdef", state_dir()) is None
    journal = pins.pin_journal(
        TrainingConfig(storage_path=str(tmp_path / "storage")), "20260101-000000-abcdef", state_dir()
    )
    assert journal is not None and Path(journal.path).is_relative_to(tmp_path / "state" / "prefect")
    # In a Prefect task, the Prefect home the task hands in (its setting, from wherever Prefect read it) wins.
    with run_hooks(RunHooks(logging.getLogger("test"), state_dir=tmp_path / "task-home")):
        journal = pins.pin_journal(
            TrainingConfig(storage_path=str(tmp_path / "storage")), "20260101-000000-abcdef", state_dir()
        )
        assert journal is not None and Path(journal.path).is_relative_to(tmp_path / "task-home")
        assert (
            pins.pin_journal(TrainingConfig(storage_path=str(tmp_path)), "20260101-000000-abcdef", state_dir()) is None
        )


def test_a_restarted_worker_group_gets_only_a_checkpoint_that_verifies_and_an_unreadable_one_is_retried(
    tmp_path: Path,
) -> None:
    """RestartGuard, on the controller, before a worker group of your code restarts inside a fit: the latest
    checkpoint committed in it is handed over only if it still hashes to its digest at commit. Changed: the fit
    stops and Prefect does not retry it (a retry would find the same files). Unreadable now, or no digest taken at
    commit: the fit stops and Prefect retries it, and the retry resumes from the newest checkpoint that verifies.
    (The changed case end to end, with a killed worker: test_own_code.)"""
    import pyarrow.fs as pafs
    import ray.train

    from raytrain_driver.trainer import training_error
    from raytrain_tasks.errors import CheckpointError, UnverifiedCheckpointError
    from raytrain_tasks.integrity import folder_digest
    from raytrain_tasks.tracking.controller import RestartGuard
    from tasks.fit import NOT_RETRYABLE
    from tests.helpers import small_config

    folder = tmp_path / "checkpoint_2026-11-27_21-30-00.000000"
    folder.mkdir()
    (folder / "checkpoint.pt").write_bytes(b"the weights as committed")
    filesystem = pafs.LocalFileSystem()
    epochs = MlflowEpochLogger(f"sqlite:///{tmp_path / 'mlflow.db'}", "run-id")
    guard = RestartGuard(epochs)
    assert guard.before_init_train_context([]) == {}  # no commit in this fit yet: the driver verified its start
    checkpoint = ray.train.Checkpoint(str(folder), filesystem=filesystem)
    epochs.latest_committed = (checkpoint, folder_digest(filesystem, str(folder)))
    assert guard.before_init_train_context([]) == {}

    (folder / "checkpoint.pt").write_bytes(b"weights someone else wrote")
    with pytest.raises(CheckpointError, match="no longer hash.*storage_path") as changed:
        guard.before_init_train_context([])
    config = small_config(tmp_path)
    as_the_task_raises = training_error(ray.train.ControllerError(changed.value), "run-key", config)
    assert isinstance(as_the_task_raises, CheckpointError) and isinstance(as_the_task_raises, NOT_RETRYABLE)

    unreadable = []
    epochs.latest_committed = (checkpoint, None)
    with pytest.raises(UnverifiedCheckpointError, match="could not be taken when it was committed") as unverified:
        guard.before_init_train_context([])
    unreadable.append(unverified.value)
    epochs.latest_committed = (ray.train.Checkpoint(str(tmp_path / "gone"), filesystem=filesystem), "0" * 64)
    with pytest.raises(UnverifiedCheckpointError, match="could not be read to verify it") as unverified:
        guard.before_init_train_context([])
    unreadable.append(unverified.value)
    for error in unreadable:
        as_the_task_raises = training_error(ray.train.ControllerError(error), "run-key", config)
        assert isinstance(as_the_task_raises, UnverifiedCheckpointError), as_the_task_raises
        assert not isinstance(as_the_task_raises, NOT_RETRYABLE)  # Prefect's retry resumes from what verifies


def test_registry_calls_go_to_the_tracking_store_whatever_mlflow_registry_uri_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's environment may not point the registry, and the worker's MLflow credentials, elsewhere: the client
    the pipeline opens and the fluent API it registers and loads through both use the tracking store's registry."""
    import mlflow

    uri = f"sqlite:///{seed_mlflow_store(tmp_path / 'tracking.db')}"
    elsewhere = f"sqlite:///{seed_mlflow_store(tmp_path / 'elsewhere.db')}"
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", elsewhere)
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"w")

    client = tracking.connect(uri)
    client.create_registered_model("pinned")
    version = client.create_model_version("pinned", source=str(model)).version
    client.set_registered_model_alias("pinned", "champion", version)
    assert [m.name for m in MlflowClient(uri, registry_uri=uri).search_registered_models()] == ["pinned"]
    assert MlflowClient(elsewhere, registry_uri=elsewhere).search_registered_models() == []

    with tracking.using_tracking_uri(uri):  # as registration reads the champion back (champion.download_model)
        assert mlflow.get_registry_uri() == uri
        copy = mlflow.artifacts.download_artifacts("models:/pinned@champion", dst_path=str(tmp_path / "copy"))
    assert (Path(copy) / "weights.bin").read_bytes() == b"w"
    # The block leaves the process as it found it.
    assert os.environ["MLFLOW_REGISTRY_URI"] == elsewhere and mlflow.get_registry_uri() == elsewhere


def test_a_threads_block_ending_leaves_another_threads_block_pointed_at_its_store(tmp_path: Path) -> None:
    """Two pipelines registering in two threads of one process each open a using_tracking_uri block on the same
    store. The first to end put MLflow's globals back while the other was still inside: the other's champion
    lookup (models:/...) then went to the default registry, found no such model, and left the decision open."""
    import threading

    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    before = mlflow.get_tracking_uri()
    inside, first_done = threading.Event(), threading.Event()
    seen: list[str] = []

    def second() -> None:
        with tracking.using_tracking_uri(uri):
            inside.set()
            first_done.wait(timeout=10)
            seen.append(mlflow.get_registry_uri())

    thread = threading.Thread(target=second)
    with tracking.using_tracking_uri(uri):
        thread.start()
        assert inside.wait(timeout=10)
    first_done.set()
    thread.join(timeout=10)
    assert seen == [uri]
    assert mlflow.get_tracking_uri() == before  # the last block to end put the process back


def test_a_checkpoint_within_an_epoch_is_pinned_and_charted_by_its_global_step_not_as_an_epoch(
    tmp_path: Path,
) -> None:
    """The controller, given a real checkpoint folder committed within epoch 2 and then epoch 2's own: the first is
    pinned (a resume may start from it), its train loss is a point of the step series at its global step, and no
    epoch metric is logged for it; the epoch's own report logs the epoch once, at its number, and the last point.
    `runs` then says the run continues after that step."""
    import pyarrow.fs as pafs
    import ray.train

    from flows.command import describe_run
    from raytrain_tasks.integrity import folder_digest
    from raytrain_tasks.tracking.names import LAST_STEP_TAG, STEP_SERIES, pin_tag

    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(db)
    run = client.create_run(client.create_experiment("steps"), tags={tracking.RUN_KEY_TAG: "20261206-000000-abcdef"})
    run_id = run.info.run_id
    folders = {}
    for name in ("epoch-0002-step-00000018", "epoch-0002"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "spec_state.pt").write_bytes(name.encode())
        folders[name] = ray.train.Checkpoint(str(tmp_path / name), filesystem=pafs.LocalFileSystem())
    logger = MlflowEpochLogger(db, run_id)
    within = {"in_epoch": 1, "global_step": 18, "step_train_loss": 0.25, "val_accuracy": float("nan")}
    logger.after_report(None, [within], folders["epoch-0002-step-00000018"])

    tags = client.get_run(run_id).data.tags
    digest = folder_digest(pafs.LocalFileSystem(), str(tmp_path / "epoch-0002-step-00000018"))
    assert tags[pin_tag("epoch-0002-step-00000018")] == digest
    assert tags[LAST_STEP_TAG] == "18, epoch 2"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, STEP_SERIES)] == [(18, 0.25)]
    assert client.get_metric_history(run_id, "val_accuracy") == []  # no epoch of it

    epoch = {"epoch": 1, "train_loss": 0.3, "val_accuracy": 0.9, "global_step": 26}
    logger.after_report(None, [epoch], folders["epoch-0002"])
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_accuracy")] == [(2, 0.9)]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, STEP_SERIES)) == [(18, 0.25), (26, 0.3)]
    assert not {"global_step", "step_train_loss", "in_epoch"} & set(client.get_run(run_id).data.metrics)

    client.set_terminated(run_id, "FAILED")
    shown = describe_run(client, client.get_run(run_id))
    assert shown["resumable"] == "yes (after step 26, epoch 2)" and shown["epochs"].startswith("1/"), shown


def test_a_failed_group_records_which_rank_on_which_host_was_silent_and_an_mlflow_outage_costs_nothing(
    tmp_path: Path,
) -> None:
    """When a worker group fails, the ranks whose answer to Ray Train's poll has been outstanding 5 s or more are
    named in the MLflow run, with host, pid and seconds; once per failed group. With MLflow unreachable the callback
    only warns. (The shape of Ray's WorkerGroup is the real one in test_long_runs_fit's stopped-worker test.)"""
    from types import SimpleNamespace

    from ray.train.v2._internal.util import time_monotonic

    from raytrain_tasks.tracking.controller import SILENT_TAG, SilentRanks

    now = time_monotonic()
    workers = [
        SimpleNamespace(metadata=SimpleNamespace(hostname=f"node-{rank}", node_ip=f"10.0.0.{rank}", pid=100 + rank))
        for rank in range(3)
    ]
    group = SimpleNamespace(
        _world_rank_to_ongoing_poll={1: SimpleNamespace(start_time=now - 31.0), 2: SimpleNamespace(start_time=now - 1)},
        get_workers=lambda: workers,
    )
    failed = SimpleNamespace(errors={0: RuntimeError("gloo: timed out")})
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(db)
    run_id = client.create_run(client.create_experiment("silent")).info.run_id

    recorder = SilentRanks(db, run_id)
    recorder.after_worker_group_start(group)
    recorder.after_worker_group_poll_status(SimpleNamespace(errors={}))  # running: nothing to say
    assert SILENT_TAG not in client.get_run(run_id).data.tags
    recorder.after_worker_group_poll_status(failed)
    said = client.get_run(run_id).data.tags[SILENT_TAG]
    assert said.startswith("rank 1 on host node-1 (10.0.0.1, pid 101) silent for 3") and "rank 2" not in said, said

    down = SilentRanks(f"http://127.0.0.1:{free_port()}", run_id)
    down.after_worker_group_start(group)
    down.after_worker_group_poll_status(failed)  # warns, does not raise
