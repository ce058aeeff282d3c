"""Helpers the tests share: configs shrunk for a 2-core machine, free ports, server launchers, process groups.

Fixtures live in conftest.py (pytest finds them there); everything a test imports lives here. conftest.py sets
the test process's environment (a private Prefect home, the local S3 server's credentials) before any of this
is imported.
"""

from __future__ import annotations

import contextvars
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_tasks.config import TrainingConfig

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from raytrain_driver.fit_record import FitResult
    from raytrain_tasks.table_classifier.data import DatasetRef

REPO_ROOT = Path(__file__).resolve().parents[1]


_MLFLOW_TEMPLATE: list[Path] = []  # one migrated, empty MLflow SQLite store per test process


def seed_mlflow_store(db: Path) -> Path:
    """Put an empty, migrated MLflow SQLite store at ``db`` (unless one is there): a copy of one made once per
    test process. Creating a store runs MLflow's migrations (2-3 s here); the copy differs only in the default
    experiment's artifact location (the template's folder), which no test uses."""
    if not _MLFLOW_TEMPLATE:
        from mlflow import MlflowClient

        template = Path(tempfile.mkdtemp(prefix="prt-mlflow-template-")) / "mlflow.db"
        MlflowClient(f"sqlite:///{template}").search_experiments(max_results=1)
        _MLFLOW_TEMPLATE.append(template)
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_MLFLOW_TEMPLATE[0], db)
    return db


