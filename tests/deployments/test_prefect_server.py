"""The deployments against a real `prefect server`: schedules, a triggered run with overrides, the UI's custom run.

One server for the module, on a free 127.0.0.1 port with its own PREFECT_HOME. The deployments are made from a
copy of the project (as from a user's checkout), so every run writes its `.pipeline/` state there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import UUID
from zoneinfo import ZoneInfo

import pytest
import yaml
from mlflow import MlflowClient
from prefect.exceptions import PrefectHTTPStatusError

from deployments.serve import load_deployment_specs
from tests.helpers import REPO_ROOT, free_port, joins_this_ray, stop_process_group, wait_for_http

pytestmark = pytest.mark.slow

PREFECT = str(Path(sys.executable).with_name("prefect"))
SPECS = {spec["name"]: spec for spec in load_deployment_specs()}
FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass(frozen=True)
class PrefectServer:
    url: str
    checkout: Path  # the project copy deployments are made from and run in
    env: dict[str, str]  # for clients, workers and serve processes

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    root = tmp_path_factory.mktemp("prefect-server")
    checkout = root / "checkout"
    for package in ("flows", "tasks", "raytrain_tasks", "deployments", "examples"):
        shutil.copytree(REPO_ROOT / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Not inherited from this test process: a tracking URI earlier tests exported (mlflow.set_tracking_uri does)
    # or the test harness's API. Runs must use their checkout's defaults and this server.
    inherited = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    env = {
        **inherited,
        "PREFECT_HOME": str(root / "home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": f"{url}/api",  # the UI calls the API at this address, not at the default :4200
    }
    (root / "home").mkdir()
    log_path = root / "server.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_http(f"{url}/api/health", server, log_path, timeout=120)
        yield PrefectServer(url=url, checkout=checkout, env={**env, "PREFECT_API_URL": f"{url}/api"})
    finally:
        stop_process_group(server)


def _start_in_checkout(server: PrefectServer, command: list[str], **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    """A long-running process (worker, serve) in the checkout, its own process group, output to a log."""
    log_path = server.checkout.parent / f"{Path(command[0]).name}-{command[-1].strip('-')}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command,
            cwd=server.checkout,
            env={**server.env, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log_path


@contextmanager
def _worker(server: PrefectServer, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A process worker of the pool for the block (its runs inherit ``env``): (its process, its log)."""
    # It asks for runs every second rather than every 10 s (Prefect's default): each pickup waits no window out.
    worker, log = _start_in_checkout(
        server, [PREFECT, "worker", "start", "--pool", "raytrain-process"], PREFECT_WORKER_QUERY_SECONDS="1", **env
    )
    try:
        yield worker, log
    finally:
        stop_process_group(worker, signal.SIGINT)


