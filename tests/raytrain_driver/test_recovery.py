"""Recovery, for real: kill a Ray worker, fail the fit task, SIGKILL the whole CLI, damage a checkpoint.

Each recovered run must end exactly where an uninterrupted run with the same seed ends (to 1e-6), in one
MLflow run whose history has every epoch exactly once. Failures are injected from outside the product
code: worker PIDs come from Ray's State API, the CLI is killed by its PID. Every test here is a real death or
outage window, so all of them are `chaos` (make test-chaos). What the retry policy decides, which checkpoint a
restarted worker group is given, and a resume's choice among damaged ones are tested without a fit
(tests/tasks/test_fit_retries.py, test_tracking, test_fit_steps).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from flows.training import PipelineResult, training_pipeline
from raytrain_tasks.config import RUN_KEY_PATTERN as RUN_KEY
from raytrain_tasks.config import parameters_of
from raytrain_tasks.tracking.names import EPOCH_METRICS, epoch_number
from raytrain_tasks.trainspec.resume import checkpoint_dir_name
from tests.helpers import (
    REPO_ROOT,
    Kill,
    Outage,
    committed_epochs,
    free_port,
    mlflow_client,
    only_run,
    run_killing_a_worker,
    seed_mlflow_store,
    small_config,
    start_flow,
    start_mlflow_server,
    stop_process_group,
    this_ray_address,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster", "prefect_api")]

EPOCHS = 4
# An epoch takes about 0.5 s on 2 cores: a kill is placed by stopping the workers (see run_killing_a_worker).
CHAOS = {
    "train_config": {"dataset": "synthetic", "synthetic_samples": 24_000, "synthetic_features": 20},
    "epochs": EPOCHS,
    "batch_size": 64,
    "checkpoints_to_keep": 10,
    "register": False,
}


def chaos_config(workdir: Path, **overrides: Any) -> Any:
    return small_config(workdir, **{**CHAOS, **overrides})


def assert_same_as_uninterrupted(workdir: Path, reference: PipelineResult) -> None:
    run = only_run(workdir)
    assert run is not None and run.info.status == "FINISHED"
    client = mlflow_client(workdir)
    expected = {epoch_number(e["epoch"]): e for e in reference.fit.history}
    numbers = list(range(1, EPOCHS + 1))  # MLflow's step is the epoch number
    for key in ("train_loss", "val_loss", "val_accuracy"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == numbers, f"{key}: each epoch exactly once"
        for metric in history:
            assert metric.value == pytest.approx(expected[metric.step][key], abs=1e-6), (key, metric.step)
    for key in EPOCH_METRICS:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == numbers


def assert_resumed_not_restarted(written: dict[str, float], kill: Kill) -> None:
    """The checkpoints up to the one resumed from were not rewritten; the last epoch was trained after the kill."""
    resumed_from = checkpoint_dir_name(kill.resume_epoch)
    assert kill.resume_epoch >= 1 and resumed_from in written
    assert all(mtime < kill.at for name, mtime in written.items() if name <= resumed_from), written
    last_epoch = checkpoint_dir_name(EPOCHS - 1)
    assert max(mtime for name, mtime in written.items() if name.startswith(last_epoch)) > kill.at, written


def checkpoint_mtimes(workdir: Path) -> dict[str, float]:
    """When each checkpoint folder's newest file was written (any checkpoint format: its files are the code's)."""
    (run_dir,) = (workdir / "storage" / "runs").iterdir()
    written = {p.name: [f.stat().st_mtime for f in p.iterdir() if f.is_file()] for p in run_dir.glob("epoch-*")}
    return {name: max(mtimes) for name, mtimes in written.items() if mtimes}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> PipelineResult:
    """The uninterrupted run every recovered run must match."""
    return training_pipeline(**parameters_of(chaos_config(tmp_path_factory.mktemp("reference"))))


@pytest.mark.chaos
def test_a_failed_fit_task_is_retried_by_prefect_from_the_newest_checkpoint_that_verifies(
    tmp_path: Path, reference: PipelineResult
) -> None:
    """No worker-group restarts: a killed worker fails the fit task, and only Prefect's retry can recover it. The
    checkpoint it would resume from was truncated in storage meanwhile: the retry passes over it (its files no
    longer hash to the digest MLflow recorded at commit), says why on the run, continues from the newest checkpoint
    that verifies, and ends in the same MLflow run equal to an uninterrupted one, every epoch logged once."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    truncated: list[str] = []

    def truncate_the_checkpoint_resumed_from(epoch: int) -> None:
        (run_dir,) = (tmp_path / "storage" / "runs").iterdir()
        folder = run_dir / checkpoint_dir_name(epoch)
        for state_file in (f for f in folder.iterdir() if f.is_file()):
            state_file.write_bytes(state_file.read_bytes()[:100])
        truncated.append(folder.name)

    config = chaos_config(tmp_path, max_failures=0, fit_retries=1, retry_delay_seconds=0)
    state, kill = run_killing_a_worker(tmp_path, config, before_kill=truncate_the_checkpoint_resumed_from)
    assert state.is_completed(), state.message
    assert_same_as_uninterrupted(tmp_path, reference)
    # Resumed, not started again: the first epoch's checkpoint (never the one cut: after_epoch=1) was not rewritten.
    assert kill.resume_epoch >= 1
    assert checkpoint_mtimes(tmp_path)[checkpoint_dir_name(0)] < kill.at
    run = only_run(tmp_path)
    assert f"{truncated[0]}: its files do not hash" in run.data.tags["prefect_raytrain.resume_fallback"]
    assert not state.result().fit.best_checkpoint_uri.endswith(truncated[0])

    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    (fit_run,) = [run for run in task_runs if run.name.startswith("fit-")]
    assert fit_run.run_count == 2 and fit_run.state is not None and fit_run.state.is_completed()