@contextmanager
def a_stop_in_the_next_mlflow_query() -> Iterator[None]:
    """Raise Prefect's TerminationSignal (what SIGTERM raises in a flow run) in this thread's next MLflow query on
    a SQL store, after SQLite ran it and before SQLAlchemy fetched its rows: one of the places a signal's handler
    can run. Nothing is raised after the first."""
    from prefect.exceptions import TerminationSignal
    from sqlalchemy.orm import loading

    # SQLAlchemy 2.0's ORM fetch, read in 2.0.x: it gets the executed cursor and closes it on an Exception only.
    # If it is renamed, the block's query runs unstopped and the assertion below says so.
    fetch = loading.instances.__code__
    raised: list[bool] = []

    def trace(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is fetch and not raised:
            raised.append(True)
            raise TerminationSignal(signal=signal.SIGTERM)

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
    assert raised, "no MLflow query ran in the block"


def this_ray_address() -> str:
    """The GCS address of the Ray this process is connected to, for Ray's State API (``list_actors`` and the
    like). Without one, the State API follows RAY_ADDRESS or /tmp/ray/ray_current_cluster, which any earlier
    `ray start` cluster on the machine may have left pointing at a dead cluster."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def joins_this_ray() -> dict[str, str]:
    """Environment for a command in a subprocess to train on this session's local Ray, as the runs that
    `deployments.serve` starts join its warm Ray, instead of starting and stopping one of its own (about 10 s and
    as many CPU-seconds each). A local Ray's own start is shown by test_cli's run on embedded defaults."""
    from raytrain_driver.cluster import WARM_RAY_ENV

    return {WARM_RAY_ENV: this_ray_address(), "RAY_AUTH_MODE": "token"}


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1. All are held open until all are chosen: ports taken one at a
    time may repeat (the OS can hand out a port again once its socket is closed), and `ray start` refuses a port
    given to two of its components."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_for_http(url: str, process: subprocess.Popen[Any], log: Path, timeout: float = 120) -> None:
    """Until `url` answers 200; fail with the log's tail if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{process.args!r} did not come up at {url}: {log.read_text()[-3000:]}")
        time.sleep(0.5)


def stop_process_group(process: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Stop a process started with start_new_session=True and all its children; SIGKILL if it lingers."""
    if process.poll() is None:
        os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)
    try:  # children left behind by a process that exited on its own
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def small_config(workdir: Path, **overrides: Any) -> TrainingConfig:
    """The real default config, shrunk to what a 2-core CI machine trains in seconds."""
    values: dict[str, Any] = {
        "num_workers": 2,
        "epochs": 3,
        "storage_path": str(workdir / "storage"),
        "mlflow_tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}",
        "experiment_name": "tests",
        "model_name": "digits-test",
        "retry_delay_seconds": 0,
    }
    values.update(overrides)
    if values["mlflow_tracking_uri"] == f"sqlite:///{workdir / 'mlflow.db'}":
        seed_mlflow_store(workdir / "mlflow.db")
    # The table classifier's settings (dataset=, synthetic_samples=, ...) go into its train_config.
    from raytrain_tasks.moved_settings import carried_into_train_config

    return TrainingConfig(**carried_into_train_config(values))


def start_mlflow_server(
    root: Path, port: int, app_name: str = "", env: dict[str, str] | None = None
) -> subprocess.Popen[Any]:
    """`mlflow server` with a SQLite backend (``root``/mlflow.db, kept if there) and a local artifact root under
    ``root``, on 127.0.0.1:``port``; returns once it answers. Started again on the same ``root`` and port, it is
    the same registry, as after an outage. ``app_name``: e.g. "basic-auth"; ``env``: added to the server's."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
    seed_mlflow_store(root / "mlflow.db")
    command = [sys.executable, "-m", "mlflow", "server", *(["--app-name", app_name] if app_name else [])]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(root / "artifacts")]
    with (root / "server.log").open("a") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", server, root / "server.log", timeout=90)
    except BaseException:
        stop_process_group(server)
        raise
    return server


class MlflowServer(str):
    """The server's URL, and where it keeps artifacts (to damage them on purpose)."""

    artifacts: Path

    def __new__(cls, url: str, artifacts: Path) -> MlflowServer:
        server = super().__new__(cls, url)
        server.artifacts = artifacts
        return server


class Outage:
    """A TCP door in front of a server that a test shuts and opens at once: shut, every connection to it is
    refused and the open ones are cut (as a client sees a server that is down); opened, it forwards again on the
    same port. A real server's restart takes seconds that vary with the machine's load; a test that times a
    window around the outage needs the outage to end when it says so.

    ``lose_next_reply()``: the next request still reaches the server, its reply never reaches the client (the
    connection is cut when it comes), as when a network fails after the server acted; later replies go through.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._replies_to_lose, self.replies_lost = 0, 0

    def lose_next_reply(self) -> None:
        """Cut the connection that carries the server's next reply, and only that one: which reply is lost then
        does not depend on how soon the test looks, nor on how often the client retries meanwhile."""
        with self._lock:
            self._replies_to_lose += 1

    def _reply_lost(self) -> bool:
        with self._lock:
            if self._replies_to_lose == 0:
                return False
            self._replies_to_lose -= 1
            self.replies_lost += 1
            return True

    def __enter__(self) -> Outage:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shut()

    def open(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def shut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            cut, self._open = self._open, []
        for sock in ([listener] if listener else []) + cut:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # shut
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink, source is upstream), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool = False) -> None:
        """Forward one direction until either side ends (``replies``: the server's side, whose next reply other
        than an interim ``100 Continue`` may be the one to lose); then end both, and close the side read from."""
        try:
            while data := source.recv(65536):
                if replies and not data.startswith(b"HTTP/1.1 100 ") and self._reply_lost():
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            if source in self._open:
                self._open.remove(source)
        source.close()


# A flow run in a thread, and a Ray Train worker killed mid-run (test_recovery, test_own_code, test_sharded).
def start_flow(pool: ThreadPoolExecutor, config: Any) -> Any:
    """Run the flow in a thread that sees this thread's Prefect settings (they live in context variables)."""
    from flows.training import training_pipeline
    from raytrain_tasks.config import parameters_of

    return pool.submit(contextvars.copy_context().run, training_pipeline, **parameters_of(config), return_state=True)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def mlflow_client(workdir: Path) -> MlflowClient:
    """A client of the store in ``workdir``, its registry named as the product names it (never MLflow's globals)."""
    from mlflow import MlflowClient

    store = f"sqlite:///{workdir / 'mlflow.db'}"
    return MlflowClient(store, registry_uri=store)


def only_run(workdir: Path) -> Any:
    client = mlflow_client(workdir)
    experiment = client.get_experiment_by_name("tests")
    runs = [] if experiment is None else client.search_runs([experiment.experiment_id])
    assert len(runs) <= 1, "one logical run must be one MLflow run"
    return runs[0] if runs else None


def committed_epochs(workdir: Path, metric: str = "val_accuracy") -> set[int]:
    """The 0-based indices of the epochs whose checkpoint Ray Train registered (the controller logs them to MLflow
    only then, at ``step`` = the epoch number, index + 1), read from ``metric``, one the code reports each epoch."""
    run = only_run(workdir)
    if run is None:
        return set()
    return {int(m.step) - 1 for m in mlflow_client(workdir).get_metric_history(run.info.run_id, metric)}


def train_worker_pids(workers: int) -> list[int]:
    """The PIDs of the run's Ray Train workers once all ``workers`` are up (empty before)."""
    from ray.util.state import list_actors

    alive = [("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")]
    pids = [int(actor.pid) for actor in list_actors(address=this_ray_address(), filters=alive)]
    return pids if len(pids) == workers else []


@dataclass(frozen=True)
class Kill:
    at: float  # time.time() of the SIGKILL
    resume_epoch: int  # the newest epoch Ray Train had registered: the restarted group resumes from it


def run_killing_a_worker(
    workdir: Path,
    config: Any,
    after_epoch: int = 1,
    before_kill: Callable[[int], None] | None = None,
    metric: str = "val_accuracy",
) -> tuple[Any, Kill]:
    """Run the flow and SIGKILL one Ray Train worker once ``after_epoch`` is committed; (final state, the kill).

    The kill cannot be timed to an epoch by polling: an epoch takes about 0.5 s here, Ray Train's controller
    registers one report per poll of the workers (every 0.1 s, raytrain_driver.cluster.HEALTH_CHECK_INTERVAL_S), and a
    worker uploads its next checkpoint before it waits for the controller to take the last report; so by the
    time epoch N is registered and seen in MLflow, the checkpoints of N+1 and N+2 may be uploaded already (seen
    in CI: the corrupted epoch was no longer the one resumed from). So every worker is stopped (SIGSTOP) as soon
    as ``after_epoch`` is committed: nothing is trained, uploaded or reported after that. The epoch the restarted
    group resumes from is read then, ``before_kill(resume_epoch)`` runs, one worker is killed and the others
    continue.
    """
    with ThreadPoolExecutor(1) as pool:
        future = start_flow(pool, config)
        pids = wait_for(lambda: train_worker_pids(config.num_workers), 300, "the worker group to start")
        committed = f"epoch {after_epoch} to be committed"
        wait_for(lambda: after_epoch in committed_epochs(workdir, metric), 300, committed, 0.02)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.5)  # a registration already under way in the controller lands in MLflow
            resume_epoch = max(committed_epochs(workdir, metric))
            if before_kill is not None:
                before_kill(resume_epoch)
            killed_at = time.time()
            os.kill(pids[-1], signal.SIGKILL)
        finally:
            for pid in pids[:-1]:
                os.kill(pid, signal.SIGCONT)
        return future.result(timeout=600), Kill(killed_at, resume_epoch)


