"""Connecting to Ray: a local one by default, a cluster by address; checked before any worker starts."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from raytrain_driver.process_groups import ray_groups_stopped, ray_processes_in_their_own_group
from raytrain_driver.ray_token import TOKEN_REFUSED, check_token_accepted
from raytrain_tasks.environment import PROCESS_DEFAULTS
from raytrain_tasks.errors import ClusterError

# Far faster than Ray's 2 s default. The controller takes one report per worker each time it polls, and a worker
# waits in report() until its previous report was taken: epochs shorter than the interval are held to one per
# poll, and the wait shows as checkpoint time at every epoch boundary. Measured here (8 epochs of ~0.3 s, 2
# workers, `make bench`'s flow job): 2 s, 36 s of fit for 8 epochs of ~0.5 s; 0.5 s, 0.19-0.24 s per epoch
# boundary from the fourth epoch on and 31.7 s of CLI wall time; 0.2 s, 0.007-0.010 s; 0.1 s, 0.007 s and
# 26.0 s. A poll is one small actor call per worker (ten a second per worker),
# and a slow answer is not a failure (Ray waits on it for 10 minutes). RAY_TRAIN_HEALTH_CHECK_INTERVAL_S set
# in the environment wins (a cluster of hundreds of workers may want it longer).
HEALTH_CHECK_INTERVAL_S = "0.1"
# "0": the Ray processes' output stays in Ray's session logs, not copied to this process's console (the CLI's
# default console; --verbose and every deployment run keep Ray's default, "1").
LOG_TO_DRIVER_ENV = "PREFECT_RAYTRAIN_LOG_TO_DRIVER"
WORKER_GROUP_START_TIMEOUT_S = "60"
# Set by `python -m deployments.serve` for the runs it starts: the address of the local Ray it keeps warm. A run
# whose `ray_address` is empty joins it instead of starting (and stopping) a Ray of its own.
WARM_RAY_ENV = "PREFECT_RAYTRAIN_WARM_RAY"


def worker_env(local: bool = True) -> dict[str, str]:
    """Environment every Ray process of the run needs (controller and workers); ``local``: a Ray of one node
    that this process starts."""
    env = {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get(
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", HEALTH_CHECK_INTERVAL_S
        ),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": os.environ.get(
            "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", WORKER_GROUP_START_TIMEOUT_S
        ),
        "PYTHONUNBUFFERED": "1",
        # A cluster's processes do not inherit this process's defaults (raytrain_tasks.environment).
        "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS": os.environ.get(
            "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", PROCESS_DEFAULTS["RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"]
        ),
    }
    if local:
        # Ray Train's PreemptionWatcher actor follows nodes that a cloud autoscaler drains (spot instances).
        # A local Ray has none: one process (~2 s of CPU to start, ~190 MiB) less per run.
        env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    return env


# Forwarded to a cluster's Ray processes when set here: where S3 storage (pyarrow, boto3) and MLflow (the
# controller logs epochs; artifacts may go to S3) are, nothing secret. A local Ray inherits everything from
# this process.
FORWARDED_ENV = (
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_EC2_METADATA_DISABLED",
    "MLFLOW_S3_ENDPOINT_URL",
    "MLFLOW_TRACKING_INSECURE_TLS",
)
# Credentials: Ray stores a job's runtime_env in its GCS job table and the dashboard's job API returns it, so
# they are forwarded only with `forward_credentials_to_cluster`. Otherwise the nodes use their own (instance or
# pod role, their own environment), which also renew themselves where a copied session token would expire.
CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)


class RaySettings(Protocol):
    """What joining or starting Ray reads of a run's settings: a training run's (TrainingConfig) or a scoring
    run's (raytrain_tasks.scoring.config.ScoringConfig)."""

    @property
    def ray_address(self) -> str: ...
    @property
    def ray_connect_timeout_s(self) -> float: ...
    @property
    def forward_credentials_to_cluster(self) -> bool: ...
    @property
    def train_code(self) -> str: ...


def cluster_runtime_env(config: RaySettings) -> dict[str, object]:
    """What a cluster this driver connects to needs: our worker code and the environment it reads."""
    import raytrain_tasks

    env = worker_env(local=False)
    forwarded = FORWARDED_ENV + (CREDENTIAL_ENV if config.forward_credentials_to_cluster else ())
    env.update({name: os.environ[name] for name in forwarded if os.environ.get(name)})
    # Only raytrain_tasks runs on the cluster (train loop, ingest, the controller's MLflow callback); its
    # third-party imports (torch, ray[train,data], mlflow, pyarrow) must be installed in the cluster's image.
    modules: list[object] = [raytrain_tasks]
    if config.train_code:  # the user's own code reaches the workers the same way (docs/own-model.md)
        from raytrain_tasks.user_code import resolve, shipped_module

        resolve(config.train_code)  # a clear error here, not a failed runtime_env upload
        shipped = shipped_module(config.train_code)
        if shipped is not None:
            modules.append(shipped)
    return {"py_modules": modules, "env_vars": env}


