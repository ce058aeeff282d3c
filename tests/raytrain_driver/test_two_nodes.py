"""Two Ray nodes on this machine (a `ray start --head` node and a second `ray start --address` node, one CPU
each, so two workers land on different nodes), checkpoints on the local S3 server: training spans both nodes;
losing the second node mid-run is survived with elastic workers and bounded with a fixed worker count, and a
resume after the node is back continues from the last checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from devtools.s3_server import LocalS3
from tests.helpers import (
    CLIENT_ENV,
    RAY,
    ExternalCluster,
    free_ports,
    head_node,
    run_python,
    seed_mlflow_store,
    stop_process_group,
)

# A worker group must start within START_TIMEOUT: load beside it would count as a lost node.
pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.window]

BUCKET = "prt-two-nodes"
NODE_IP = "127.0.0.2"
# Ray Train's own setting (default 60 s): how long a worker group waits for its resources before the attempt
# fails. After a node is lost, the first restart may still ask for that node's CPU until Ray marks it dead.
START_TIMEOUT = {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}
EPOCHS = 4
# An epoch of a few seconds with one worker per node, so the second node dies inside the run.
WORKLOAD = ["--train-config", '{"dataset": "synthetic", "synthetic_samples": 60000}', "--batch-size", "16"]
WORKLOAD += ["--epochs", str(EPOCHS), "--checkpoints-to-keep", "10", "--no-register", "--experiment-name", "nodes"]


@pytest.fixture(scope="module")
def head() -> Iterator[ExternalCluster]:
    with head_node(num_cpus=1) as cluster:
        yield cluster


def cluster_python(head: ExternalCluster, body: str, timeout: float = 120) -> str:
    """Run ``body`` in a fresh interpreter connected to the cluster; its stdout."""
    code = f"import ray, json, time\nray.init(address={head.address!r}, logging_level='ERROR')\n"
    code += textwrap.dedent(body)
    done = run_python(code, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@contextmanager
def second_node(head: ExternalCluster) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`ray start --address <head> --block` with one CPU, its own ports and temp dir; (process, node id)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-prt-n2-"))
    # Everything stays on loopback. The head listens on 127.0.0.1; a joining node's `ray start` rewrites
    # "127.0.0.1" (and "localhost") to the machine's outward IP, both in --address and --node-ip-address. "127.1"
    # is 127.0.0.1 in a form Ray leaves alone (gRPC's native resolver reads it), and the node itself listens on
    # 127.0.0.2, also loopback.
    port = head.address.rsplit(":", 1)[1]
    command = [RAY, "start", "--address", f"127.1:{port}", "--block", "--disable-usage-stats", "--num-cpus", "1"]
    command += ["--node-ip-address", NODE_IP, "--temp-dir", str(temp_dir)]
    flags = (
        "--node-manager-port",
        "--object-manager-port",
        "--metrics-export-port",
        "--runtime-env-agent-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
    )
    for flag, free in zip(flags, free_ports(len(flags)), strict=True):
        command += [flag, str(free)]
    # The head stays on loopback with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (tests.helpers.LOOPBACK_ENV); a node that
    # joins it must say it is part of a multi-node cluster, and stays on loopback through --node-ip-address.
    with (temp_dir / "ray-start.log").open("w") as log:
        node = subprocess.Popen(
            command,
            env={**os.environ, **CLIENT_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "GRPC_DNS_RESOLVER": "native"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        seen = cluster_python(
            head,
            f"""
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                others = [n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == {NODE_IP!r}]
                if others:
                    print("NODE", others[0]["NodeID"])
                    break
                time.sleep(0.5)
            """,
            timeout=180,
        )
        assert "NODE " in seen, (temp_dir / "ray-start.log").read_text()[-3000:]
        yield node, seen.split("NODE ", 1)[1].split()[0]
    finally:
        stop_process_group(node, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


def train_workers(head: ExternalCluster) -> list[dict[str, str]]:
    """The cluster's live RayTrainWorker actors: node id and pid of each."""
    out = cluster_python(
        head,
        f"""
        from ray.util.state import list_actors
        actors = list_actors(address={head.dashboard_url!r},
                             filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")], limit=100)
        print("WORKERS" + json.dumps([{{"node": a.node_id, "pid": str(a.pid)}} for a in actors]))
        """,
    )
    (line,) = [line for line in out.splitlines() if line.startswith("WORKERS")]
    return list(json.loads(line.removeprefix("WORKERS")))


def start_cli(
    workdir: Path, head: ExternalCluster, s3: LocalS3, *flags: str, workload: list[str] = WORKLOAD, **env: str
) -> subprocess.Popen[str]:
    from prefect.settings import PREFECT_API_URL

    command = [sys.executable, "-m", "flows.training", "--ray-address", head.address, *workload, *flags]
    command += ["--storage-path", f"s3://{BUCKET}/{workdir.name}", "--s3-endpoint-url", s3.endpoint_url]
    command += ["--create-bucket", "--mlflow-tracking-uri", f"sqlite:///{seed_mlflow_store(workdir / 'mlflow.db')}"]
    full_env = {**os.environ, **CLIENT_ENV, "PREFECT_API_URL": str(PREFECT_API_URL.value()), **env}
    return subprocess.Popen(
        command, cwd=workdir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def committed(workdir: Path) -> set[int]:
    """The 0-based indices of the epochs logged to MLflow (its ``step`` is the epoch number, index + 1)."""
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("nodes")
    runs = [] if experiment is None else client.search_runs([experiment.experiment_id])
    if not runs:
        return set()
    return {int(m.step) - 1 for m in client.get_metric_history(runs[0].info.run_id, "val_accuracy")}


def the_run(workdir: Path) -> Any:
    """The run, and the epoch numbers in its MLflow history."""
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("nodes").experiment_id])
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    return run, sorted(int(m.step) for m in history)