@pytest.mark.chaos
def test_exhausted_retries_fail_the_flow_and_register_nothing(tmp_path: Path) -> None:
    config = chaos_config(tmp_path, max_failures=0, fit_retries=0, register=True)
    state, _ = run_killing_a_worker(tmp_path, config, after_epoch=0)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert "resume=" in str(error)  # says how to continue
    run = only_run(tmp_path)
    assert run.info.status == "FAILED"
    assert "TrainingError" in run.data.tags["prefect_raytrain.error"]
    assert mlflow_client(tmp_path).search_model_versions(f"name = '{config.model_name}'") == []
    # The failed run leaves no Ray Train controller behind in this (long-lived) process's cluster.
    from ray.util.state import list_actors

    alive: list[tuple[str, str, str | bool | int | float]] = [
        ("class_name", "=", "TrainController"),
        ("state", "=", "ALIVE"),
    ]
    wait_for(
        lambda: not list_actors(address=this_ray_address(), filters=alive),
        60,
        "the failed run's controller to exit",
    )


def _locations(workdir: Path) -> list[str]:
    """Where a CLI run keeps its state: the flags `train`, `runs` and `resume` share."""
    storage = ["--storage-path", str(workdir / "storage"), "--experiment-name", "tests"]
    return [*storage, "--mlflow-tracking-uri", f"sqlite:///{seed_mlflow_store(workdir / 'mlflow.db')}"]


def _command(workdir: Path, prefect_api_url: str, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PREFECT_API_URL=prefect_api_url, PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([*args], cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _cli(workdir: Path, prefect_api_url: str, ray_address: str, *extra: str) -> subprocess.Popen[str]:
    shown = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in CHAOS.items() if not isinstance(v, bool)}
    args = [f"--{k.replace('_', '-')}={v}" for k, v in shown.items()]
    args += ["--no-register", *_locations(workdir), "--ray-address", ray_address]
    return _command(workdir, prefect_api_url, sys.executable, "-m", "flows.training", *args, *extra)


PREFECT_RAYTRAIN = str(Path(sys.executable).with_name("prefect-raytrain"))  # the console script pyproject installs


def _runs_table(workdir: Path, prefect_api_url: str) -> dict[str, dict[str, str]]:
    """`prefect-raytrain runs`, parsed: run key -> column -> value."""
    listing = _command(workdir, prefect_api_url, PREFECT_RAYTRAIN, "runs", *_locations(workdir))
    output, _ = listing.communicate(timeout=120)
    assert listing.returncode == 0, output
    print(f"\n$ prefect-raytrain runs ...\n{output}")
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("RUN KEY"))
    columns = re.split(r"\s{2,}", lines[header].strip())
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[header + 1 :] if RUN_KEY.match(line)]
    return {row[0]: dict(zip(columns, row, strict=True)) for row in rows}