def _prefect_cli(server: PrefectServer, *args: str) -> str:
    done = subprocess.run(
        [PREFECT, "--no-prompt", *args],
        cwd=server.checkout,
        env={**server.env, "PWD": str(server.checkout)},  # as a shell in the checkout sets it: {{ $PWD }}
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _api(server: PrefectServer, work: Any) -> Any:
    """`work(client)` with a synchronous client of the test server (playwright's sync API owns an event loop)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server.api_url}), get_client(sync_client=True) as client:
        return work(client)


def _deployment_runs(server: PrefectServer, name: str) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

    def work(client: Any) -> list[Any]:
        deployment = client.read_deployment_by_name(f"training-pipeline/{name}")
        flow_filter = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment.id]))
        runs = client.read_flow_runs(flow_run_filter=flow_filter)
        return sorted(runs, key=lambda run: run.expected_start_time)

    return list(_api(server, work))


def _wait_for_scheduled_runs(server: PrefectServer, name: str, count: int = 3, timeout: float = 90) -> list[Any]:
    deadline = time.monotonic() + timeout
    while len(runs := [r for r in _deployment_runs(server, name) if r.state_name == "Scheduled"]) < count:
        assert time.monotonic() < deadline, f"{len(runs)} runs of {name} scheduled after {timeout} s"
        time.sleep(1)
    return runs


def _wait_for_final_state(server: PrefectServer, flow_run_id: UUID, timeout: float = 480) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        flow_run = _api(server, lambda client: client.read_flow_run(flow_run_id))
        if flow_run.state_type.value in FINAL_STATES or time.monotonic() > deadline:
            return flow_run
        time.sleep(0.5)


def _next_nightly_times(now: datetime, count: int) -> list[datetime]:
    """The next `count` 02:00 Europe/Berlin instants after `now`, in UTC: what the cron schedule must produce."""
    berlin = ZoneInfo("Europe/Berlin")
    today = now.astimezone(berlin).date()
    candidates = (datetime.combine(today + timedelta(days=d), datetime.min.time(), berlin) for d in range(count + 2))
    times = [(c.replace(hour=2)).astimezone(UTC) for c in candidates]
    return [t for t in times if t > now][:count]


def _assert_run_is_tracked_and_published(
    server: PrefectServer, flow_run: Any, epochs: int, params: dict[str, Any] | None = None
) -> str:
    """Checks the run's artifacts and its MLflow run (with these MLflow params, when given); returns the Prefect
    UI link the MLflow run carries."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    assert flow_run.state_type.value == "COMPLETED", flow_run.state
    artifact_filter = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
    artifacts = _api(server, lambda client: client.read_artifacts(artifact_filter=artifact_filter))
    by_type = {artifact.type: artifact for artifact in artifacts}
    assert by_type["progress"].data == 100.0
    summary = next(a for a in artifacts if a.key == "training-summary")
    assert "val_accuracy" in summary.data and "champion" in summary.data

    # The run wrote its state into the checkout it was deployed from: MLflow has it, tagged with the flow run.
    tracking = MlflowClient(f"sqlite:///{server.checkout / '.pipeline' / 'mlflow.db'}")
    experiment = tracking.get_experiment_by_name("prefect-raytrain")
    (run,) = tracking.search_runs([experiment.experiment_id], f"tags.`prefect.flow_run_id` = '{flow_run.id}'")
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == str(epochs)
    for key, value in (params or {}).items():
        assert run.data.params[key] == str(value), key
    assert run.data.tags["prefect.flow_run_url"] == f"{server.url}/runs/flow-run/{flow_run.id}"
    assert [m.step for m in tracking.get_metric_history(run.info.run_id, "val_accuracy")] == list(range(1, epochs + 1))
    return str(run.data.tags["prefect.flow_run_url"])


@pytest.mark.usefixtures("ray_cluster")
def test_deploy_schedules_nightly_runs_and_a_worker_runs_an_override(
    prefect_server: PrefectServer, ad_hoc: Any
) -> None:
    # `prefect deploy --all` made the deployments of deployments/prefect.yaml (the ad_hoc fixture, once per module).
    # The scheduler fills in the next nightly runs within seconds, at 02:00 Berlin time, with the nightly parameters.
    scheduled = _wait_for_scheduled_runs(prefect_server, "nightly-retrain")
    expected = _next_nightly_times(datetime.now(UTC), len(scheduled))
    assert [run.expected_start_time for run in scheduled] == expected
    assert all(run.state_name == "Scheduled" for run in scheduled)
    assert scheduled[0].parameters == SPECS["nightly-retrain"]["parameters"]
    # What the UI form submits is validated by the server against the flow's schema: no run is created.
    invalid = {"num_workers": 0}
    with pytest.raises(Exception, match="num_workers|minimum|greater"):
        _api(prefect_server, lambda client: client.create_flow_run_from_deployment(ad_hoc.id, parameters=invalid))
    assert _deployment_runs(prefect_server, "ad-hoc") == []
    print("\nnext nightly-retrain runs:", ", ".join(f"{t:%Y-%m-%d %H:%M %Z}" for t in expected))

    # Its run trains on the session's Ray: a worker's run on a local Ray of its own is the chaos tests' (below).
    with _worker(prefect_server, **joins_this_ray()) as (_, worker_log):
        # What a user types to run the nightly now with one setting changed, in Prefect's usual form.
        output = _prefect_cli(
            prefect_server, "deployment", "run", "training-pipeline/nightly-retrain", "-p", "epochs=2"
        )
        match = re.search(r"UUID:\s*([0-9a-f-]{36})", output)
        assert match, output
        flow_run = _wait_for_final_state(prefect_server, UUID(match.group(1)))
        assert flow_run.state_type.value == "COMPLETED", worker_log.read_text()[-5000:]

    nightly = SPECS["nightly-retrain"]["parameters"]
    assert flow_run.parameters == {**nightly, "epochs": 2}  # the server laid the override over the nightly's
    _assert_run_is_tracked_and_published(prefect_server, flow_run, epochs=2, params={**nightly, "epochs": 2})
    latency = (flow_run.start_time - flow_run.created).total_seconds()
    print(f"nightly run with an override via worker: {latency:.1f} s from trigger to start, {flow_run.state_name}")


EPOCHS = 4


@pytest.fixture(scope="module")
def ad_hoc(prefect_server: PrefectServer) -> Any:
    """The ad-hoc deployment on the process pool, deployed once for the module's worker tests (each `prefect
    deploy` takes about 12 s here); each test runs it under an experiment and model name of its own."""
    _prefect_cli(prefect_server, "work-pool", "create", "raytrain-process", "--type", "process", "--overwrite")
    _prefect_cli(prefect_server, "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    return _api(prefect_server, lambda client: client.read_deployment_by_name("training-pipeline/ad-hoc"))


def _start_until_epoch_2(server: PrefectServer, deployment: Any, name: str, worker_log: Path) -> tuple[Any, str]:
    """A run of `deployment` with epochs of a few seconds (so that a kill lands inside it), once epoch 2 is in
    MLflow: (the flow run, its MLflow run id)."""
    config = {
        "train_config": {"dataset": "synthetic", "synthetic_samples": 60000},
        "batch_size": 32,
        "epochs": EPOCHS,
        "num_workers": 2,
        "experiment_name": name,
        "model_name": name,
    }
    created = _api(server, lambda c: c.create_flow_run_from_deployment(deployment.id, parameters=config))
    tracking = _tracking(server)
    deadline = time.monotonic() + 300
    while True:
        flow_run = _api(server, lambda c: c.read_flow_run(created.id))
        assert flow_run.state_type.value not in FINAL_STATES, worker_log.read_text()[-5000:]
        assert time.monotonic() < deadline, f"{name}: epoch 2 never reached MLflow"
        experiment = tracking.get_experiment_by_name(name)
        runs = [] if experiment is None else tracking.search_runs([experiment.experiment_id])
        if runs and len(tracking.get_metric_history(runs[0].info.run_id, "val_accuracy")) >= 2:
            return flow_run, str(runs[0].info.run_id)
        time.sleep(0.3)


def _tracking(server: PrefectServer) -> MlflowClient:
    return MlflowClient(f"sqlite:///{server.checkout / '.pipeline' / 'mlflow.db'}")


def _continuations(server: PrefectServer, crashed: Any) -> list[Any]:
    """The runs that continue ``crashed``, first created first."""
    continues = f"prefect.flow-run.{crashed.id}"
    runs = [run for run in _deployment_runs(server, "ad-hoc") if run.parameters.get("continue_flow_run") == continues]
    return sorted(runs, key=lambda run: (run.created, str(run.id)))


def _assert_continued_to_the_end(server: PrefectServer, lost: LostRun) -> None:
    """A continuation of the crashed run completed it: same run key, same MLflow run, every epoch logged once, one
    registered version. Prints the recovery times."""
    assert lost.finished is not None, f"no continuation was created\n{lost.worker_log}"
    assert lost.finished.state_type.value == "COMPLETED", (lost.finished.state, lost.worker_log)
    crashed, finished, name, killed_at = lost.crashed, lost.finished, lost.name, lost.killed_at
    tracking = _tracking(server)
    (run_key,) = [tag.removeprefix("run-key:") for tag in crashed.tags if tag.startswith("run-key:")]
    assert f"run-key:{run_key}" in finished.tags
    # The crash trigger may fire twice for one crash (seen here): the first continuation trains, any other ends
    # Cancelled without training (not Failed on the run lease).
    first, *others = _continuations(server, crashed)
    assert first.id == finished.id
    for other in others:
        other = _wait_for_final_state(server, other.id)
        assert other.state_type.value == "CANCELLED" and str(finished.id) in other.state.message, other.state
        assert not any(tag.startswith("run-key:") for tag in other.tags)
    print(f"\n{crashed.name}: {1 + len(others)} continuation(s) created by the crash trigger")
    experiment = tracking.get_experiment_by_name(name)
    (run,) = tracking.search_runs([experiment.experiment_id])  # one MLflow run for both flow runs
    assert run.info.run_id == lost.mlflow_run_id and run.info.status == "FINISHED"
    assert run.data.tags["prefect_raytrain.run_key"] == run_key
    history = tracking.get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1))  # each epoch exactly once
    versions = tracking.search_model_versions(f"name = '{name}'")
    assert [v.tags.get("run_key") for v in versions] == [run_key]
    started = finished.start_time.timestamp()
    before = [m for m in history if m.timestamp / 1000 < started]  # by the killed run (its Ray can outlive it)
    resumed = min(m.timestamp for m in history if m.timestamp / 1000 >= started) / 1000
    print(
        f"\n{name}: kill -> Crashed {crashed.state.timestamp.timestamp() - killed_at:.1f} s, "
        f"-> continuation started {started - killed_at:.1f} s, "
        f"-> first resumed epoch logged {resumed - killed_at:.1f} s ({len(before)} epochs logged before it started)"
    )