# Tampering (test_security).
class CreatesAFile:
    """Unpickling this creates ``path``: the proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


# A finished fit to register (test_registry, test_security): of tests/registry_code.py, a plain user of the API.
REGISTRY_CODE = "tests.registry_code:training"


def fit_for_registry(
    client: MlflowClient, workdir: Path, config: TrainingConfig, dataset: None, key: str, test_accuracy: float
) -> FitResult:
    """A finished fit of ``REGISTRY_CODE``: an MLflow run, and a best checkpoint pinned in it as distributed-fit
    pins one, whose model scores ``test_accuracy`` (the code's ``evaluate`` reads it back from the model)."""
    assert config.train_code == REGISTRY_CODE and dataset is None, "fit_for_registry makes fits of REGISTRY_CODE"
    from raytrain_driver.fit_record import FitResult
    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.tracking import runs as tracking
    from raytrain_tasks.tracking.names import pin_tag
    from tests.registry_code import write_checkpoint

    # As the fit makes it: a SQLite store keeps its artifacts beside its database, never in the working directory
    # (a bare create_experiment put them under ./mlruns: the checkout, when the suite runs there).
    experiment_id = tracking.ensure_experiment(
        client, config.experiment_name, config.mlflow_tracking_uri, config.storage_path
    )
    run_id = client.create_run(experiment_id, run_name=key, tags={"prefect_raytrain.run_key": key}).info.run_id
    features = int(config.train_config.get("features", 4))
    checkpoint = write_checkpoint(workdir / key / "epoch-0001", features, test_accuracy)
    # What distributed-fit leaves in MLflow: the digest of each checkpoint it committed.
    client.set_tag(run_id, pin_tag(checkpoint.name), local_folder_digest(checkpoint))
    client.set_terminated(run_id)
    return FitResult(
        run_key=key,
        run_uri=str(workdir / key),
        mlflow_run_id=run_id,
        mlflow_experiment_id=str(experiment_id),
        backend="gloo",
        epochs_completed=1,
        best_epoch=1,
        best_checkpoint_uri=str(checkpoint),
        best_metrics={"val_accuracy": test_accuracy},
        final_metrics={"val_accuracy": test_accuracy},
        history=[],
        reopened_mlflow_run=False,
        scores={"val_accuracy": test_accuracy, "test_accuracy": test_accuracy},
    )


def register_for_test(config: TrainingConfig, dataset: Any, fit: FitResult) -> Any:
    """Run register-model in a flow, as the pipeline does: its ModelRef, or the exception it failed with."""
    from prefect import flow

    from tasks.register import register_model

    @flow(name="register-only")
    def register_only() -> Any:
        state = register_model(config, dataset, fit, return_state=True)
        return {"failed": state.is_failed(), "result": state.result(raise_on_failure=False)}

    outcome = register_only()
    assert outcome["failed"] == isinstance(outcome["result"], BaseException)
    return outcome["result"]


# Clusters of their own (`ray start`), from test_cluster; test_two_nodes uses them too.
# Ray rewrites 127.0.0.1 in an address to the machine's own IP unless told to stay on loopback, where this
# test's cluster listens. Clusters use token auth by default: a client must say so (the token is the
# machine's ~/.ray/auth_token, shared by the head here).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


# A node's image has its Python first on PATH: a Ray Job's `python` entrypoint is that one.
NODE_PATH = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


NO_PREFECT = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class _NoPrefect(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "prefect" or name.startswith("prefect."):
                raise ModuleNotFoundError(f"No module named {name!r} (this test's Ray node has no Prefect)", name=name)


    sys.meta_path.insert(0, _NoPrefect())
    """
)


RAY = str(Path(sys.executable).with_name("ray"))


CLIENT_ENV = {**LOOPBACK_ENV, "RAY_AUTH_MODE": "token"}


# `ray start --block` does not exit within 20 s of a SIGTERM (measured: every head's teardown took 20 s, the
# wait, then a SIGKILL of its process group). The cluster is thrown away with its temp dir either way, and
# nothing is asserted on its teardown: its process group is killed at once.


@dataclass(frozen=True)
class ExternalCluster:
    address: str
    dashboard_url: str
    temp_dir: Path


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter in the checkout, with what a cluster client needs in its environment."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, **CLIENT_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextmanager
def head_node(env: dict[str, str] | None = None, num_cpus: int = 2) -> Iterator[ExternalCluster]:
    """`ray start --head --block` on free 127.0.0.1 ports with its own temp dir; only its processes are stopped.

    ``env``: what differs in the node's environment from this process's (a node has its own credentials)."""
    # The cluster and its clients share the machine's token (~/.ray/auth_token). `ray start` does not create it,
    # a first `ray.init()` does: without this, a fresh machine's first cluster test depends on a local-Ray test
    # having run before it (seen with `-m "not slow"`: AuthenticationError, no token found).
    subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=60)
    ports = free_ports(9)
    # Short: Ray's socket paths live under the temp dir and must stay under the OS's 107-byte limit.
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-prt-"))
    command = [RAY, "start", "--head", "--block", "--disable-usage-stats", "--num-cpus", str(num_cpus)]
    command += ["--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1", "--temp-dir", str(temp_dir)]
    for flag, port in zip(
        [
            "--port",
            "--dashboard-port",
            "--ray-client-server-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
            "--node-manager-port",
            "--object-manager-port",
        ],
        ports,
        strict=True,
    ):
        command += [flag, str(port)]
    # The node's image has no Prefect (the project asks for none on a cluster: a fit's Ray Job runs the driver
    # package, which does not import it): every Python process of the node fails to import it.
    without_prefect = temp_dir / "without-prefect"
    without_prefect.mkdir()
    (without_prefect / "sitecustomize.py").write_text(NO_PREFECT)
    node_path = os.pathsep.join(filter(None, [str(without_prefect), os.environ.get("PYTHONPATH", "")]))
    log_path = temp_dir / "ray-start.log"
    with log_path.open("w") as log:
        head = subprocess.Popen(
            command,
            env={**os.environ, **LOOPBACK_ENV, **NODE_PATH, "PYTHONPATH": node_path, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    dashboard_url = f"http://127.0.0.1:{ports[1]}"
    try:
        wait_for_http(dashboard_url, head, log_path, timeout=180)
        yield ExternalCluster(f"127.0.0.1:{ports[0]}", dashboard_url, temp_dir)
    finally:
        # The head's process group holds this cluster's processes (not the session's local Ray): `ray stop`
        # would stop every Ray on the machine.
        stop_process_group(head, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def fit_context(config: TrainingConfig, run_key: str, **parts: Any) -> Any:
    """The FitContext a fit of ``config`` makes for ``run_key`` (raytrain_driver.fit): its code resolved, an MLflow
    client of its store; ``parts`` (dataset, spec, client, lease, origin) replace those."""
    from mlflow import MlflowClient

    from raytrain_driver.fit_context import FitContext
    from raytrain_driver.preflight import resolve_code
    from raytrain_tasks.storage.locations import RUNS_DIR, locate

    runs = locate(config.storage_path, config.storage_options).child(RUNS_DIR)
    made = {"dataset": None, "origin": {"run_name": run_key}, "lease": None}
    made |= {
        "spec": parts.get("spec") or resolve_code(config),
        "client": parts.get("client") or MlflowClient(config.mlflow_tracking_uri),
    }
    return FitContext(config=config, run_key=run_key, runs=runs, **(made | parts))


def prepared_for(config: TrainingConfig) -> tuple[TrainingConfig, Any]:
    """``config`` and what prepare-data stores for it, as the fit task is handed both."""
    from raytrain_driver.preflight import resolve_code
    from raytrain_driver.user_data import prepare_user_data

    return config, prepare_user_data(config, resolve_code(config))


def table_dataset(data: Any, options: Any = None) -> DatasetRef:
    """The table a run of the table classifier trained on, as the built-in classifier's runs give it: the
    prepared version's ``dataset.json`` (read from this node's copy of it), or ``data`` itself when it is one."""
    from raytrain_tasks.prepared import PreparedData, local_data_dir
    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.table_classifier.data import MANIFEST_NAME, DatasetRef

    if not isinstance(data, PreparedData):
        return data  # type: ignore[no-any-return]
    folder = local_data_dir(data, options or StorageOptions())
    stored = DatasetRef.model_validate_json((folder / MANIFEST_NAME).read_text())
    return stored.model_copy(update={"uri": folder.as_posix()})