@contextmanager
def ray_session(config: RaySettings) -> Iterator[None]:
    """Yield with Ray initialised by this call, or as the caller already had it.

    A Ray the caller initialised is left alone. A local Ray this call started is stopped on exit. A cluster
    reached by `ray_address` is never shut down or disconnected: the next run of this process reuses the
    connection (a Prefect worker or serve process trains many runs).
    """
    import ray

    if ray.is_initialized():
        _check_same_cluster(config)
        yield
        return
    warm = "" if config.ray_address else _warm_ray_address()
    if config.ray_address:
        check_reachable(config.ray_address)
        check_token_accepted(config.ray_address)
    try:
        with _sigterm_stays_with_the_orchestrator(), ray_processes_in_their_own_group():
            _init(config, warm)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if warm:
            raise ClusterError(
                f"cannot join the warm Ray at {warm!r} that deployments.serve keeps for its runs ({WARM_RAY_ENV}): "
                f"{exc}. Restart `make serve`, or serve with --no-warm-ray to give each run its own local Ray"
            ) from exc
        where = f"at {config.ray_address!r}" if config.ray_address else "locally"
        if "AuthToken" in repr(exc.__cause__) or "AuthenticationError" in type(exc.__cause__).__name__:
            raise ClusterError(TOKEN_REFUSED.format(address=config.ray_address or where)) from exc
        raise ClusterError(
            f"cannot start or reach Ray {where}: {exc}; check `ray_address` (empty starts a local Ray)"
        ) from exc
    if warm:
        from raytrain_driver.hooks import run_logger

        run_logger().info("training on the warm local Ray at %s (kept by deployments.serve)", warm)
    if config.ray_address or warm:
        yield
        return
    try:
        yield
    finally:
        shutdown_ray()


def _init(config: RaySettings, warm: str = "") -> None:
    """``warm``: the address of the local Ray that deployments.serve keeps, joined instead of starting one."""
    import ray

    if warm or config.ray_address:
        init_within(
            config.ray_connect_timeout_s,
            address=warm or config.ray_address,
            # The warm Ray is this machine's, started by serve: its processes have this environment and code.
            runtime_env={"env_vars": worker_env()} if warm else cluster_runtime_env(config),
            logging_level=logging.WARNING,
            log_to_driver=_log_to_driver(),
        )
        if warm:
            _STARTED_HERE.add(ray.get_runtime_context().gcs_address)
    else:
        # address="local" always starts a fresh cluster, never joins one left by `ray start`. The
        # dashboard stays on: Ray Train's placement-group cleaner polls the State API it serves, and
        # warns every second without it.
        start_local_ray(log_to_driver=_log_to_driver())


# The GCS addresses of the Rays this process started on this machine (start_local_ray), or joined as the warm Ray
# deployments.serve started here: their workers run this interpreter, on this machine, with this environment.
_STARTED_HERE: set[str] = set()