@dataclass(frozen=True)
class LostRun:
    name: str
    mlflow_run_id: str
    killed_at: float
    unnoticed: Any  # the zombie's flow run 10 s after its kill (None for the crashed run)
    crashed: Any  # the flow run as last read: Crashed, unless nothing set it
    finished: Any  # its continuation once final; None when none was created
    worker_log: str  # the tail of the log of the worker that ran the continuations


# The zombie watch's window at its shortest: two heartbeats of 30 s. A run's start brings the server's watch to
# its window, as a deployment's job variable would, so both workers set it: a run started with the default would
# move the watch to 120 s. A live run is set Crashed only if a heartbeat comes 30 s late.
SILENCE = {"PREFECT_RAYTRAIN_ZOMBIE_SILENCE_SECONDS": "60"}


@pytest.fixture(scope="module")
def lost_runs(prefect_server: PrefectServer, ad_hoc: Any) -> dict[str, LostRun]:
    """Two runs lost after epoch 2 of 4, one after the other, so that the zombie's wait for its window and the
    crashed run's recovery overlap:
    - "zombie-test": its worker and its flow-run process SIGKILLed together (a lost machine);
    - "crash-test": its flow-run process alone SIGKILLed (an OOM kill), 10 s later, under a worker of its own.
    That worker runs both continuations, in whichever order the server creates them. What the tests assert is
    read here, not asserted: each test fails on its own run."""
    with _worker(prefect_server, **SILENCE) as (worker, worker_log):
        zombie, zombie_mlflow_run = _start_until_epoch_2(prefect_server, ad_hoc, "zombie-test", worker_log)
        os.kill(worker.pid, signal.SIGKILL)
        os.kill(int(str(zombie.infrastructure_pid).rsplit(":", 1)[-1]), signal.SIGKILL)
        zombie_killed_at = time.time()
        worker.wait()
    time.sleep(10)
    unnoticed = _api(prefect_server, lambda c: c.read_flow_run(zombie.id))
    lost = {}
    with _worker(prefect_server, **SILENCE) as (_, worker_log):
        crash, crash_mlflow_run = _start_until_epoch_2(prefect_server, ad_hoc, "crash-test", worker_log)
        os.kill(int(str(crash.infrastructure_pid).rsplit(":", 1)[-1]), signal.SIGKILL)
        crash_killed_at = time.time()
        for name, flow_run, mlflow_run_id, killed_at in (
            ("crash-test", crash, crash_mlflow_run, crash_killed_at),
            ("zombie-test", zombie, zombie_mlflow_run, zombie_killed_at),
        ):
            crashed = _wait_for_final_state(prefect_server, flow_run.id, timeout=300)
            continuations = _continuations_within(prefect_server, crashed, timeout=180)
            finished = _wait_for_final_state(prefect_server, continuations[0].id) if continuations else None
            log = worker_log.read_text(errors="replace")[-8000:]
            seen_after_10_s = unnoticed if flow_run is zombie else None
            lost[name] = LostRun(name, mlflow_run_id, killed_at, seen_after_10_s, crashed, finished, log)
    return lost