def the_history(workdir: Path, run: Any, key: str) -> list[Any]:
    return list(MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}").get_metric_history(run.info.run_id, key))


def wait_until(predicate: Any, timeout: float, what: str, cli: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if cli.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {cli.stdout.read()[-4000:] if cli.stdout else ''}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def checkpoints_in_bucket(s3: LocalS3, workdir: Path) -> list[str]:
    from raytrain_tasks.storage.filesystem import StorageOptions
    from raytrain_tasks.storage.locations import s3_client

    client = s3_client(StorageOptions(endpoint_url=s3.endpoint_url))
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{workdir.name}/runs/"):
        keys += [item["Key"] for item in page.get("Contents", [])]
    return sorted({key.split("/")[3] for key in keys if "/epoch-" in key})


def test_elastic_training_spans_both_nodes_and_survives_losing_one(
    head: ExternalCluster, s3_server: LocalS3, tmp_path: Path, prefect_api: None
) -> None:
    with second_node(head) as (node, node_id):
        cli = start_cli(tmp_path, head, s3_server, "--num-workers", "1", "--max-workers", "2", **START_TIMEOUT)
        try:
            workers = wait_until(
                lambda: (w := train_workers(head)) and len({x["node"] for x in w}) == 2 and w,
                240,
                "a worker on each node",
                cli,
            )
            assert node_id in {w["node"] for w in workers}
            wait_until(lambda: 1 in committed(tmp_path), 240, "epoch 1 to be committed", cli)
            os.killpg(node.pid, signal.SIGKILL)  # the second machine is gone: its raylet and its worker
            killed_at = time.monotonic()
            node.wait(timeout=30)
            first_group = {w["pid"] for w in workers}
            survivors = wait_until(  # a new worker group (new processes), none of it on the lost node
                lambda: (
                    (w := train_workers(head))
                    and all(x["node"] != node_id and x["pid"] not in first_group for x in w)
                    and w
                ),
                240,
                "the worker group to restart without the lost node",
                cli,
            )
            restarted = time.monotonic() - killed_at
            output, _ = cli.communicate(timeout=600)
        finally:
            if cli.poll() is None:
                cli.kill()
    assert cli.returncode == 0, output[-4000:]
    assert len(survivors) == 1  # elastic: one worker on the surviving node, not a wait for two
    run, steps = the_run(tmp_path)
    assert run.info.status == "FINISHED" and steps == list(range(1, EPOCHS + 1))  # every epoch exactly once
    # The run page shows the elastic run's worker count per epoch: both nodes at first, then the survivor alone.
    workers = [int(m.value) for m in sorted(the_history(tmp_path, run, "workers"), key=lambda m: m.step)]
    assert max(workers) == 2 and workers[-1] == 1, workers
    # Checkpoints went to the bucket, from whichever node held rank 0; none was written under a node's folder.
    # (An epoch cut off by the loss is trained again into a folder of its own, epoch-NNNN-r1.)
    written = checkpoints_in_bucket(s3_server, tmp_path)
    assert {name[:10] for name in written} == {f"epoch-{e:04d}" for e in range(1, EPOCHS + 1)}, written
    assert not list(head.temp_dir.rglob("epoch-0*"))
    print(f"\nnode lost -> worker group of one on the survivor: {restarted:.1f} s")


def test_a_fixed_worker_count_fails_within_its_bound_and_resumes_when_the_node_is_back(
    head: ExternalCluster, s3_server: LocalS3, tmp_path: Path, prefect_api: None
) -> None:
    fixed = ("--num-workers", "2", "--max-failures", "1", "--fit-retries", "0")
    with second_node(head) as (node, _node_id):
        cli = start_cli(tmp_path, head, s3_server, *fixed, **START_TIMEOUT)
        try:
            wait_until(lambda: 1 in committed(tmp_path), 240, "epoch 1 to be committed", cli)
            os.killpg(node.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            node.wait(timeout=30)
            output, _ = cli.communicate(timeout=300)  # never waits forever for the lost CPU
            took = time.monotonic() - killed_at
        finally:
            if cli.poll() is None:
                cli.kill()
    assert cli.returncode != 0, output[-4000:]
    assert "no longer has the resources for 2 workers" in output and "`max_workers`" in output, output[-4000:]
    run, before = the_run(tmp_path)
    assert run.info.status == "FAILED"  # not left RUNNING
    run_key = re.search(r"run key\s+(\d{8}-\d{6}-[0-9a-f]{6})", output)
    assert run_key, output[-3000:]
    print(f"\nnode lost -> the run failed after {took:.1f} s (1 restart allowed, 10 s start timeout each)")

    with second_node(head):
        resumed = start_cli(tmp_path, head, s3_server, *fixed, "--resume", run_key.group(1))
        output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output[-4000:]
    match = re.search(r"resuming from checkpoint \S+ \(epoch (\d+) of \d+\): next epoch (\d+)", output)
    assert match and int(match.group(1)) >= max(before), output[-3000:]  # from the last checkpoint, not epoch 1
    run_after, steps = the_run(tmp_path)
    assert run_after.info.run_id == run.info.run_id and run_after.info.status == "FINISHED"
    assert steps == list(range(1, EPOCHS + 1))
