"""Helpers the tests share: configs shrunk for a 2-core machine, free ports, server launchers, process groups.

Fixtures live in conftest.py (pytest finds them there); everything a test imports lives here. conftest.py sets
the test process's environment (a private Prefect home, the local S3 server's credentials) before any of this
is imported.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from raytrain_tasks.config import TrainingConfig

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


def this_ray_address() -> str:
    """The GCS address of the Ray this process is connected to, for Ray's State API (``list_actors`` and the
    like). Without one, the State API follows RAY_ADDRESS or /tmp/ray/ray_current_cluster, which any earlier
    `ray start` cluster on the machine may have left pointing at a dead cluster."""
    import ray

    return str(ray.get_runtime_context().gcs_address)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    return TrainingConfig(**values)


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

    ``lose_replies(True)``: requests still reach the server, its replies never reach the client (the connection is
    cut when one comes), as when a network fails after the server acted.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._replies_lost = False

    def lose_replies(self, lost: bool) -> None:
        """From now on, lose (or again forward) the server's replies; connections already open are cut."""
        with self._lock:
            self._replies_lost, cut, self._open = lost, self._open, []
        for sock in cut:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

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
                replies_lost = self._replies_lost
            for source, sink in ((client, upstream), (upstream, client)):
                lose = replies_lost and source is upstream
                threading.Thread(target=self._pump, args=(source, sink, lose), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, lose: bool = False) -> None:
        """Forward one direction until either side ends (``lose``: until a reply other than an interim ``100
        Continue``, which is dropped); then end both, and close the side read from."""
        try:
            while data := source.recv(65536):
                if lose and not data.startswith(b"HTTP/1.1 100 "):  # an interim 100 Continue still goes through
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
