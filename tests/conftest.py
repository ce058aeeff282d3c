"""Shared fixtures: real local Ray, the Prefect test harness, MLflow on SQLite files, small real configs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

# Before Prefect is imported anywhere: a private Prefect home, and no telemetry from an offline machine.
# Processes this one starts (Ray workers that import test modules, subprocesses) inherit the same home instead
# of making their own, which nothing would remove.
_PREFECT_HOME = os.environ.get("PRT_TESTS_PREFECT_HOME") or tempfile.mkdtemp(prefix="prt-prefect-home-")
os.environ["PRT_TESTS_PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_HOME"] = _PREFECT_HOME
from raytrain_tasks.environment import apply_process_defaults  # noqa: E402

apply_process_defaults()  # the suite is an entry point too: it calls the driver without the flow package
os.environ.pop("MLFLOW_TRACKING_URI", None)
# Test-only credentials of the local S3 server, set before Ray starts so its workers inherit them.
from devtools.s3_server import ADMIN, LocalS3  # noqa: E402

os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = ADMIN
os.environ["AWS_REGION"] = "us-east-1"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
for _name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_S3_ENDPOINT_URL"):
    os.environ.pop(_name, None)
os.environ.pop("PREFECT_API_URL", None)
# A suite started in the background by a non-interactive shell (`make test &`, a CI script's `cmd &`) has SIGINT
# ignored (POSIX), and every command it starts inherits that: the tests that Ctrl-C a command (test_signals,
# test_cluster's re-attached Ray Job) then saw it train on to the end. The commands get a terminal's Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from tests.helpers import (  # noqa: E402
    _MLFLOW_TEMPLATE,
    RAY,
    MlflowServer,
    free_port,
    start_mlflow_server,
    stop_process_group,
)


def pytest_configure(config: pytest.Config) -> None:
    """The machine's Ray token (~/.ray/auth_token), made once before the xdist workers start: each worker's first
    local Ray writes one when there is none, and on a fresh machine two at once would leave the file holding
    one worker's token while the other's Ray checks another (every client of that Ray then fails)."""
    if hasattr(config, "workerinput") or (Path.home() / ".ray" / "auth_token").is_file():
        return
    subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True, timeout=120)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what this tier does not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the xdist processes of a tier: the modules whose selected tests took longest (their rows in
    bench/results/suite_cpu.tsv) first, each module's tests in file order. `--dist loadscope
    --no-loadscope-reorder` (the Makefile) hands out whole modules in this order, so the long ones start at once
    and the two processes end together, instead of one running the last long module alone. A serial run keeps
    file order."""
    if not hasattr(config, "workerinput"):
        return
    profile = Path(__file__).parent.parent / "bench" / "results" / "suite_cpu.tsv"
    rows = profile.read_text().splitlines()[1:] if profile.is_file() else []
    wall = {test: float(seconds) for test, _, seconds, *_ in (row.split("\t") for row in rows)}
    cost: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        cost[module] = cost.get(module, 0.0) + wall.get(item.nodeid, 0.0)
    items.sort(key=lambda item: -cost[item.nodeid.split("::", 1)[0]])


def _left_running() -> list[psutil.Process]:
    """Processes other than this one that inherited this session's Prefect home: what the tests started (Ray,
    servers, commands) and did not stop, wherever they were reparented to."""
    left = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get("PRT_TESTS_PREFECT_HOME") == _PREFECT_HOME:
                left.append(process)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return left


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """As MLflow's conftest does: name what the tests left running (a test that starts a process stops it).
    Processes a shutdown is still ending get a few seconds first."""
    if hasattr(terminalreporter.config, "workerinput"):
        return
    _, left = psutil.wait_procs(_left_running(), timeout=5)
    left = [process for process in left if process.is_running()]
    if not left:
        return
    terminalreporter.section("processes the tests left running")
    for process in left:
        try:
            terminalreporter.write_line(f"pid {process.pid}: {' '.join(process.cmdline())[:160]}")
        except psutil.Error:
            continue


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller, once every xdist worker (sharing it) is done
        shutil.rmtree(_PREFECT_HOME, ignore_errors=True)
    if _MLFLOW_TEMPLATE:
        shutil.rmtree(_MLFLOW_TEMPLATE[0].parent, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict[str, float]]:
    """One local Ray for the whole session (2 CPUs, as on CI); the pipeline uses it and leaves it running."""
    import ray

    from raytrain_driver.cluster import start_local_ray

    start_local_ray(num_cpus=2)
    try:
        yield ray.cluster_resources()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalS3]:
    """A real S3-compatible server (SeaweedFS) on a free 127.0.0.1 port for the session."""
    server = LocalS3(tmp_path_factory.mktemp("s3")).start()
    try:
        yield server
    finally:
        server.stop()


MLFLOW_URI_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")


@pytest.fixture(autouse=True)
def _mlflow_uris_as_found() -> Iterator[None]:
    """Each test leaves MLflow's process-wide URIs as it found them. ``mlflow.set_tracking_uri`` (the fluent API a
    test may use to load a model) keeps its URI in a module global and exports it to the environment; a client
    opened later without a registry URI (``MlflowClient(uri)``) resolves its registry from them, and registered
    into another test's server."""
    import sys

    env = {name: os.environ.get(name) for name in MLFLOW_URI_ENV}
    yield
    if "mlflow" not in sys.modules:
        return
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    tracking_utils._tracking_uri = None
    registry_utils._registry_uri = None
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _the_zombie_watch_loads_at_once(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run or `serve` that creates or changes the zombie watch waits WATCH_LOAD_SECONDS (8 s) for the server to
    load it before it re-arms the watched runs: only the end-to-end and chaos tests depend on that wait; the others
    skip it."""
    if request.node.get_closest_marker("slow") is None and request.node.get_closest_marker("chaos") is None:
        from flows import continuation

        monkeypatch.setattr(continuation, "WATCH_LOAD_SECONDS", 0)


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """A real, temporary Prefect API (SQLite) for flows and tasks run in this session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """`mlflow server` with a SQLite backend and a local artifact root, on a free port, shared by the session
    (starting one takes ~6 s here): each test uses experiment and model names of its own. Tests that stop or
    restart their server (an outage) start their own."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    server = start_mlflow_server(root, port)
    try:
        yield MlflowServer(f"http://127.0.0.1:{port}", artifacts=root / "artifacts")
    finally:
        # The server runs its web workers as children in its own session: stop the whole group we started.
        stop_process_group(server)