@pytest.mark.chaos
def test_cli_killed_then_resumed_continues_the_same_run(tmp_path: Path, reference: PipelineResult) -> None:
    import ray
    from prefect.settings import PREFECT_API_URL

    api_url, ray_address = str(PREFECT_API_URL.value()), ray.get_runtime_context().gcs_address
    first = _cli(tmp_path, api_url, ray_address)
    try:
        wait_for(lambda: 1 in committed_epochs(tmp_path), 300, "epoch 1 to be committed")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    run_before = only_run(tmp_path)
    assert run_before.info.status == "RUNNING"  # a crash leaves no chance to close it
    (run_dir,) = (tmp_path / "storage" / "runs").iterdir()
    logged = max(committed_epochs(tmp_path))
    written = checkpoint_mtimes(tmp_path)
    # `prefect-raytrain runs` says what to resume; nobody digs through MLflow tags for it.
    listed = _runs_table(tmp_path, api_url)[run_dir.name]
    # It continues after the newest checkpoint's global step, which `runs` names with its epoch (from 1).
    after = re.fullmatch(r"yes \(after step \d+, epoch (\d+)\)", listed["RESUMABLE"])
    assert listed["STATE"] == "interrupted" and after and int(after[1]) == logged + 1, listed
    assert listed["EPOCHS"] == f"{len(committed_epochs(tmp_path))}/{EPOCHS}"
    assert listed["MLFLOW RUN"] == run_before.info.run_id

    # The settings come from the run itself: only where its state is, and the run key, are given.
    resume = [PREFECT_RAYTRAIN, "resume", run_dir.name, *_locations(tmp_path)]
    resumed = _command(tmp_path, api_url, *resume)
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output[-4000:]
    assert f"run key        {run_dir.name}" in output
    assert only_run(tmp_path).info.run_id == run_before.info.run_id
    assert_same_as_uninterrupted(tmp_path, reference)
    # The kill can land after Ray registered a checkpoint but before its epoch reached MLflow (the driver
    # backfills it), so the resume point is the newest checkpoint on disk, never older than MLflow's last step.
    # The default console says where it resumes from (the driver's line; the workers' own is in Ray's logs).
    announced = rf"resuming from checkpoint \S+/(epoch-\d+) \(epoch (\d+) of {EPOCHS}\): next epoch (\d+)"
    match = re.search(announced, output)
    assert match, output[-4000:]
    resumed_from = int(match[2]) - 1  # the epoch's index
    assert match[1] == checkpoint_dir_name(resumed_from) and int(match[3]) == int(match[2]) + 1
    assert resumed_from >= logged
    assert checkpoint_dir_name(resumed_from) in written
    after = checkpoint_mtimes(tmp_path)
    assert all(after[name] == mtime for name, mtime in written.items() if name <= checkpoint_dir_name(resumed_from))
    listed = _runs_table(tmp_path, api_url)[run_dir.name]
    assert (listed["STATE"], listed["EPOCHS"], listed["RESUMABLE"]) == ("finished", f"{EPOCHS}/{EPOCHS}", "-")