def start_local_ray(num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    """``ray.init`` of a fresh local Ray (``address="local"`` never joins one left by `ray start`), with the
    environment every Ray process of a run needs; remembered as this machine's (``ray_of_this_machine``)."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        runtime_env={"env_vars": worker_env()},
        logging_level=logging.WARNING,
        log_to_driver=log_to_driver,
    )
    _STARTED_HERE.add(ray.get_runtime_context().gcs_address)


def ray_of_this_machine() -> bool:
    """Whether the Ray this process is connected to is one it started here, or the warm Ray serve started here.
    False for a cluster by address and for a Ray the caller connected by itself, wherever that is."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().gcs_address in _STARTED_HERE


def _warm_ray_address() -> str:
    """The local Ray that `deployments.serve` keeps warm for the runs it starts, or "": none, or gone.

    A warm Ray that no longer answers (its serve process died, leaving this run behind) is not a reason to fail
    a run that asked for a local Ray: it gets its own, as without serve, and says so.
    """
    from raytrain_driver.hooks import run_logger

    address = os.environ.get(WARM_RAY_ENV, "")
    if not address:
        return ""
    try:
        check_reachable(address, timeout_s=1.0)
    except ClusterError as exc:
        run_logger().warning(
            "the warm Ray at %s (%s, set by deployments.serve) does not answer: %s. Starting a local Ray for "
            "this run instead",
            address,
            WARM_RAY_ENV,
            exc,
        )
        return ""
    return address


@contextmanager
def warm_ray() -> Iterator[str]:
    """A local Ray for the runs of this process's children, for the block; yields its address.

    The runs find it through WARM_RAY_ENV (set here) and connect as drivers of their own: they pay neither Ray's
    start nor its stop. Its processes are children of this one and end with it (``ray.shutdown()`` on exit).
    """
    import ray

    with _sigterm_stays_with_the_orchestrator(), ray_processes_in_their_own_group():
        start_local_ray()
    try:
        address = ray.get_runtime_context().gcs_address
        os.environ[WARM_RAY_ENV] = address
        # A local Ray takes tokens (Ray >= 2.52); the machine's token file is shared, the mode must be said.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        yield address
    finally:
        os.environ.pop(WARM_RAY_ENV, None)
        shutdown_ray()


def shutdown_ray() -> None:
    """``ray.shutdown()``, with this process's SIGTERM handler in force after it.

    Ray 2.60's driver shutdown uninstalls its C++ failure-signal handler by setting SIGTERM (and SIGSEGV, SIGABRT,
    ...) back to the default action at the C level (``RayLog::UninstallSignalAction``), under Python's handler,
    which ``signal.getsignal`` still reports: a later SIGTERM (a Prefect cancellation of a served run, a second
    signal) then killed the process at once, with nothing marked or logged. Installing the handler again from the
    main thread puts Python's back.
    """
    import ray

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.shutdown()
    finally:
        ray_groups_stopped()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _log_to_driver() -> bool:
    return os.environ.get(LOG_TO_DRIVER_ENV, "1") != "0"


@contextmanager
def _sigterm_stays_with_the_orchestrator() -> Iterator[None]:
    """Put this process's SIGTERM handler back after ``ray.init()``.

    A Prefect cancellation reaches the flow-run process as a SIGTERM, which Prefect's handler turns into a
    TerminationSignal (the run ends Cancelled, the fit marks its MLflow run KILLED). ``ray.init()`` replaces that
    handler with one calling ``sys.exit``, and its C++ core installs abseil's failure-signal handler, which aborts
    the process 3 s after a SIGTERM (ray#64830): the run ended with exit code -6 and its MLflow run stayed
    RUNNING. Installing the previous handler again (from the main thread, where Python handlers live) replaces
    both; Ray still stops with the process (``ray_session`` shuts a local Ray down, atexit otherwise).
    """
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def init_within(timeout_s: float, **init_args: Any) -> None:
    """``ray.init(**init_args)``, or ClusterError after ``timeout_s``.

    Something that accepts TCP on the address but never completes Ray's handshake (not a Ray GCS port, or a
    cluster that advertises an address this machine cannot reach) keeps ray.init() waiting inside Ray's GCS
    client for minutes, without a message (seen: over 4 minutes). The call runs in a daemon thread, so the
    caller gets its answer in time; a connection given up on is left to that thread and ends with the process.
    """
    import ray

    finished = threading.Event()
    failure: list[BaseException] = []

    def connect() -> None:
        try:
            ray.init(**init_args)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread, which raises it
            failure.append(exc)
        finally:
            finished.set()

    def quiet(record: logging.LogRecord) -> bool:  # by design: the orchestrator's handler stays (see above)
        return not str(record.msg).startswith("SIGTERM handler is not set")

    ray_worker_logger = logging.getLogger("ray._private.worker")
    ray_worker_logger.addFilter(quiet)
    threading.Thread(target=connect, name="ray-connect", daemon=True).start()
    try:
        connected = finished.wait(timeout_s)
    finally:
        ray_worker_logger.removeFilter(quiet)
    if not connected:
        raise ClusterError(
            f"ray.init() did not connect to {init_args.get('address')!r} within {timeout_s:g} s: something accepts "
            "connections there but does not complete Ray's handshake (not the head's GCS port, 6379 by default, or a "
            "cluster advertising an address this machine cannot reach). Check `ray_address`, or raise "
            "`ray_connect_timeout_s` for a slow cluster"
        )
    if failure:
        raise failure[0]


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds on an address nothing listens at: ray.init() would retry for minutes."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(
            f"ray_address {address!r} is not host:port or ray://host:port; set `ray_address` (empty starts a local Ray)"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster answers at {address!r} ({exc}); check `ray_address` and that the head node is "
            "up (`ray status --address ...`), or leave `ray_address` empty to start a local Ray"
        ) from exc


def _check_same_cluster(config: RaySettings) -> None:
    """A process connected to one cluster cannot train a run meant for another."""
    import ray

    if not config.ray_address or config.ray_address.startswith("ray://"):
        return
    connected = ray.get_runtime_context().gcs_address
    if _normalise(connected) != _normalise(config.ray_address):
        raise ClusterError(
            f"this process is already connected to the Ray cluster at {connected}; `ray_address` asks for "
            f"{config.ray_address!r}. Run it from a fresh process, or set `ray_address` to {connected!r}"
        )


def _normalise(address: str) -> str:
    host, _, port = address.rpartition(":")
    return f"{'127.0.0.1' if host in ('localhost', '0.0.0.0') else host}:{port}"
