"""A Ray node drained for preemption, on a two-node cluster of its own (a `ray start --head` node and a second
node, one CPU each; tests/raytrain_driver/test_two_nodes.py holds the helpers): before the node goes, every rank of
the elastic group commits a checkpoint at the step the notice came in, and the group goes on from it with the
head's worker alone. A cluster of its own: Ray's state API may still list the workers of nodes another test lost."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from devtools.s3_server import LocalS3
from raytrain_tasks.tracking.names import LAST_STEP_TAG, STEP_SERIES
from tests.helpers import CLIENT_ENV, RAY, REPO_ROOT, ExternalCluster, head_node
from tests.raytrain_driver.test_two_nodes import (
    START_TIMEOUT,
    cluster_python,
    second_node,
    start_cli,
    the_history,
    the_run,
    train_workers,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.window]

# The run (tests/long_run_code.py): 800 train rows, 32 a batch, 13 steps an epoch on 2 workers.
BATCH, ROWS_TRAINED, EPOCH_STEPS, PAUSE_AT = 32, 800, 13, 21
DRAIN_NOTICE_S = 12.0


@pytest.fixture(scope="module")
def head() -> Iterator[ExternalCluster]:
    with head_node(num_cpus=1) as cluster:
        yield cluster


def last_step(workdir: Path) -> str:
    """The run's newest checkpoint as MLflow tags it: "<global step>, epoch <n>"."""
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("nodes")
    runs = [] if experiment is None else client.search_runs([experiment.experiment_id])
    return str(runs[0].data.tags.get(LAST_STEP_TAG, "")) if runs else ""


def test_a_drained_node_commits_a_checkpoint_first_and_the_run_finishes_on_what_remains(
    head: ExternalCluster, s3_server: LocalS3, tmp_path: Path, prefect_api: None
) -> None:
    """A cloud preempts the second node: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` with a deadline,
    then the node is gone. Before it goes, every rank commits a checkpoint at the step the notice came in; the
    elastic group then goes on with the head's worker alone from that step, the rows of the epoch left dealt to
    it: nothing is trained twice and the run finishes, one MLflow run, each epoch once."""
    # A user's own TrainSpec from outside this project: tests/long_run_code.py, shipped from the run's folder.
    shutil.copy(REPO_ROOT / "tests" / "long_run_code.py", tmp_path / "drain_code.py")
    marker = tmp_path / "paused"
    hooks = {"pause_at_step": PAUSE_AT, "hold_at_step": PAUSE_AT + 1, "marker": str(marker)}
    workload = ["--train-code", "drain_code:training", "--train-config", json.dumps(hooks), "--epochs", "3"]
    workload += ["--batch-size", str(BATCH), "--checkpoints-to-keep", "100", "--no-register"]
    workload += ["--experiment-name", "nodes", "--num-workers", "1", "--max-workers", "2"]
    with second_node(head) as (node, node_id):
        # The elastic group starts with what the cluster shows free: both nodes' CPUs, not the head's alone.
        cluster_python(head, "while ray.available_resources().get('CPU', 0) < 2:\n    time.sleep(0.5)", timeout=120)
        cli = start_cli(tmp_path, head, s3_server, workload=workload, **START_TIMEOUT)
        try:
            wait_until(marker.exists, 240, "rank 0 to pause in step 21", cli)
            # One worker on each node. (Ray's state API may still list the workers of a node an earlier test lost.)
            wait_until(lambda: node_id in {w["node"] for w in train_workers(head)}, 60, "a worker on node 2", cli)
            drain = [RAY, "drain-node", "--address", head.address, "--node-id", node_id]
            drain += ["--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed"]
            drained = subprocess.run(
                [*drain, "--deadline-remaining-seconds", "120"],
                env={**os.environ, **CLIENT_ENV},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert drained.returncode == 0, drained.stderr[-2000:]
            time.sleep(DRAIN_NOTICE_S)  # Ray Train polls for drains: the notice reaches the workers meanwhile
            marker.unlink()
            # Rank 0 holds in the next step: the checkpoint the drain made is the run's newest when the node goes.
            step = wait_until(
                lambda: re.fullmatch(r"(\d+), epoch 2", last_step(tmp_path)), 120, "the drain's checkpoint", cli
            )
            os.killpg(node.pid, signal.SIGKILL)  # the deadline: the cloud takes the node
            node.wait(timeout=30)
            output, _ = cli.communicate(timeout=600)
        finally:
            if cli.poll() is None:
                cli.kill()
    assert cli.returncode == 0, output[-4000:]
    committed_at = int(step.group(1))
    assert EPOCH_STEPS < committed_at <= PAUSE_AT + 1, step.group(0)  # within epoch 2, where the notice came
    run, epochs = the_run(tmp_path)
    assert run.info.status == "FINISHED" and epochs == [1, 2, 3]
    # From the drain's checkpoint on, one worker trains the rows of epoch 2 the two had not reached, then epoch 3
    # whole: epoch 2 ends that many steps later, not after a retrained epoch.
    left = ROWS_TRAINED - 2 * BATCH * (committed_at - EPOCH_STEPS)
    epoch_2_end = committed_at + math.ceil(left / BATCH)
    series = sorted(int(m.step) for m in the_history(tmp_path, run, STEP_SERIES))
    assert series == [EPOCH_STEPS, committed_at, epoch_2_end, epoch_2_end + math.ceil(ROWS_TRAINED / BATCH)], series
