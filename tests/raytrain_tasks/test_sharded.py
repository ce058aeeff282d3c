"""Checkpoints written by every rank (issue 37): examples/fsdp_sharded shards its model with FSDP2 and saves it
with torch.distributed.checkpoint from both ranks. A killed worker resumes from the last checkpoint in one
MLflow run that ends where an uninterrupted one does; a checkpoint missing one rank's shard is never resumed
from (the run continues from the one before it and records why); one registered version loads and predicts.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from mlflow import MlflowClient

from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from raytrain_tasks.tracking.pin_journal import PinJournal
from tests.helpers import REPO_ROOT, mlflow_client, only_run, run_killing_a_worker, seed_mlflow_store, small_config

pytestmark = [pytest.mark.slow]

FSDP = "examples.fsdp_sharded.train:training"
EPOCHS = 4
PREFECT_RAYTRAIN = str(Path(sys.executable).with_name("prefect-raytrain"))


def fsdp_config(workdir: Path, **overrides: Any) -> Any:
    return small_config(
        workdir,
        train_code=FSDP,
        **{"epochs": EPOCHS, "register": False, "checkpoints_to_keep": 10, "train_config": '{"hidden": 64}'}
        | overrides,
    )


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any, prefect_api: Any) -> Any:
    return training_pipeline(**parameters_of(fsdp_config(tmp_path_factory.mktemp("fsdp-reference"))))


@pytest.mark.chaos
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_sharded_run_with_a_killed_worker_ends_as_an_uninterrupted_one_and_registers_one_model(
    tmp_path: Path, fsdp_reference: Any
) -> None:
    import mlflow
    import numpy as np

    from raytrain_tasks.tracking.runs import using_tracking_uri

    state, kill = run_killing_a_worker(tmp_path, fsdp_config(tmp_path, register=True), after_epoch=2)
    assert state.is_completed(), state
    result = state.result()
    run = only_run(tmp_path)
    assert run is not None and run.info.status == "FINISHED"
    client = mlflow_client(tmp_path)
    expected = {int(entry["epoch"]) + 1: entry for entry in fsdp_reference.fit.history}
    for key in ("val_loss", "val_accuracy"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1)), f"{key}: every epoch once"
        for metric in history:
            assert metric.value == pytest.approx(expected[metric.step][key], abs=1e-5), (key, metric.step)
    assert kill.resume_epoch >= 2
    # Every rank's shard is in each checkpoint, and the recorded digest covers them all.
    (run_dir,) = (tmp_path / "storage" / "runs").iterdir()
    folders = sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert folders
    assert all(
        {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {f.name for f in folder.iterdir()} for folder in folders
    )
    # One registered version, made from the shards, that loads and predicts.
    versions = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").search_model_versions("name = 'digits-test'")
    assert [str(v.version) for v in versions] == [result.model.version]
    with using_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        predicted = mlflow.pyfunc.load_model(f"models:/digits-test/{result.model.version}").predict(
            np.zeros((3, 64), np.float32)
        )
    assert np.asarray(predicted).shape == (3, 10)


def _name(process: Any) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone between listing and reading: nothing to wait for
        return "Agent"


def test_a_checkpoint_missing_a_ranks_shard_is_passed_over_and_the_run_says_why(
    tmp_path: Path, prefect_api: None
) -> None:
    """The driver is killed after epoch 2; one rank's shard is deleted from the newest checkpoint; the resume
    continues from the checkpoint before it, in the same MLflow run, and records why. The command uses the
    session's Prefect API (no temporary server per command)."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_API"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_API_URL"] = str(PREFECT_API_URL.value())
    locations = [
        "--storage-path", str(tmp_path / "storage"), "--experiment-name", "tests",
        "--mlflow-tracking-uri", f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}",
    ]  # fmt: skip
    train = [PREFECT_RAYTRAIN, "train", "--train-code", FSDP, "--epochs", str(EPOCHS), "--no-register"]
    log = tmp_path / "train.log"
    with log.open("w") as out:
        first = subprocess.Popen(
            [*train, *locations], cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while "epoch 2/4 committed" not in log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
    finally:
        started = psutil.Process(first.pid).children(recursive=True) if first.poll() is None else []
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    # Ray's controller and workers end with the killed driver (fate-sharing), not at the same instant: until they
    # have, they may still commit a checkpoint. (Ray's agents may outlive it; they commit nothing.)
    psutil.wait_procs([p for p in started if "Agent" not in _name(p)], timeout=60)
    key = re.search(r"run key (\d{8}-\d{6}-[0-9a-f]{6})", log.read_text())
    assert key is not None
    run_dir = tmp_path / "storage" / "runs" / key[1]
    run_before = only_run(tmp_path)
    pinned = {
        name.removeprefix("prefect_raytrain.checkpoint_sha256.")
        for name in run_before.data.tags
        if name.startswith("prefect_raytrain.checkpoint_sha256.")
    }
    # A pin the controller had journaled but not yet written to MLflow when it died counts too: the resume
    # copies it into MLflow first (raytrain_tasks.tracking.pin_journal).
    journal = PinJournal.for_run(tmp_path / "prefect-home" / "prefect-raytrain" / "pin-journal", key[1])
    pinned |= {entry.checkpoint for entry in journal.entries(run_before.info.run_id)}
    committed = sorted(p.name for p in run_dir.iterdir() if p.name in pinned)
    assert len(committed) >= 2, committed
    newest, before = committed[-1], committed[-2]
    (run_dir / newest / "__1_0.distcp").unlink()

    resumed = subprocess.run(
        [PREFECT_RAYTRAIN, "resume", key[1], *locations],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-4000:]
    assert f"resumes from checkpoint {before}, not a newer one" in output, output[-4000:]
    run = only_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert newest in run.data.tags["prefect_raytrain.resume_fallback"]
    history = mlflow_client(tmp_path).get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1))
