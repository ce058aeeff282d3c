"""The `sweep` flow for real: Ray Tune on the session's local Ray, each trial the pipeline's own fit of the table
classifier on 2 DDP workers, ASHA on val_accuracy, the best trial through the promotion gate. One sweep, made once
by the module fixture; the search's rules and the trials' bookkeeping are tested in
tests/raytrain_driver/test_search_space.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from flows.sweep import sweep_pipeline
from raytrain_driver.champion_history import read_history
from raytrain_driver.sweep_run import STOPPED_TAG
from raytrain_driver.tuning import PARENT_TAG, SWEEP_TAG
from raytrain_tasks.config import parameters_of
from tests.helpers import REPO_ROOT, seed_mlflow_store, small_config, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster", "prefect_api")]

# A learning rate that learns, and one that barely moves in 2 epochs: ASHA stops the second after its first.
SEARCH = {"learning_rate": {"grid": [0.05, 0.0001]}}


def _runs(workdir: Path) -> dict[str, list]:
    """The sweep's MLflow run and its trials' runs."""
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tests")
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    return {
        "sweep": [r for r in runs if PARENT_TAG not in r.data.tags],
        "trials": sorted((r for r in runs if PARENT_TAG in r.data.tags), key=lambda r: r.data.params["learning_rate"]),
    }


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    workdir = tmp_path_factory.mktemp("sweep")
    config = small_config(workdir, epochs=2, model_name="swept")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("prefect.task_runs").addHandler(handler)  # the sweep task's log: the console, Prefect
    try:
        result = sweep_pipeline(**parameters_of(config), search=SEARCH, trials=1, grace_period=1)
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(handler)
    return SimpleNamespace(workdir=workdir, result=result, config=config, lines=lines, **_runs(workdir))


def test_each_trial_is_a_nested_mlflow_run_with_its_params_and_curves(swept: SimpleNamespace) -> None:
    (sweep,) = swept.sweep
    assert sweep.info.status == "FINISHED" and sweep.data.tags[SWEEP_TAG] == swept.result.outcome.sweep_key
    assert json.loads(sweep.data.params["search"]) == SEARCH
    assert [r.data.params["learning_rate"] for r in swept.trials] == ["0.0001", "0.05"]
    assert all(r.data.tags[PARENT_TAG] == sweep.info.run_id for r in swept.trials)
    client = MlflowClient(f"sqlite:///{swept.workdir / 'mlflow.db'}")
    learned = client.get_metric_history(swept.trials[1].info.run_id, "val_accuracy")
    assert sorted(m.step for m in learned) == [1, 2]  # its curve: each epoch once
    assert learned[-1].value > 0.8


def test_asha_stops_the_trial_that_falls_behind_and_says_so(swept: SimpleNamespace) -> None:
    slow, fast = swept.trials
    assert slow.info.status == "KILLED" and "ASHA after 1 epochs" in slow.data.tags[STOPPED_TAG]
    assert fast.info.status == "FINISHED" and STOPPED_TAG not in fast.data.tags
    rows = {row["learning_rate"]: row for row in swept.result.outcome.trials}
    assert rows[0.0001]["finished"] is False and rows[0.05]["finished"] is True


def test_the_log_shows_each_epoch_of_each_trial_once_by_its_run_key(swept: SimpleNamespace) -> None:
    keys = {r.data.params["learning_rate"]: r.data.tags["prefect_raytrain.run_key"] for r in swept.trials}
    said = sorted(line.split(":")[0] for line in swept.lines if line.startswith("trial "))
    assert said == sorted(
        [f"trial {keys['0.05']} epoch 1/2", f"trial {keys['0.05']} epoch 2/2"]
        + [
            f"trial {keys['0.0001']} epoch 1/2"  # then ASHA stopped it
        ]
    ), swept.lines
    assert all(r.info.run_name.startswith(r.data.tags["prefect_raytrain.run_key"]) for r in swept.trials)


def test_the_best_trial_is_registered_once_through_the_gate(swept: SimpleNamespace) -> None:
    model = swept.result.model
    assert model is not None and model.decision == "promote" and "champion" in model.aliases
    client = MlflowClient(f"sqlite:///{swept.workdir / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'swept'")
    assert len(versions) == 1 and versions[0].run_id == swept.trials[1].info.run_id  # the 0.05 trial's run
    (move,) = read_history(client, "swept")[0].moves  # the champion history has it
    assert move.version == model.version
    (sweep,) = swept.sweep
    assert f"swept version {model.version}: promote" in sweep.data.tags["prefect_raytrain.sweep.registered"]


@pytest.mark.chaos
def test_a_sweep_killed_after_a_finished_trial_continues_without_training_it_again(tmp_path: Path) -> None:
    """SIGKILL to `prefect-raytrain sweep` once its first trial finished; the same command with `--sweep-key`
    keeps that trial (its MLflow run and its checkpoints untouched) and trains the other."""
    store = f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}"
    command = [sys.executable, "-m", "flows.command", "sweep", "--search", json.dumps(SEARCH), "--trials", "1"]
    command += ["--epochs", "2", "--experiment-name", "tests", "--mlflow-tracking-uri", store, "--no-register"]
    command += ["--storage-path", str(tmp_path / "storage")]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # its own Ray and Prefect API
    env.update(PYTHONPATH=str(REPO_ROOT))
    first = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )

    def finished_trial() -> list:
        return [r for r in _runs(tmp_path)["trials"] if r.info.status == "FINISHED"]

    done = wait_for(finished_trial, 300, "the first trial to finish")[0]
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=30)
    sweep_key = done.data.tags[SWEEP_TAG]
    record = tmp_path / "storage" / "runs" / done.data.tags["prefect_raytrain.run_key"]
    stamp = {path.name: path.stat().st_mtime for path in record.iterdir()}

    again = subprocess.run(
        [*command, "--sweep-key", sweep_key], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    kept_key = done.data.tags["prefect_raytrain.run_key"]
    (line,) = [line for line in again.stdout.splitlines() if line.strip().startswith(kept_key)]
    assert line.endswith("finished"), again.stdout  # counted as the finished trial it is, its epochs not re-counted
    assert f"best: {kept_key}" in again.stdout
    said = (again.stdout + again.stderr).splitlines()
    assert any(" - trial " in line and " epoch 1/2: val_accuracy=" in line for line in said), said  # its progress
    runs = _runs(tmp_path)
    assert len(runs["sweep"]) == 1 and len(runs["trials"]) == 2  # the same sweep run, no trial twice
    assert {path.name: path.stat().st_mtime for path in record.iterdir()} == stamp  # not trained again
    kept = [r for r in runs["trials"] if r.info.run_id == done.info.run_id]
    history = MlflowClient(store).get_metric_history(kept[0].info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == [1, 2]