def _continuations_within(server: PrefectServer, crashed: Any, timeout: float) -> list[Any]:
    """The runs that continue ``crashed`` once there is one, or [] after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (continuations := _continuations(server, crashed)) and time.monotonic() < deadline:
        time.sleep(1)
    return continuations


def _seconds_to_crashed(lost: LostRun) -> float:
    return float(lost.crashed.state.timestamp.timestamp() - lost.killed_at)


@pytest.mark.chaos
def test_a_crashed_deployment_run_continues_by_itself(
    prefect_server: PrefectServer, lost_runs: dict[str, LostRun]
) -> None:
    """The flow-run process SIGKILLed after epoch 2 of 4 (as an OOM kill does): the worker marks the run Crashed,
    the deployment's crash trigger starts a continuation, and it resumes the same run key in the same MLflow run:
    every epoch logged once, one registered version. Nobody runs `--resume`."""
    lost = lost_runs["crash-test"]
    assert lost.crashed.state_type.value == "CRASHED", lost.crashed.state
    # Set by its worker, which saw the process die, not by the zombie watch a minute later.
    assert "no heartbeat" not in str(lost.crashed.state.message), lost.crashed.state
    assert _seconds_to_crashed(lost) < 60, (_seconds_to_crashed(lost), lost.worker_log)
    _assert_continued_to_the_end(prefect_server, lost)


@pytest.mark.chaos
def test_a_run_that_lost_its_worker_too_is_found_and_continued(
    prefect_server: PrefectServer, lost_runs: dict[str, LostRun]
) -> None:
    """The worker and the flow-run process SIGKILLed together (a lost machine): nobody is left to set the run
    Crashed, so it would stay Running forever. Its heartbeats stop; after the watch's window of silence (60 s
    here, 120 s by default) the zombie watch sets it Crashed, the crash trigger starts a continuation, and a
    worker of the pool runs it to the end."""
    lost = lost_runs["zombie-test"]
    assert lost.unnoticed.state_type.value == "RUNNING"  # 10 s after the kill, nobody noticed: a zombie
    server_log = (prefect_server.checkout.parent / "server.log").read_text(errors="replace")
    assert lost.crashed.state_type.value == "CRASHED", (lost.crashed.state, server_log[-6000:])
    assert "no heartbeat for 60 s" in str(lost.crashed.state.message), lost.crashed.state
    # Its last heartbeat came at most 30 s before the kill, and the watch waits out its 60 s window after it; the
    # rest of the bound is for a loaded machine.
    assert _seconds_to_crashed(lost) < 180, _seconds_to_crashed(lost)
    _assert_continued_to_the_end(prefect_server, lost)


@pytest.mark.chaos
def test_cancelling_a_run_stops_training_and_keeps_it_resumable(prefect_server: PrefectServer, ad_hoc: Any) -> None:
    """`prefect flow-run cancel` mid-fit: the run is Cancelled within seconds, the driver and every Ray process
    it started are gone, the MLflow run is KILLED (not FAILED) with the reason, the checkpoints stay, nothing
    continues it by itself (a cancel is not a crash), and a run with `resume` finishes it: each epoch once."""
    import psutil

    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.tracking.names import checkpoint_order, pinned_digests

    with _worker(prefect_server) as (_, worker_log):
        flow_run, mlflow_run_id = _start_until_epoch_2(prefect_server, ad_hoc, "cancel-test", worker_log)
        driver = psutil.Process(int(str(flow_run.infrastructure_pid).rsplit(":", 1)[-1]))
        started = [driver, *driver.children(recursive=True)]  # the driver, its local Ray, the Ray workers
        assert len(started) > 3
        cancelled_at = time.monotonic()
        _prefect_cli(prefect_server, "flow-run", "cancel", str(flow_run.id))
        cancelled = _wait_for_final_state(prefect_server, flow_run.id, timeout=120)
        to_cancelled = time.monotonic() - cancelled_at
        assert cancelled.state_type.value == "CANCELLED", cancelled.state
        _, alive = psutil.wait_procs(started, timeout=30)
        to_stopped = time.monotonic() - cancelled_at
        assert not alive, [process.info for process in alive]

        tracking = _tracking(prefect_server)
        run = tracking.get_run(mlflow_run_id)
        killed = run.data.tags.get("prefect_raytrain.killed", "")
        assert run.info.status == "KILLED" and "stopped by signal 15" in killed, worker_log.read_text()[-8000:]
        run_key = run.data.tags["prefect_raytrain.run_key"]
        checkpoints = sorted((prefect_server.checkout / ".pipeline" / "storage" / "runs" / run_key).glob("epoch-*"))
        assert checkpoints
        pinned = pinned_digests(run.data.tags)  # each kept, whole: the files it was committed with
        committed = [folder for folder in checkpoints if folder.name in pinned]
        assert committed and all(local_folder_digest(f) == pinned[f.name] for f in committed), checkpoints
        # A folder Ray Train wrote as the cancel came, before it was committed (pinned, with its epoch's metrics),
        # can only be the newest; the resume passes it over and says why, or finds its pin in the pin journal.
        uncommitted = [folder.name for folder in checkpoints if folder.name not in pinned]
        assert all(checkpoint_order(name) > checkpoint_order(committed[-1].name) for name in uncommitted), checkpoints

        resumed = _api(  # what `prefect deployment run training-pipeline/ad-hoc -p resume=<run key>` does
            prefect_server,
            lambda c: c.create_flow_run_from_deployment(
                ad_hoc.id, parameters={**flow_run.parameters, "resume": run_key}
            ),
        )
        finished = _wait_for_final_state(prefect_server, resumed.id)
        assert finished.state_type.value == "COMPLETED", worker_log.read_text()[-8000:]
    # In all the time the resumed run took, nothing continued the cancelled run by itself (a cancel is no crash).
    continues = f"prefect.flow-run.{flow_run.id}"
    runs = _deployment_runs(prefect_server, "ad-hoc")
    assert not [other for other in runs if other.parameters.get("continue_flow_run") == continues]
    history = tracking.get_metric_history(mlflow_run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1))
    finished_run = tracking.get_run(mlflow_run_id)
    assert finished_run.info.status == "FINISHED"
    passed_over = finished_run.data.tags.get("prefect_raytrain.resume_fallback", "")
    recovered = pinned_digests(finished_run.data.tags)
    checkpoint_dir = prefect_server.checkout / ".pipeline" / "storage" / "runs" / run_key
    for name in uncommitted:
        whole = recovered.get(name) == local_folder_digest(checkpoint_dir / name)
        assert whole or f"{name}: never recorded as committed" in passed_over, (name, passed_over)
    print(f"\ncancel: Cancelled after {to_cancelled:.1f} s, every process it started gone after {to_stopped:.1f} s")


def _wait_until_served(serve: subprocess.Popen[bytes], serve_log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while "being served" not in serve_log.read_text():
        assert serve.poll() is None and time.monotonic() < deadline, serve_log.read_text()[-3000:]
        time.sleep(0.5)


def _ray_leftovers(address: str) -> tuple[list[str], int]:
    """What is left on the Ray at ``address``: its live actors and its placement groups not removed."""
    probe = textwrap.dedent(
        f"""
        import json
        from ray.util.state import list_actors, list_placement_groups
        actors = list_actors(address="{address}", filters=[("state", "!=", "DEAD")], limit=10_000)
        groups = list_placement_groups(address="{address}", filters=[("state", "!=", "REMOVED")], limit=10_000)
        print("LEFT" + json.dumps([sorted(a.class_name for a in actors), len(groups)]))
        """
    )
    seen = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert seen.returncode == 0, seen.stderr[-3000:]
    actors, groups = json.loads(seen.stdout.split("LEFT", 1)[1])
    return list(actors), int(groups)


@dataclass(frozen=True)
class Served:
    process: subprocess.Popen[bytes]
    log: Path
    ray_address: str  # the warm local Ray serve started for its runs

    def ray_processes(self) -> list[Any]:
        import psutil

        children = psutil.Process(self.process.pid).children(recursive=True)
        return [p for p in children if p.name() in ("gcs_server", "raylet")]


@pytest.fixture(scope="module")
def served(prefect_server: PrefectServer) -> Iterator[Served]:
    """`python -m deployments.serve` in the checkout, once for the module's serve tests (each start is a Ray
    start and a registration of every deployment); the last of them stops it and checks what stopping does."""
    # A prefect.yaml of one's own (--prefect-file): this project's deployments, and one that names the user's code.
    own_file = prefect_server.checkout.parent / "served-deployments.yaml"
    own = {"name": "images", "description": "the image example", "parameters": {"train_code": IMAGE_CODE}}
    own_file.write_text(yaml.safe_dump({"deployments": [*load_deployment_specs(), own]}))
    serve, serve_log = _start_in_checkout(
        prefect_server, [sys.executable, "-m", "deployments.serve", "--prefect-file", str(own_file), "--replace"]
    )
    try:
        _wait_until_served(serve, serve_log)
        announced = re.search(r"warm local Ray at (\S+)", serve_log.read_text())
        assert announced, serve_log.read_text()[-3000:]
        yield Served(serve, serve_log, announced.group(1))
    finally:
        stop_process_group(serve, signal.SIGTERM, timeout=60)


# A TrainFunc given as `train_code` on a run of the ad-hoc deployment, and a TrainSpec served as a deployment of
# its own (typed form). What serving adds does not depend on the example: the others train through the flow in
# test_own_code (the diabetes regression, seed_ray_data), test_sharded and the guide's test.
EXAMPLES = ("seed_ddp", "image_classifier")
IMAGE_CODE = "examples.image_classifier.train:training"
# A key of one's own for code with plain defaults; the image example declares its settings (a typed class), so it
# takes only those.
TRAIN_CONFIGS = {"seed_ddp": {"seed_note": "served"}, "image_classifier": {"channels": 8}}
# What Ray keeps once per cluster after the first run that reads data with Ray Data (its autoscaling coordinator).
ONCE_PER_CLUSTER = {"_AutoscalingCoordinatorActor"}


@dataclass(frozen=True)
class ServedRuns:
    """Runs served one after another on serve's warm Ray: the ad-hoc deployment's own model (it reads its data
    with Ray Data), then each example through `train_code` or a deployment of its own."""

    default: Any  # the finished flow run of the ad-hoc deployment's model
    examples: dict[str, Any]  # example -> its finished flow run
    ray_processes: list[Any]  # serve's Ray (gcs_server, raylet) as it was before the first run
    left: list[tuple[list[str], int]]  # what was left on serve's Ray after the first run and after the last


@pytest.fixture(scope="module")
def served_runs(prefect_server: PrefectServer, served: Served) -> ServedRuns:
    serve_log, address = served.log, served.ray_address
    ray_processes = served.ray_processes()
    ad_hoc = _api(prefect_server, lambda client: client.read_deployment_by_name("training-pipeline/ad-hoc"))
    images = _api(prefect_server, lambda client: client.read_deployment_by_name("training-pipeline/images"))

    def run(deployment: Any, parameters: dict[str, Any]) -> Any:
        created = _api(
            prefect_server, lambda c: c.create_flow_run_from_deployment(deployment.id, parameters=parameters)
        )
        flow_run = _wait_for_final_state(prefect_server, created.id)
        assert flow_run.state_type.value == "COMPLETED", (parameters, serve_log.read_text()[-5000:])
        return flow_run

    config = {"epochs": 1, "num_workers": 2, "experiment_name": "warm", "model_name": "warm", "register": False}
    default = run(ad_hoc, config)
    left = [_ray_leftovers(address)]
    examples = {}
    for example in EXAMPLES:
        parameters = {
            "train_code": f"examples.{example}.train:training",
            "train_config": TRAIN_CONFIGS[example],  # a JSON object, as `-p` and the UI's form send it
            "epochs": 1,  # the serving is the question here; their training: test_own_code, test_sharded, the guide
            "experiment_name": "own-code",
            "model_name": f"served-{example}",
        }
        target = ad_hoc
        if example == "image_classifier":
            target = images
            del parameters["train_code"]  # the deployment's
        examples[example] = run(target, parameters)
    left.append(_ray_leftovers(address))
    return ServedRuns(default, examples, ray_processes, left)


def test_served_runs_share_one_warm_ray(prefect_server: PrefectServer, served: Served, served_runs: ServedRuns) -> None:
    serve_log, address = served.log, served.ray_address
    ray_processes = served_runs.ray_processes
    assert len(ray_processes) == 2, [p.name() for p in ray_processes]
    finished = [served_runs.default, *served_runs.examples.values()]
    # All trained on serve's Ray, which is still up. Nothing of a run stays on it: no Ray Train actor, no
    # placement group; what Ray keeps once per cluster does not grow over the next two runs.
    tracking = _tracking(prefect_server)
    runs = [
        run
        for experiment in ("warm", "own-code")
        for run in tracking.search_runs([tracking.get_experiment_by_name(experiment).experiment_id])
    ]
    assert sorted(run.data.tags["prefect.flow_run_id"] for run in runs) == sorted(str(run.id) for run in finished)
    assert [run.data.tags["prefect_raytrain.ray_cluster"] for run in runs] == [address] * len(finished)
    assert all(p.is_running() for p in ray_processes)
    first, last = served_runs.left
    assert first == last, served_runs.left
    assert set(first[0]) <= ONCE_PER_CLUSTER, first  # the Ray Data run left nothing of its own
    assert "SIGTERM handler is not set" not in serve_log.read_text()  # Ray's warning about our connect thread
    actors, groups = last
    assert groups == 0 and not [name for name in actors if "Train" in name], served_runs.left
    waits = [(run.start_time - run.created).total_seconds() for run in finished]
    print(f"\nserved runs on the warm Ray at {address}: created -> started {waits} s; left on it: {last}")

    # A custom run that points MLflow elsewhere (where the worker's credentials would go) is refused before it
    # connects anywhere: the listener standing in for someone else's server is never contacted.
    deployment = _api(prefect_server, lambda client: client.read_deployment_by_name("training-pipeline/ad-hoc"))
    config = {"epochs": 1, "num_workers": 2, "experiment_name": "warm", "model_name": "warm"}
    with socket.socket() as collector:
        collector.bind(("127.0.0.1", 0))
        collector.listen()
        collector.setblocking(False)
        elsewhere = {**config, "mlflow_tracking_uri": f"http://127.0.0.1:{collector.getsockname()[1]}"}
        created = _api(prefect_server, lambda c: c.create_flow_run_from_deployment(deployment.id, parameters=elsewhere))
        refused = _wait_for_final_state(prefect_server, created.id)
        assert refused.state_type.value == "FAILED", serve_log.read_text()[-5000:]
        assert "has mlflow_tracking_uri other than its deployment's" in str(refused.state.message), refused.state
        with pytest.raises(BlockingIOError):
            collector.accept()


def test_the_examples_train_and_register_through_a_served_deployment(
    prefect_server: PrefectServer, served_runs: ServedRuns
) -> None:
    """The user's own code as a deployment parameter: `train_code` (and `train_config`) set on a run of the ad-hoc
    deployment, as `-p train_code=...` or the UI's form would; the code is found in the folder serve runs in."""
    # The image example is served as a deployment of its own (from serve's --prefect-file): its form types
    # train_config by the code's settings class, and the server refuses a run whose train_config does not fit.
    images = _api(prefect_server, lambda client: client.read_deployment_by_name("training-pipeline/images"))
    with pytest.raises(PrefectHTTPStatusError, match="409"):
        _api(
            prefect_server,
            lambda c: c.create_flow_run_from_deployment(images.id, parameters={"train_config": {"chanels": 8}}),
        )
    assert all(run.state_type.value == "COMPLETED" for run in served_runs.examples.values())
    assert served_runs.examples["image_classifier"].deployment_id == images.id
    tracking = _tracking(prefect_server)
    runs = tracking.search_runs([tracking.get_experiment_by_name("own-code").experiment_id])
    assert sorted(run.data.params["train_code"] for run in runs) == sorted(
        f"examples.{example}.train:training" for example in EXAMPLES
    )
    assert all(run.info.status == "FINISHED" for run in runs)
    for run in runs:
        example = run.data.params["train_code"].split(".")[1]
        assert {
            f"train_config.{k}": str(v) for k, v in TRAIN_CONFIGS[example].items()
        }.items() <= run.data.params.items()
    for example in EXAMPLES:
        assert tracking.get_registered_model(f"served-{example}").aliases.get("champion") is not None


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium: installed here when missing (as CI does, as root); no browser download."""
    path = shutil.which("chromium")
    if path is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            subprocess.run(command, env=env, check=True, capture_output=True, timeout=900)
        path = shutil.which("chromium")
    if path is None:
        pytest.skip("needs Debian's chromium: run `apt-get install -y chromium` (as root) to run the browser tests")
    return path


def _custom_run_created(page: Any, server: PrefectServer, before: set[Any]) -> Any:
    """The run the custom-run form's Submit created. A submit that goes through leaves the form for the deployment's
    page (and the form is disabled meanwhile); one that did not (seen once in CI: no run in 60 s, no error shown)
    is clicked once more while the form is still there. On failure: what the page shows, and a screenshot."""
    form_url, started = page.url, time.monotonic()
    clicked_again = False
    while not (new := [r for r in _deployment_runs(server, "ad-hoc") if r.id not in before]):
        if not clicked_again and time.monotonic() - started > 30 and page.url == form_url:
            page.get_by_role("button", name="Submit").click()
            clicked_again = True
        if time.monotonic() - started > 90:
            page.screenshot(path=server.checkout.parent / "custom-run-form.png", full_page=True)
            raise AssertionError(
                f"the custom run was not created; the page ({page.url}) shows:\n{page.inner_text('body')[:3000]}"
            )
        time.sleep(1)
    (created,) = new
    return created


@pytest.mark.browser
def test_serve_and_a_custom_run_from_the_ui(prefect_server: PrefectServer, served: Served, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    serve_log = served.log
    _wait_for_scheduled_runs(prefect_server, "nightly-retrain")  # serving keeps the schedule
    before = {run.id for run in _deployment_runs(prefect_server, "ad-hoc")}
    deployment = _api(prefect_server, lambda client: client.read_deployment_by_name("training-pipeline/ad-hoc"))

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{prefect_server.url}/deployments/deployment/{deployment.id}")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run").click()
            # The form is built from the flow's schema: every field titled and described.
            epochs_field = page.locator(
                "xpath=//*[normalize-space(text())='Passes over the training split.']/ancestor::div[.//input][1]"
            )
            epochs_input = epochs_field.locator("input").first
            epochs_input.wait_for(timeout=30_000)
            assert epochs_input.input_value() == "3"  # the deployment's default
            epochs_input.fill("1")
            page.get_by_role("button", name="Submit").click()
            created = _custom_run_created(page, prefect_server, before)
            flow_run = _wait_for_final_state(prefect_server, created.id)
            assert flow_run.state_type.value == "COMPLETED", serve_log.read_text()[-5000:]

            assert flow_run.parameters["epochs"] == 1
            link = _assert_run_is_tracked_and_published(prefect_server, flow_run, epochs=1)

            # From the MLflow run, its Prefect link opens the run page: completed, with the summary artifact.
            page.goto(link)
            try:
                page.get_by_text("Completed").first.wait_for(timeout=30_000)
                page.get_by_text("Artifacts", exact=True).first.click()
                page.get_by_text("training-summary").first.wait_for(timeout=30_000)
            finally:
                page.screenshot(path=prefect_server.checkout.parent / "flow-run-page.png", full_page=True)
        finally:
            browser.close()

    latency = (flow_run.start_time - flow_run.created).total_seconds()
    print(f"custom run from the UI via serve: {latency:.1f} s from submit to start")


def test_serve_stopped_stops_its_ray_and_pauses_its_deployments(prefect_server: PrefectServer, served: Served) -> None:
    """Last of the serve tests (it stops the module's serve): SIGTERM to serve alone ends the warm Ray it started,
    and Prefect pauses its deployments and drops their scheduled runs."""
    import psutil

    _wait_for_scheduled_runs(prefect_server, "nightly-retrain")  # serving keeps the schedule
    serve, ray_processes = served.process, served.ray_processes()
    assert len(ray_processes) == 2, [p.name() for p in ray_processes]
    serve.send_signal(signal.SIGTERM)  # serve alone: it stops its Ray itself
    serve.wait(timeout=60)
    alive = psutil.wait_procs(ray_processes, timeout=30)[1]
    assert not alive, f"Ray processes left by serve: {[p.name() for p in alive]}"

    # When serve stops, Prefect pauses its deployments and drops their scheduled runs; serving again resumes.
    # Prefect writes the pause during serve's shutdown; on a loaded machine it lands a moment after the exit.
    deadline = time.monotonic() + 30
    while (
        not (
            nightly := _api(prefect_server, lambda c: c.read_deployment_by_name("training-pipeline/nightly-retrain"))
        ).paused
        and time.monotonic() < deadline
    ):
        time.sleep(1)
    assert nightly.paused, f"serve exited with {serve.returncode}:\n{served.log.read_text()[-3000:]}"
    assert not [r for r in _deployment_runs(prefect_server, "nightly-retrain") if r.state_name == "Scheduled"]
