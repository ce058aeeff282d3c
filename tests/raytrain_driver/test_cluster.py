"""Training on a Ray cluster reached by address: a separate `ray start --head` cluster on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from raytrain_driver.cluster import check_reachable
from raytrain_driver.sizing import storage_shared_with_nodes
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import ClusterError
from tests.helpers import (
    CLIENT_ENV,
    LOOPBACK_ENV,
    REPO_ROOT,
    ExternalCluster,
    free_port,
    head_node,
    run_python,
    seed_mlflow_store,
)


@pytest.fixture(scope="module")
def external_cluster(s3_server: Any) -> Iterator[ExternalCluster]:
    """The module's cluster. Its node has credentials of its own for the test run's S3 server, read-only ones (a
    node has its own; the runs here keep their storage in folders, except the one about the node's access)."""
    from devtools.s3_server import READER

    with head_node(env={"AWS_ACCESS_KEY_ID": READER[0], "AWS_SECRET_ACCESS_KEY": READER[1]}) as cluster:
        yield cluster


# In the driver's environment only; the run's storage is a directory and MLflow a SQLite file, so nothing needs them.
DRIVER_SECRETS = {
    "AWS_ACCESS_KEY_ID": "AKIAPRTDRIVERONLY0001",
    "AWS_SECRET_ACCESS_KEY": "prt-secret-key-never-in-ray-0001",
    "AWS_SESSION_TOKEN": "prt-session-token-never-in-ray-0001",
    "MLFLOW_TRACKING_TOKEN": "prt-mlflow-token-never-in-ray-0001",
    "MLFLOW_TRACKING_PASSWORD": "prt-mlflow-password-never-in-ray-0001",
}
NOT_SECRET = "prt-region-marker-1"


def dashboard_answers(cluster: ExternalCluster, paths: list[str]) -> dict[str, str]:
    """The raw bodies the dashboard serves at ``paths`` (with the cluster's token, as its users would)."""
    code = textwrap.dedent(
        f"""
        import json
        from ray.job_submission import JobSubmissionClient
        client = JobSubmissionClient("{cluster.dashboard_url}")
        answers = {{}}
        for path in {paths!r}:
            response = client._do_request("GET", path)
            assert response.status_code == 200, (path, response.status_code, response.text[:500])
            answers[path] = response.text
        print("ANSWERS" + json.dumps(answers))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **CLIENT_ENV}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.split("ANSWERS", 1)[1]))


def train_workers(cluster: ExternalCluster) -> dict[str, str]:
    """actor id -> state of every Ray Train worker the cluster has had."""
    probe = textwrap.dedent(
        f"""
        import json
        from ray.util.state import list_actors
        workers = list_actors(
            address="{cluster.address}", filters=[("class_name", "=", "RayTrainWorker")], limit=10_000
        )
        print("WORKERS" + json.dumps({{w.actor_id: w.state for w in workers}}))
        """
    )
    seen = run_python(probe)
    assert seen.returncode == 0, seen.stderr[-3000:]
    return dict(json.loads(seen.stdout.split("WORKERS", 1)[1]))


@dataclass(frozen=True)
class OwnCodeRun:
    done: subprocess.CompletedProcess[str]
    tracking_uri: str


def train_own_code(
    cluster: ExternalCluster, folder: Path, launch_mode: str, env: dict[str, str] | None = None
) -> OwnCodeRun:
    """`prefect-raytrain train` with the user's package in a project folder of its own (a copy of
    examples/seed_ddp), outside the checkout as a Prefect worker's folder would be, with `ray_address` set."""
    from prefect.settings import PREFECT_API_URL

    project = folder / "project"
    shutil.copytree(
        REPO_ROOT / "examples" / "seed_ddp", project / "my_model", ignore=shutil.ignore_patterns("__pycache__")
    )
    tracking_uri = f"sqlite:///{seed_mlflow_store(folder / 'mlflow.db')}"
    command = [str(Path(sys.executable).with_name("prefect-raytrain")), "train", "--ray-address", cluster.address]
    command += ["--train-code", "my_model.train:training", "--train-config", '{"hidden": 24}']
    command += ["--storage-path", str(folder / "storage"), "--mlflow-tracking-uri", tracking_uri]
    # The digits reach 0.89 in 2 epochs at this step size (0.76 at the default).
    command += ["--epochs", "2", "--num-workers", "2", "--learning-rate", "0.01"]
    command += ["--experiment-name", "cluster-own-code", "--model-name", "cluster-own-code"]
    if launch_mode == "ray_job":
        command += ["--launch-mode", "ray_job", "--ray-dashboard-url", cluster.dashboard_url]
    env = {**os.environ, **CLIENT_ENV, "PREFECT_API_URL": str(PREFECT_API_URL.value()), **(env or {})}
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return OwnCodeRun(done, tracking_uri)


@pytest.fixture(scope="module")
def driver_run(
    external_cluster: ExternalCluster, tmp_path_factory: pytest.TempPathFactory, prefect_api: None
) -> OwnCodeRun:
    """One run on the cluster by address in launch_mode=driver, for the module's tests of what it leaves behind
    and of the user's code shipped to the workers; the driver holds secrets the cluster must never see."""
    # AWS_REGION is forwarded: where things are is not a secret.
    env = {**DRIVER_SECRETS, "AWS_REGION": NOT_SECRET}
    return train_own_code(external_cluster, tmp_path_factory.mktemp("driver-run"), "driver", env)


@pytest.mark.slow
def test_the_pipeline_trains_on_a_cluster_by_address_and_leaves_it_running(
    external_cluster: ExternalCluster, driver_run: OwnCodeRun
) -> None:
    client = MlflowClient(driver_run.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("cluster-own-code").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect_raytrain.ray_cluster"] == external_cluster.address
    assert run.data.metrics["val_accuracy"] > 0.8

    # On that cluster: the run's training workers ran there (the module's first fit on it, in file order), and
    # the cluster is still up for the next run.
    workers = train_workers(external_cluster)
    assert sorted(workers.values()) == ["DEAD", "DEAD"], workers

    # What anyone who reaches the dashboard reads: the job list (with each job's runtime_env) and the runtime
    # envs the agents created. The driver's AWS keys and MLflow token are in none of them.
    answers = dashboard_answers(external_cluster, ["/api/jobs/", "/api/v0/runtime_envs?detail=true&limit=100"])
    assert NOT_SECRET in answers["/api/jobs/"]  # the responses do carry the job's env_vars
    for path, text in answers.items():
        for name, secret in DRIVER_SECRETS.items():
            assert secret not in text, f"{name} is readable at {external_cluster.dashboard_url}{path}"
        print(
            f"\ndashboard {path}: {len(text)} bytes, the forwarded AWS_REGION marker {NOT_SECRET in text}, "
            f"{', '.join(DRIVER_SECRETS)}: none of their values"
        )
    # The driver shipped raytrain_tasks (runtime_env py_modules): the cluster unpacked it for its workers.
    resources = external_cluster.temp_dir / "session_latest" / "runtime_resources"
    shipped = list(resources.glob("py_modules_files/*/raytrain_tasks/trainspec/loop.py"))
    assert shipped, sorted(str(p.relative_to(resources)) for p in resources.rglob("*"))[:50]


@pytest.mark.slow
@pytest.mark.parametrize("launch_mode", ["driver", "ray_job"])
def test_user_code_outside_the_project_reaches_the_clusters_workers_through_runtime_env(
    external_cluster: ExternalCluster, tmp_path: Path, request: pytest.FixtureRequest, launch_mode: str
) -> None:
    """The user's package lives in a project folder of its own (a copy of examples/seed_ddp); the command runs there
    with `ray_address` set. Nothing is copied to the cluster by hand: the driver (or, as a Ray Job, the job's
    runtime_env) ships the package with runtime_env py_modules (the workers are not given the driver's folder),
    and the cluster unpacks it for the job's driver and its workers."""
    if launch_mode == "driver":
        own = request.getfixturevalue("driver_run")
    else:
        request.getfixturevalue("prefect_api")
        own = train_own_code(external_cluster, tmp_path, launch_mode)
    client = MlflowClient(own.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("cluster-own-code").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train_code"] == "my_model.train:training"
    assert run.data.params["train_config.hidden"] == "24"
    assert run.data.tags["prefect_raytrain.ray_cluster"] == external_cluster.address
    assert ("prefect_raytrain.ray_job" in run.data.tags) == (launch_mode == "ray_job"), run.data.tags
    assert client.get_model_version("cluster-own-code", "1").run_id == run.info.run_id  # registered from it
    resources = external_cluster.temp_dir / "session_latest" / "runtime_resources"
    assert list(resources.glob("py_modules_files/*/my_model/train.py")), sorted(
        str(p.relative_to(resources)) for p in resources.rglob("*")
    )[:50]
    if launch_mode == "ray_job":  # the job ran the driver package, on a node without Prefect, and nothing above it
        assert list(resources.glob("py_modules_files/*/raytrain_driver/fit_job.py"))
        assert not list(resources.glob("py_modules_files/*/tasks/*.py"))


@pytest.mark.slow
def test_a_package_the_clusters_nodes_lack_is_named_before_any_training_worker_starts(
    external_cluster: ExternalCluster, tmp_path: Path, prefect_api: None
) -> None:
    """The user's module imports a package this machine has and the cluster's nodes lack (Prefect: this test's
    nodes have none). The driver imports it fine; the import tried in a Ray task on the cluster names the package
    and `train_code`, and the run fails there: no MLflow run is opened, no training worker is started."""
    from prefect.settings import PREFECT_API_URL

    project = tmp_path / "project"
    shutil.copytree(
        REPO_ROOT / "examples" / "seed_ddp", project / "my_model", ignore=shutil.ignore_patterns("__pycache__")
    )
    train = project / "my_model" / "train.py"
    source = train.read_text().replace(
        "from __future__ import annotations\n",
        "from __future__ import annotations\n\nimport prefect  # installed here, not on the cluster's nodes\n",
        1,
    )
    assert "import prefect" in source
    train.write_text(source)
    tracking_uri = f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}"
    command = [str(Path(sys.executable).with_name("prefect-raytrain")), "train", "--ray-address"]
    command += [external_cluster.address, "--train-code", "my_model.train:training", "--epochs", "1"]
    command += ["--storage-path", str(tmp_path / "storage"), "--mlflow-tracking-uri", tracking_uri]
    command += ["--experiment-name", "lacking", "--model-name", "lacking"]
    env = {**os.environ, **CLIENT_ENV, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode != 0, said[-4000:]
    assert "'my_model.train:training'" in said and "on a Ray worker of the cluster" in said, said[-4000:]
    assert "No module named 'prefect'" in said, said[-4000:]
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("lacking")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
    assert not list((tmp_path / "storage").glob("runs/*/checkpoint_*"))  # what seed_ddp's reports are named
    assert not list((tmp_path / "storage").glob("runs/*/checkpoint_manager_snapshot.json"))


@pytest.mark.slow
def test_connecting_never_shuts_the_cluster_down(external_cluster: ExternalCluster) -> None:
    code = textwrap.dedent(
        f"""
        import ray
        from raytrain_tasks.config import TrainingConfig
        from raytrain_driver.cluster import ray_of_this_machine, ray_session
        config = TrainingConfig(ray_address="{external_cluster.address}")
        with ray_session(config):
            first = ray.get_runtime_context().get_job_id()
            assert not ray_of_this_machine(), "a cluster's workers must get the import check of train_code"
        assert ray.is_initialized(), "disconnected from a cluster it did not start"
        with ray_session(config):  # the next run of this process reuses the connection
            assert ray.get_runtime_context().get_job_id() == first
        # A Ray this process connected by itself, wherever it is, is checked like a cluster too.
        with ray_session(TrainingConfig()):
            assert not ray_of_this_machine()
        print("OK")
        """
    )
    done = run_python(code)
    assert done.stdout.strip().endswith("OK"), done.stdout[-2000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_a_driver_without_the_cluster_token_is_told_how_to_authenticate(external_cluster: ExternalCluster) -> None:
    code = textwrap.dedent(
        f"""
        from raytrain_tasks.config import TrainingConfig
        from raytrain_driver.cluster import ray_session
        with ray_session(TrainingConfig(ray_address="{external_cluster.address}")):
            pass
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | LOOPBACK_ENV
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "ClusterError" in done.stderr and "RAY_AUTH_MODE=token" in done.stderr, done.stderr[-3000:]
    # Refused by the token check before ray.init(), whose GCS client retries for half a minute with warnings.
    assert "gcs_client" not in done.stderr and "ray.init" not in done.stderr, done.stderr[-3000:]


def test_an_unreachable_address_fails_naming_the_setting() -> None:
    # How many seconds it takes is a figure of `python -m bench.waits`.
    with pytest.raises(ClusterError, match="ray_address"):
        check_reachable(f"127.0.0.1:{free_port()}")
    with pytest.raises(ClusterError, match="ray_address"):
        check_reachable("not-an-address")


@pytest.mark.slow
@pytest.mark.chaos
def test_a_warm_ray_gone_with_its_serve_process_leaves_the_run_a_local_ray_of_its_own_and_its_sigterm_handler() -> None:
    # What a run started by `deployments.serve` meets when serve (and its Ray) died after starting it.
    dead = f"127.0.0.1:{free_port()}"
    code = textwrap.dedent(
        f"""
        import logging, os, signal, time
        import ray
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        from raytrain_tasks.config import TrainingConfig
        from raytrain_driver.cluster import WARM_RAY_ENV, ray_session
        def stop(signum, frame):
            raise SystemExit(f"HANDLED {{signum}}")
        signal.signal(signal.SIGTERM, stop)  # as Prefect's engine does for a served or worker's run
        os.environ[WARM_RAY_ENV] = "{dead}"
        with ray_session(TrainingConfig()):
            print("CONNECTED", ray.get_runtime_context().gcs_address)
        print("AFTER", ray.is_initialized(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        """
    )
    done = run_python(code)
    # A SIGTERM after the run's local Ray stopped still reaches the run's handler (Ray's shutdown had put the
    # default action back under it: the process died of the signal, -15, with nothing marked or logged).
    assert done.returncode == 1 and "HANDLED 15" in done.stderr, (done.returncode, done.stderr[-3000:])
    assert re.search(rf"WARNING the warm Ray at {dead} .*does not answer.*Starting a local Ray", done.stderr)
    connected = done.stdout.split("CONNECTED ", 1)[1].split()[0]
    assert connected != dead
    assert "AFTER False" in done.stdout  # the local Ray was the run's own: stopped with it


MOUNTS = """\
/dev/sda1 / ext4 rw 0 0
nfs-server:/export /mnt/shared nfs4 rw 0 0
tmpfs /tmp tmpfs rw 0 0
"""


def test_local_storage_on_a_multi_node_cluster_fails_early() -> None:
    storage_shared_with_nodes("/tmp/storage", node_count=1, mounts=MOUNTS)  # one node: any directory works
    storage_shared_with_nodes("s3://bucket/prefix", node_count=3, mounts=MOUNTS)
    storage_shared_with_nodes("/mnt/shared/runs", node_count=3, mounts=MOUNTS)  # NFS: shared
    with pytest.raises(ClusterError, match="storage_path.*3 nodes.*s3://"):
        storage_shared_with_nodes("/tmp/storage", node_count=3, mounts=MOUNTS)
    with pytest.raises(ClusterError, match="ext4"):
        storage_shared_with_nodes("/home/me/runs", node_count=2, mounts=MOUNTS)


def test_max_workers_makes_the_worker_group_elastic(tmp_path: Path) -> None:
    from raytrain_driver.preflight import resolve_code
    from raytrain_driver.sizing import FitPlan
    from raytrain_driver.trainer import build_trainer
    from tests.helpers import REGISTRY_CODE, fit_context

    code = {"train_code": REGISTRY_CODE, "register": False, "storage_path": str(tmp_path)}
    elastic_config = TrainingConfig(num_workers=2, max_workers=4, cpus_per_worker=0.5, **code)
    fixed_config = TrainingConfig(num_workers=2, cpus_per_worker=1, **code)
    spec = resolve_code(elastic_config)
    elastic = build_trainer(fit_context(elastic_config, "k", spec=spec, client=object()), FitPlan.of(elastic_config))
    fixed = build_trainer(fit_context(fixed_config, "k", spec=spec, client=object()), FitPlan.of(fixed_config))
    assert elastic.scaling_config.num_workers == (2, 4)
    assert fixed.scaling_config.num_workers == 2


def test_credentials_reach_a_cluster_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from raytrain_driver.cluster import cluster_runtime_env

    for name, value in DRIVER_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    default = cluster_runtime_env(TrainingConfig(ray_address="127.0.0.1:6379"))["env_vars"]
    assert isinstance(default, dict) and default["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert not set(DRIVER_SECRETS) & set(default)
    opted_in = cluster_runtime_env(TrainingConfig(ray_address="127.0.0.1:6379", forward_credentials_to_cluster=True))
    assert isinstance(opted_in["env_vars"], dict)
    assert {k: opted_in["env_vars"][k] for k in DRIVER_SECRETS} == DRIVER_SECRETS


@pytest.mark.slow
def test_a_node_that_cannot_write_the_bucket_is_named_before_any_worker_starts(
    external_cluster: ExternalCluster, tmp_path: Path, s3_server: Any, prefect_api: None
) -> None:
    """The driver's credentials write the bucket; the node's own (read-only) ones do not. The run stops in the
    pre-flight, naming the node and the setting, with no MLflow run and no checkpoint folder created."""
    from prefect.settings import PREFECT_API_URL

    from devtools.s3_server import READER

    tracking_uri = f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}"
    command = [sys.executable, "-m", "flows.training", "--ray-address", external_cluster.address, "--epochs", "1"]
    command += ["--storage-path", "s3://prt-nodes/run", "--s3-endpoint-url", s3_server.endpoint_url]
    command += ["--create-bucket", "--mlflow-tracking-uri", tracking_uri, "--experiment-name", "nodes"]
    env = {**os.environ, **CLIENT_ENV, "PREFECT_API_URL": str(PREFECT_API_URL.value())}
    started = time.monotonic()
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert "not usable from every Ray node" in output and "127.0.0.1 (node " in output, output[-4000:]
    assert "AccessDenied" in output or "Access Denied" in output or "403" in output, output[-4000:]
    assert "forward_credentials_to_cluster" in output and READER[1] not in output
    # Not retried (docs/fault-tolerance.md): a retry would probe the same node with the same credentials.
    assert "Retry 1/" not in output, output[-4000:]
    print(f"\npre-flight refused the node after {took:.1f} s (whole CLI run)")
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("nodes")
    assert experiment is None or client.search_runs([experiment.experiment_id]) == []
    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.storage.locations import s3_client

    listed = s3_client(StorageOptions(endpoint_url=s3_server.endpoint_url)).list_objects_v2(Bucket="prt-nodes")
    assert [o["Key"] for o in listed.get("Contents", []) if "/runs/" in o["Key"]] == []


@pytest.mark.slow
def test_an_address_that_accepts_but_is_not_ray_is_refused_naming_the_connect_timeout(tmp_path: Path) -> None:
    """The TCP probe passes (something listens), then ray.init() would wait inside Ray's GCS client for minutes
    (measured: over 2 minutes before it was killed). The run fails at `ray_connect_timeout_s`, naming it."""
    code = textwrap.dedent(
        """
        import socket, threading, time
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        held = []
        threading.Thread(target=lambda: [held.append(listener.accept()) for _ in iter(int, 1)], daemon=True).start()
        from raytrain_tasks.config import TrainingConfig
        from raytrain_tasks.errors import ClusterError
        from raytrain_driver.cluster import ray_session
        try:
            with ray_session(TrainingConfig(ray_address=f"127.0.0.1:{port}", ray_connect_timeout_s=2)):
                print("CONNECTED")
        except ClusterError as exc:
            print(f"REFUSED: {exc}")
        """
    )
    done = run_python(code)  # ends within run_python's timeout; the seconds it takes: `python -m bench.waits`
    assert "REFUSED:" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert "ray_connect_timeout_s" in done.stdout and "ray_address" in done.stdout


# Epochs of about 3 s on 2 cores (0.5 s with 24,000 samples): the job outlasts a new CLI's start (about 15 s).
JOB_EPOCHS = 12
JOB_RUN = ["--train-config", '{"dataset": "synthetic", "synthetic_samples": 150000, "synthetic_features": 20}']
JOB_RUN += ["--epochs", str(JOB_EPOCHS)]
JOB_RUN += ["--batch-size", "64", "--checkpoints-to-keep", "10", "--num-workers", "2", "--experiment-name", "job"]


def ray_jobs(cluster: ExternalCluster) -> dict[str, str]:
    """submission id -> status of every job the cluster has had."""
    code = textwrap.dedent(
        f"""
        import json
        from ray.job_submission import JobSubmissionClient
        jobs = JobSubmissionClient("{cluster.dashboard_url}").list_jobs()
        print("JOBS" + json.dumps({{j.submission_id: j.status.value for j in jobs if j.submission_id}}))
        """
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.split("JOBS", 1)[1]))


@pytest.mark.slow
@pytest.mark.chaos
def test_a_ray_job_fit_outlives_its_orchestrator_and_the_next_run_reattaches(
    external_cluster: ExternalCluster, tmp_path: Path, prefect_api: None
) -> None:
    """launch_mode=ray_job, one run key through three orchestrators:
    1. SIGKILL the flow-run process after epoch 1: the job trains on without it.
    2. `--resume` re-attaches to that same job (no second job, no epoch trained twice); Ctrl-C it once the job
       logged one more epoch (a Prefect cancellation does the same through its SIGTERM): the job is stopped, the
       MLflow run KILLED.
    3. `--resume` finds the job stopped and continues from the last checkpoint in a new job, to the end:
       one MLflow run with every epoch once, one registered version."""
    from prefect.settings import PREFECT_API_URL

    tracking_uri = f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}"
    command = [sys.executable, "-m", "flows.training", "--ray-address", external_cluster.address]
    command += ["--launch-mode", "ray_job", "--ray-dashboard-url", external_cluster.dashboard_url]
    command += ["--storage-path", str(tmp_path / "storage"), "--mlflow-tracking-uri", tracking_uri, *JOB_RUN]
    env = {**os.environ, **CLIENT_ENV, "PREFECT_API_URL": str(PREFECT_API_URL.value()), **DRIVER_SECRETS}
    client = MlflowClient(tracking_uri)

    def only_run() -> Any:
        experiment = client.get_experiment_by_name("job")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        assert len(runs) <= 1, "one run key must be one MLflow run"
        return runs[0] if runs else None

    def logged_epochs() -> list[int]:
        run = only_run()
        # 0-based indices: MLflow's step is the epoch number, index + 1
        steps = [] if run is None else client.get_metric_history(run.info.run_id, "val_accuracy")
        return [int(m.step) - 1 for m in steps]

    def run_until(name: str, args: list[str], until: Callable[[str], bool], sig: int) -> str:
        """Run the CLI until ``until(its output so far)``, then send it ``sig``; return its whole output."""
        path = tmp_path / f"{name}.log"
        with path.open("w") as log:
            process = subprocess.Popen([*command, *args], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 300
                while not until(path.read_text()):
                    assert process.poll() is None, path.read_text()[-4000:]
                    assert time.monotonic() < deadline, f"{name}: not there within 300 s"
                    time.sleep(0.2)
                process.send_signal(sig)
                assert process.wait(timeout=120) != 0
            finally:
                if process.poll() is None:
                    process.kill()
        return path.read_text()

    # 1. The orchestrator dies (an OOM kill): nothing can warn the job.
    first = run_until("first", [], lambda _: 1 in logged_epochs(), signal.SIGKILL)
    killed_at = time.monotonic()
    match = re.search(r"submitted Ray Job (prt-fit-(\d{8}-\d{6}-[0-9a-f]{6}))", first)
    assert match, first[-4000:]
    submission_id, run_key = match[1], match[2]
    assert f"[{submission_id}]" in first  # the job's log reached the task's log
    assert ray_jobs(external_cluster)[submission_id] == "RUNNING"  # training went on without its orchestrator

    # 2. The next run re-attaches to the same job.
    reattached: list[float] = []  # seconds from the kill, the last epoch logged then

    def reattached_and_one_more_epoch(output: str) -> bool:
        if f"re-attaching to Ray Job {submission_id}" not in output:
            return False
        if not reattached:
            reattached.extend([time.monotonic() - killed_at, max(logged_epochs())])
        return max(logged_epochs()) > reattached[1]

    second = run_until("second", ["--resume", run_key], reattached_and_one_more_epoch, signal.SIGINT)
    assert sorted(logged_epochs()) == list(range(max(logged_epochs()) + 1))  # no epoch trained twice
    assert {k: v for k, v in ray_jobs(external_cluster).items() if run_key in k} == {submission_id: "STOPPED"}
    assert f"Ray Job {submission_id} stopped" in second, second[-4000:]
    stopped = only_run()
    assert stopped.info.status == "KILLED", stopped.info.status  # not left RUNNING, not FAILED
    epochs_kept = max(logged_epochs())

    # 3. The job is gone: a new one continues from the last checkpoint.
    resumed = subprocess.run(
        [*command, "--resume", run_key], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert f"submitted Ray Job {submission_id}-1" in output and "STOPPED" in output, output[-4000:]
    jobs = {name: status for name, status in ray_jobs(external_cluster).items() if run_key in name}
    assert jobs == {submission_id: "STOPPED", f"{submission_id}-1": "SUCCEEDED"}
    run = only_run()
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["prefect_raytrain.ray_job"] == f"{submission_id}-1"  # the job that trained last
    assert sorted(logged_epochs()) == list(range(JOB_EPOCHS))  # each epoch logged once
    (version,) = client.search_model_versions("name='synthetic-classifier'")
    assert version.run_id == run.info.run_id
    # The jobs' entrypoints and runtime_envs, as anyone who reaches the dashboard reads them: no driver secret.
    answers = dashboard_answers(external_cluster, ["/api/jobs/"])
    assert run_key in answers["/api/jobs/"]
    for name, secret in DRIVER_SECRETS.items():
        assert secret not in answers["/api/jobs/"], f"{name} is readable on the dashboard"
    print(
        f"\norchestrator SIGKILLed after epoch 1; the next run re-attached {reattached[0]:.1f} s later to "
        f"{submission_id}, which had kept training (epoch {reattached[1]:.0f} logged by then); Ctrl-C stopped it "
        f"after epoch {epochs_kept}; {submission_id}-1 continued from there to epoch {JOB_EPOCHS - 1}"
    )
