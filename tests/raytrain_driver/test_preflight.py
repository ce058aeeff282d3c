"""The fit's pre-flight for a resume: where the run key's MLflow run must be, checked before anything is created."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from raytrain_tasks.config import new_run_key
from raytrain_tasks.errors import CheckpointError, SettingsError, TrackingError
from raytrain_tasks.storage.locations import RUNS_DIR, locate
from raytrain_tasks.tracking import runs as tracking
from tests.helpers import prepared_for, seed_mlflow_store, small_config


def _started_run(db: Path, experiment: str, run_key: str) -> None:
    """An MLflow run of ``run_key`` in ``experiment`` of the store at ``db``, as a fit opens it."""
    client = tracking.connect(f"sqlite:///{seed_mlflow_store(db)}")
    experiment_id = tracking.ensure_experiment(client, experiment, f"sqlite:///{db}", str(db.parent / "storage"))
    client.create_run(experiment_id, tags={tracking.RUN_KEY_TAG: run_key})


def _store_contents(db: Path) -> tuple[list[str], int]:
    """The experiments of the store at ``db`` and how many runs they hold."""
    client = tracking.connect(f"sqlite:///{db}")
    experiments = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in experiments]) if experiments else []
    return sorted(e.name for e in experiments), len(runs)


@pytest.mark.parametrize("elsewhere", ["another store", "another experiment"])
def test_a_resume_whose_mlflow_run_is_elsewhere_creates_nothing_and_names_where_it_looked(
    tmp_path: Path, elsewhere: str
) -> None:
    """Run ``KEY`` has checkpoints in storage and its MLflow run in store A, experiment 'tests'; the resume looks in
    store B (or in experiment 'other' of store A). It fails before any MLflow run, experiment, lease or worker,
    with a TrackingError (not retried) naming the run key, the store and experiment it looked in and the settings."""
    from raytrain_driver.fit import fit_in_this_process
    from tasks.fit import NOT_RETRYABLE

    key = new_run_key()
    original = tmp_path / "a" / "mlflow.db"
    _started_run(original, "tests", key)
    if elsewhere == "another store":
        looked_in = tmp_path / "b" / "mlflow.db"
        overrides = {"mlflow_tracking_uri": f"sqlite:///{seed_mlflow_store(looked_in)}"}
    else:
        looked_in = original
        overrides = {"mlflow_tracking_uri": f"sqlite:///{original}", "experiment_name": "other"}
    config = small_config(tmp_path, dataset="synthetic", synthetic_samples=400, num_workers=1, resume=key, **overrides)
    config, dataset = prepared_for(config)
    runs = locate(config.storage_path).child(RUNS_DIR)
    run_dir = runs.child(key)
    # What the interrupted fit left in storage: one committed checkpoint and Ray Train's record of it.
    (Path(run_dir.path) / "epoch-0001").mkdir(parents=True)
    (Path(run_dir.path) / "epoch-0001" / "model.pt").write_bytes(b"weights")
    (Path(run_dir.path) / "checkpoint_manager_snapshot.json").write_text("{}")
    before = _store_contents(looked_in)

    with pytest.raises(TrackingError) as raised:
        fit_in_this_process(config, dataset, key, runs, origin={"run_name": key})

    message = str(raised.value)
    assert key in message
    assert f"experiment {config.experiment_name!r}" in message
    assert f"sqlite:///{looked_in}" in message
    assert "`mlflow_tracking_uri`" in message and "`experiment_name`" in message
    assert "who can write" not in message  # not storage's fault: no accusation of tampering
    if elsewhere == "another experiment":
        assert "'tests'" in message  # where this store does have it
    assert isinstance(raised.value, NOT_RETRYABLE)
    assert _store_contents(looked_in) == before  # no stray run, no experiment created
    assert sorted(p.name for p in Path(run_dir.path).iterdir()) == ["checkpoint_manager_snapshot.json", "epoch-0001"]


def test_a_resume_of_a_run_key_with_no_mlflow_run_and_no_storage_names_both_and_creates_no_store(
    tmp_path: Path,
) -> None:
    """Nothing of run ``KEY`` anywhere: a CheckpointError (not retried) naming the store, the experiment and the
    storage it looked in; a local MLflow store that is not there is not created by looking."""
    from raytrain_driver.fit import fit_in_this_process

    key = new_run_key()
    db = tmp_path / "empty" / "mlflow.db"
    config = small_config(tmp_path, mlflow_tracking_uri=f"sqlite:///{db}", resume=key)
    runs = locate(config.storage_path).child(RUNS_DIR)

    with pytest.raises(CheckpointError) as raised:
        fit_in_this_process(config, None, key, runs, origin={"run_name": key})

    message = str(raised.value)
    assert key in message and f"sqlite:///{db}" in message and "experiment 'tests'" in message
    assert runs.child(key).uri in message
    assert not db.exists()
    assert not Path(runs.child(key).path).exists()


def test_the_code_is_resolved_once_per_process_for_the_settings_it_sees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI's check, prepare-data, the fit and register-model each ask for the run's code: they share one
    TrainFunc, and its metric function runs once. Settings the code does not see (the run's storage, MLflow, model
    name) make no other; a setting it sees does."""
    import sys

    from raytrain_driver.preflight import resolve_code
    from raytrain_tasks.config import TrainingConfig

    (tmp_path / "once_code.py").write_text(
        "from raytrain_tasks.api import Metric, TrainFunc\n"
        "CALLS = []\n"
        "def metric(config):\n"
        "    CALLS.append(config['lr'])\n"
        "    return Metric('val_loss', higher_is_better=False)\n"
        "training = TrainFunc(lambda config: None, metric=metric)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "once_code", raising=False)
    config = TrainingConfig(train_code="once_code:training", register=False)
    first = resolve_code(config)
    assert resolve_code(config) is first
    assert resolve_code(config.resolved(tmp_path, {}, "")) is first  # what the flow's tasks are handed
    assert resolve_code(config.model_copy(update={"model_name": "other", "experiment_name": "x"})) is first
    faster = resolve_code(config.model_copy(update={"learning_rate": 0.5}))
    assert faster is not first and faster.selection.name == "val_loss"
    assert sys.modules["once_code"].CALLS == [config.learning_rate, 0.5]
    # The code imported anew (another test's module of the same name, say): resolved anew.
    monkeypatch.delitem(sys.modules, "once_code")
    (tmp_path / "once_code.py").write_text(
        "from raytrain_tasks.api import Metric, TrainFunc\n"
        "training = TrainFunc(lambda config: None, metric=Metric('val_accuracy', higher_is_better=True))\n"
    )
    assert resolve_code(config).selection.name == "val_accuracy"
    monkeypatch.delitem(sys.modules, "once_code")


def _run_with_epochs(db: Path, run_key: str, reports: list[dict[str, float]]) -> tuple[Any, str, str]:
    """An MLflow run of ``run_key`` that logged ``reports`` as the controller logs them: an epoch's (with ``epoch``)
    in one batch, a checkpoint within an epoch's (``in_epoch``) as its step series' point. (client, experiment id,
    run id)."""
    from raytrain_tasks.tracking.controller import log_epoch, log_within_epoch

    client = tracking.connect(f"sqlite:///{seed_mlflow_store(db)}")
    experiment_id = tracking.ensure_experiment(client, "tests", f"sqlite:///{db}", str(db.parent / "storage"))
    run_id = client.create_run(experiment_id, tags={tracking.RUN_KEY_TAG: run_key}).info.run_id
    for report in reports:
        time.sleep(0.002)  # each write its own millisecond, as reports seconds apart have
        if "epoch" in report:
            log_epoch(client, run_id, report, f"/runs/{run_key}/epoch-{int(report['epoch']) + 1:04d}")
        else:
            log_within_epoch(client, run_id, report, f"/runs/{run_key}/within", None)
    return client, experiment_id, run_id


# Epoch 1: 40 steps in 1000 s (25 s a step), with checkpoints at steps 10 and 20; epoch 2: 40 more in 1200 s (30 s).
SLOW_STEPS = [
    {"in_epoch": 0, "global_step": 10, "step_train_loss": 0.9},
    {"in_epoch": 0, "global_step": 20, "step_train_loss": 0.8},
    {"epoch": 0, "epoch_seconds": 1000.0, "global_step": 40, "train_loss": 0.7, "val_accuracy": 0.6},
    {"epoch": 1, "epoch_seconds": 1200.0, "global_step": 80, "train_loss": 0.6, "val_accuracy": 0.7},
]


@pytest.mark.parametrize(("hang_timeout_s", "refused"), [(60, True), (89, True), (90, False), (0, False)])
def test_a_continued_run_whose_steps_outlast_a_third_of_the_hang_timeout_is_refused_naming_it(
    tmp_path: Path, hang_timeout_s: float, refused: bool
) -> None:
    """Run ``KEY``'s MLflow run logged 30 s steps at its slowest. Continuing it (a resume, a retry) with
    `hang_timeout_s` under 3 such steps fails before the run is reopened or any worker starts, with a SettingsError
    (not retried) naming the setting, the step's seconds, the MLflow run and what to give; 90, or the default 600,
    go on."""
    from raytrain_driver.preflight import check_step_time
    from tasks.fit import NOT_RETRYABLE

    key = new_run_key()
    client, experiment_id, run_id = _run_with_epochs(tmp_path / "mlflow.db", key, SLOW_STEPS)
    config = small_config(tmp_path, hang_timeout_s=hang_timeout_s)

    if not refused:
        check_step_time(config, client, experiment_id, key)
        return
    with pytest.raises(SettingsError) as raised:
        check_step_time(config, client, experiment_id, key)
    message = str(raised.value)
    assert f"hang_timeout_s={hang_timeout_s:g} is shorter" in message, message
    assert f"MLflow run {run_id} (run key {key}) took 30.0 s per step in epoch 2 (1200.0 s over 40 steps)" in message
    assert message.endswith("Give hang_timeout_s 90 or more"), message
    assert isinstance(raised.value, NOT_RETRYABLE)


def test_a_new_run_or_one_whose_reports_give_no_global_step_is_not_held_to_a_step_time(tmp_path: Path) -> None:
    """No run of the key yet, or a TrainFunc whose epochs report their seconds but no global step: nothing says how
    long a step took, and the least `hang_timeout_s` (30) goes on."""
    from raytrain_driver.preflight import check_step_time

    key = new_run_key()
    epochs = [{"epoch": e, "epoch_seconds": 5000.0, "train_loss": 0.5, "val_accuracy": 0.5} for e in range(2)]
    client, experiment_id, _ = _run_with_epochs(tmp_path / "mlflow.db", key, epochs)
    config = small_config(tmp_path, hang_timeout_s=30)

    check_step_time(config, client, experiment_id, key)
    check_step_time(config, client, experiment_id, new_run_key())