@pytest.mark.chaos
def test_checkpoints_committed_while_mlflow_was_down_survive_a_crash(tmp_path: Path, reference: PipelineResult) -> None:
    """MLflow goes down right after the run opened, so no checkpoint gets its pin there; the
    command is then SIGKILLed. With MLflow back, `resume` continues from the newest checkpoint (its pin kept on
    this machine meanwhile), not from epoch 1, and the run ends as an uninterrupted one."""
    import ray
    from prefect.settings import PREFECT_API_URL

    api_url, ray_address = str(PREFECT_API_URL.value()), ray.get_runtime_context().gcs_address
    port = free_port()
    server = start_mlflow_server(tmp_path, port)  # its store is tmp_path/mlflow.db, which only_run() reads
    # MLflow goes down and comes back on the same address at once: a door in front of the server (a restart of
    # the server itself takes seconds that grow with the machine's load, and shows the client nothing more).
    door = Outage(port)
    door.open()
    try:
        first = _cli(tmp_path, api_url, ray_address, "--mlflow-tracking-uri", door.url)
        try:
            output = ""
            while "new MLflow run" not in output:
                line = first.stdout.readline() if first.stdout else ""
                assert line or first.poll() is None, output[-4000:]
                output += line
            door.shut()  # MLflow is down before the worker group has started
            runs = tmp_path / "storage" / "runs"
            run_dir = wait_for(lambda: runs.is_dir() and next(runs.iterdir(), None), 60, "the run's folder")

            def committed() -> list[str]:
                snapshot = run_dir / "checkpoint_manager_snapshot.json"
                if not snapshot.exists():
                    return []
                try:
                    results = json.loads(snapshot.read_text())["checkpoint_results"]
                except ValueError:  # caught mid-write
                    return []
                return sorted(result["checkpoint_dir_name"] for result in results)

            wait_for(lambda: len(committed()) >= 2, 300, "two checkpoints committed with MLflow down")
        finally:
            first.send_signal(signal.SIGKILL)
            first.communicate(timeout=60)
        newest = committed()[-1]
        door.open()  # MLflow is back, as it was
        run_before = only_run(tmp_path)
        assert run_before.info.status == "RUNNING"
        assert not [tag for tag in run_before.data.tags if tag.startswith("prefect_raytrain.checkpoint_sha256.")]
        resume = [PREFECT_RAYTRAIN, "resume", run_dir.name, *_locations(tmp_path), "--mlflow-tracking-uri", door.url]
        resumed = _command(tmp_path, api_url, *resume)
        output, _ = resumed.communicate(timeout=600)
    finally:
        door.shut()
        stop_process_group(server)
    assert resumed.returncode == 0, output[-4000:]
    match = re.search(r"resuming from checkpoint \S+/(epoch-\d{4})", output)
    assert match and match[1] >= newest, output[-4000:]  # not from epoch 1: the crash cost no committed epoch
    assert only_run(tmp_path).info.run_id == run_before.info.run_id
    assert_same_as_uninterrupted(tmp_path, reference)


@pytest.mark.chaos
def test_a_worker_killed_mid_epoch_resumes_from_the_last_checkpoint_in_the_bucket(
    tmp_path: Path, reference: PipelineResult, s3_server: Any
) -> None:
    """Ray Train restarts the worker group inside the fit: the restarted workers read the checkpoint they resume
    from back from the bucket without rewriting it, and the run ends as an uninterrupted one ends. On S3 rather
    than a local folder: the same restart through the same storage layer, where a lost node's disk is no help."""
    from raytrain_tasks.storage.locations import s3_client

    config = chaos_config(
        tmp_path,
        max_failures=2,
        storage_path="s3://prt-chaos/run",
        s3_endpoint_url=s3_server.endpoint_url,
        create_bucket=True,
    )
    state, kill = run_killing_a_worker(tmp_path, config)
    assert state.is_completed(), state.message
    assert_same_as_uninterrupted(tmp_path, reference)
    result = state.result()
    client = s3_client(config.storage_options)
    prefix = f"run/runs/{result.run_key}/"
    written: dict[str, float] = {}  # each checkpoint folder's newest file (any format: its files are the code's)
    for item in client.list_objects_v2(Bucket="prt-chaos", Prefix=prefix)["Contents"]:
        folder, _, name = item["Key"][len(prefix) :].partition("/")
        if folder.startswith("epoch-") and name:
            written[folder] = max(written.get(folder, 0.0), item["LastModified"].timestamp())
    # The restarted workers read the checkpoint they resumed from back from the bucket; it was not rewritten.
    assert_resumed_not_restarted(written, kill)
    assert not (tmp_path / "storage").exists()


@pytest.mark.chaos
def test_cli_killed_in_register_model_registers_one_version_on_resume(tmp_path: Path) -> None:
    """SIGKILL the whole CLI inside register-model, as soon as it starts logging the model (the export, the
    version, the decision and the aliases follow). The resume trains nothing and finishes register-model: one
    version, which is champion, with the decision marked applied."""
    import ray
    from mlflow.exceptions import MlflowException
    from prefect.settings import PREFECT_API_URL

    api_url, ray_address = str(PREFECT_API_URL.value()), ray.get_runtime_context().gcs_address
    extra = [
        "--register",
        "--epochs=1",
        '--train-config={"dataset": "synthetic", "synthetic_samples": 4000}',
        "--model-name",
        "killed-in-register",
    ]
    first = _cli(tmp_path, api_url, ray_address, *extra)
    client = mlflow_client(tmp_path)

    def logged_models() -> list[Any]:
        """The model register-model logs (the fit's checkpoint LoggedModels come before it)."""
        run = only_run(tmp_path) if list((tmp_path / "storage" / "runs").glob("*/epoch-0001")) else None
        found = [] if run is None else client.search_logged_models([run.info.experiment_id])
        return [model for model in found if model.model_type != "checkpoint"]

    def versions() -> list[Any]:
        try:
            return list(client.search_model_versions("name = 'killed-in-register'"))
        except MlflowException:  # no version registered yet
            return []

    try:
        wait_for(logged_models, 300, "register-model to start logging the model")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    at_kill = versions()
    (run_dir,) = (tmp_path / "storage" / "runs").iterdir()

    resumed = _cli(tmp_path, api_url, ray_address, *extra, "--resume", run_dir.name)
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output[-4000:]
    assert "nothing to train" in output, output[-4000:]
    (version,) = versions()
    assert version.tags["promotion.applied"] == "true" and version.tags["promotion.decision"] == "promote"
    assert str(client.get_registered_model("killed-in-register").aliases["champion"]) == str(version.version)
    print(f"\nkilled with {len(at_kill)} version(s) registered; after the resume: version {version.version}")


@pytest.mark.chaos
def test_a_storage_outage_mid_run_is_ridden_out(tmp_path: Path, reference: PipelineResult, s3_server: Any) -> None:
    """S3 stops answering for 6 s mid-run and comes back on the same port (a door in front of the session's
    server, tests.helpers.Outage: no restart whose length varies with the machine's load). With no worker-group
    restart and no Prefect retry allowed, the run can only finish if the checkpoint uploads wait the outage out
    (workers get the retrying filesystem, not pyarrow's 3 tries over about 2 s, a third of the outage); it ends
    as an uninterrupted run ends, with every checkpoint in the bucket and intact."""
    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.storage.locations import download_dir, locate
    from raytrain_tasks.tracking.names import pinned_digests

    door = Outage(int(s3_server.endpoint_url.rsplit(":", 1)[1]))
    door.open()
    try:
        config = chaos_config(
            tmp_path,
            storage_path="s3://prt-outage-run/storage",
            s3_endpoint_url=door.url,
            create_bucket=True,
            max_failures=0,
            fit_retries=0,
            # The driver's lease rides out 5/12 of it for sure (docs/fault-tolerance.md): with the default 60 s,
            # 25 s, which a 20 s outage plus a loaded machine's restart of the server once overran (RunLeaseLostError).
            # This test is about the checkpoint uploads; the lease's own outage window is test_lease's.
            run_lease_seconds=180,
        )
        with ThreadPoolExecutor(1) as pool:
            future = start_flow(pool, config)
            wait_for(lambda: 0 in committed_epochs(tmp_path), 300, "epoch 0 to be committed")
            door.shut()
            time.sleep(6)
            blocked = committed_epochs(tmp_path)
            door.open()
            back = time.time()
            state = future.result(timeout=600)
        assert state.is_completed(), state.message
        assert blocked < set(range(EPOCHS)), "the run had finished before storage came back: no outage was ridden"
        assert_same_as_uninterrupted(tmp_path, reference)
        run = only_run(tmp_path)
        history = mlflow_client(tmp_path).get_metric_history(run.info.run_id, "val_accuracy")
        assert max(m.timestamp for m in history) / 1000 > back  # some epoch was committed only after the outage
        result = state.result()
        options = StorageOptions(endpoint_url=s3_server.endpoint_url)
        best = locate(result.fit.best_checkpoint_uri, options)
        run_dir = download_dir(locate(best.uri.rsplit("/", 1)[0], options), tmp_path / "run")
        kept = sorted(p.name for p in run_dir.glob("epoch-*"))
        assert kept == [checkpoint_dir_name(epoch) for epoch in range(EPOCHS)]
        # None truncated by an upload cut off mid-way: each holds the files it was committed with.
        pinned = pinned_digests(run.data.tags)
        assert all(local_folder_digest(run_dir / name) == pinned[name] for name in kept), (kept, pinned)
    finally:
        door.shut()
