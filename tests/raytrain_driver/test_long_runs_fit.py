"""Checkpoints within an epoch, for real: a TrainSpec (tests/long_run_code.py: dropout, so the RNG matters) checkpoints
every 5 steps; one of its runs fails in rank 0 part-way through epoch 2, and Ray Train's restarted worker group
continues from the step before. Both runs are made once, by the module fixture; the deciders (when a checkpoint is
due, which settings are refused, the loader's position) are tested without a fit in test_long_runs.py."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from examples.long_epochs.train import load_splits
from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from raytrain_tasks.tracking.controller import SILENT_TAG
from raytrain_tasks.tracking.names import LAST_STEP_TAG, STEP_SERIES, within_epoch
from tests.helpers import (
    REPO_ROOT,
    committed_epochs,
    mlflow_client,
    only_run,
    seed_mlflow_store,
    small_config,
    start_flow,
    train_worker_pids,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster", "prefect_api")]

CODE = "tests.long_run_code:training"
# 2 workers, 400 train rows each, 32 a batch: 13 steps an epoch. A checkpoint 5 steps after the last one (an
# epoch's end counts), never at an epoch's last step: global steps 5, 10 | 18, 23 | 31, 36; epochs end at 13, 26, 39.
SETTINGS = {"epochs": 3, "batch_size": 32, "checkpoint_every_steps": 5, "register": False}
WITHIN = [5, 10, 18, 23, 31, 36]
EPOCH_ENDS = [13, 26, 39]
FAIL_AT = 21  # in epoch 2, 3 steps after the checkpoint at step 18


def _run(workdir: Path, **overrides: Any) -> Any:
    return _run_code(workdir, CODE, **{**SETTINGS, **overrides})


def _run_code(workdir: Path, code: str, **settings: Any) -> Any:
    return training_pipeline(**parameters_of(small_config(workdir, train_code=code, **settings)))


def _seen(workdir: Path, result: Any) -> SimpleNamespace:
    """What the tests read of a finished run: its MLflow run, every metric's history, its storage folder."""
    run = only_run(workdir)
    client = mlflow_client(workdir)
    history = {key: client.get_metric_history(run.info.run_id, key) for key in run.data.metrics}
    (run_dir,) = (workdir / "storage" / "runs").iterdir()
    return SimpleNamespace(run=run, history=history, run_dir=run_dir, result=result)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    return _seen(workdir, _run(workdir, checkpoints_to_keep=2))


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory: pytest.TempPathFactory, uninterrupted: SimpleNamespace) -> SimpleNamespace:
    """The run that fails in step 21 (no restart, no retry: it stops FAILED), then `resume`d to its end."""
    failed_dir = tmp_path_factory.mktemp("failed")
    marker = failed_dir / "failed-once"
    # Every checkpoint kept, to read which ones the resumed run wrote.
    failing = {"fail_at_step": FAIL_AT, "marker": str(marker)}
    settings = {**SETTINGS, "checkpoints_to_keep": 100, "max_failures": 0, "fit_retries": 0, "train_config": failing}
    with ThreadPoolExecutor(1) as pool:
        stopped = start_flow(pool, small_config(failed_dir, train_code=CODE, **settings)).result(timeout=600)
        stopped_run = only_run(failed_dir)
        (run_dir,) = (failed_dir / "storage" / "runs").iterdir()
        resume = small_config(failed_dir, train_code=CODE, **settings, resume=run_dir.name)
        resumed = start_flow(pool, resume).result(timeout=600)
    failed = _seen(failed_dir, resumed)
    return SimpleNamespace(reference=uninterrupted, failed=failed, marker=marker, stopped=stopped, run=stopped_run)


def _by_step(points: list[Any]) -> dict[int, float]:
    steps = [int(point.step) for point in points]
    assert len(steps) == len(set(steps)), f"each step logged once: {sorted(steps)}"
    return {int(point.step): float(point.value) for point in points}


def test_a_run_that_fails_within_an_epoch_resumes_and_ends_as_the_uninterrupted_one(
    long_runs: SimpleNamespace,
) -> None:
    """The run failed in step 21; `resume` trained on from its checkpoint at step 18: every epoch's figures and
    every point of the step series equal the uninterrupted run's (to 1e-6), in the same MLflow run, each epoch
    logged once. (Ray Train's record of the run then holds checkpoints without epoch scores: it must read back.)"""
    assert long_runs.marker.read_text() == str(FAIL_AT)  # it did fail, where the test placed it
    assert long_runs.stopped.is_failed(), long_runs.stopped
    assert long_runs.run.data.tags[LAST_STEP_TAG] == "18, epoch 2"  # what `runs` shows it continues after
    assert long_runs.failed.result.is_completed(), long_runs.failed.result
    assert long_runs.failed.run.info.run_id == long_runs.run.info.run_id
    assert_same_as_uninterrupted(long_runs.failed, long_runs.reference)
    assert sorted(_by_step(long_runs.failed.history[STEP_SERIES])) == sorted(WITHIN + EPOCH_ENDS)


def assert_same_as_uninterrupted(failed: SimpleNamespace, reference: SimpleNamespace) -> None:
    assert failed.run.info.status == "FINISHED"
    for key in ("train_loss", "val_loss", "val_accuracy", "test_accuracy", "test_loss"):
        got, expected = _by_step(failed.history[key]), _by_step(reference.history[key])
        assert sorted(got) == [1, 2, 3], key
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, abs=1e-6), (key, step)
    # The series: each epoch's train loss so far, at the global step of each checkpoint. Where both runs have a
    # point, they agree; the interrupted run may have one more (a checkpoint a stop asked for) and then lack one.
    got, expected = _by_step(failed.history[STEP_SERIES]), _by_step(reference.history[STEP_SERIES])
    assert sorted(expected) == sorted(WITHIN + EPOCH_ENDS)
    assert set(EPOCH_ENDS) <= set(got)
    for step in set(got) & set(expected):
        assert math.isfinite(got[step]) and got[step] == pytest.approx(expected[step], abs=1e-6), step


def test_the_resume_continued_from_the_step_checkpoint_not_the_epoch(long_runs: SimpleNamespace) -> None:
    """Resumed from epoch 2's step-18 checkpoint: nothing before it was trained again (a retrained folder would be
    named `-r1`), and every checkpoint after it was written after the failure."""
    run_dir = long_runs.failed.run_dir
    names = sorted(path.name for path in run_dir.iterdir() if path.name.startswith("epoch-"))
    assert "epoch-0002-step-00000018" in names and not [name for name in names if "-r" in name], names
    failed_at = long_runs.marker.stat().st_mtime

    def written(name: str) -> float:
        return max(path.stat().st_mtime for path in (run_dir / name).iterdir())

    assert written("epoch-0002-step-00000018") < failed_at
    assert all(written(name) > failed_at for name in ("epoch-0002-step-00000023", "epoch-0002", "epoch-0003"))
    assert long_runs.failed.run.data.tags[LAST_STEP_TAG] == "39, epoch 3"


def test_retention_keeps_the_best_epoch_checkpoints_and_the_newest(long_runs: SimpleNamespace) -> None:
    """With `checkpoints_to_keep` 2, the checkpoints within epochs (no epoch scores: ranked last) are gone once a
    newer one is committed; what stays is the two best epochs by val_accuracy and the newest, and the registered
    choice is an epoch's."""
    reference = long_runs.reference
    kept = sorted(path.name for path in reference.run_dir.iterdir() if path.name.startswith("epoch-"))
    assert not [name for name in kept if within_epoch(name)], kept
    scores = _by_step(reference.history["val_accuracy"])
    best_two = sorted(scores, key=lambda step: -scores[step])[:2]
    assert set(kept) == {f"epoch-{step:04d}" for step in {*best_two, 3}}, (kept, scores)
    best = reference.result.fit.best_checkpoint_uri.rstrip("/").rsplit("/", 1)[-1]
    assert best == f"epoch-{best_two[0]:04d}", (best, scores)


# --- real signals (make test-chaos) ------------------------------------------------------------------------------

PAUSE_AT = 21  # in epoch 2, 3 steps after the checkpoint at step 18


def _signalled_run(workdir: Path, signum: int, **overrides: Any) -> tuple[SimpleNamespace, float, int]:
    """A run whose rank 0 pauses in step 21 while the test sends ``signum`` to one worker, then goes on; (what the
    run left, the time.time() the signal was sent, the PID it was sent to)."""
    marker = workdir / "paused"
    config = small_config(
        workdir,
        train_code=CODE,
        **{**SETTINGS, "checkpoints_to_keep": 100, **overrides},
        train_config={"pause_at_step": PAUSE_AT, "marker": str(marker)},
    )
    with ThreadPoolExecutor(1) as pool:
        future = start_flow(pool, config)
        wait_for(marker.exists, 300, "rank 0 to pause in step 21")
        # The controller takes a report when it polls the workers: a worker killed before that loses it with its
        # memory. Signalled once step 18's checkpoint is pinned, the run's newest checkpoint is known.
        wait_for(lambda: _last_step(workdir) == "18, epoch 2", 60, "the step-18 checkpoint to be pinned")
        pid = train_worker_pids(config.num_workers)[-1]
        sent = time.time()
        os.kill(pid, signum)
        time.sleep(0.5)  # the signal is taken (or the process stopped) before the step goes on
        marker.unlink()
        state = future.result(timeout=600)
    assert state.is_completed(), state
    return _seen(workdir, None), sent, pid


def _last_step(workdir: Path) -> str | None:
    run = only_run(workdir)
    return None if run is None else run.data.tags.get(LAST_STEP_TAG)


def _folders(run_dir: Path) -> list[str]:
    return sorted(path.name for path in run_dir.iterdir() if path.name.startswith("epoch-"))


@pytest.mark.chaos
def test_a_sigterm_to_a_worker_commits_the_step_it_came_in_then_the_group_goes_on_from_it(
    tmp_path: Path, uninterrupted: SimpleNamespace
) -> None:
    """SIGTERM to one worker within step 21: every rank commits step 21 (no checkpoint was due there), the group
    stops and Ray Train restarts it from that checkpoint, without the process told to go; the run ends as the
    uninterrupted one, losing no step."""
    run, sent, pid = _signalled_run(tmp_path, signal.SIGTERM)
    folders = _folders(run.run_dir)
    assert f"epoch-0002-step-000000{PAUSE_AT}" in folders, folders
    assert not [name for name in folders if "-r" in name], folders  # nothing trained twice
    series = sorted(_by_step(run.history[STEP_SERIES]))
    assert series == [5, 10, 13, 18, PAUSE_AT, 26, 31, 36, 39], series  # the next one due 5 steps after it
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_same_as_uninterrupted(run, uninterrupted)


@pytest.mark.chaos
def test_a_sigkill_within_an_epoch_loses_only_the_steps_since_the_last_checkpoint(
    tmp_path: Path, uninterrupted: SimpleNamespace
) -> None:
    """SIGKILL to one worker within step 21: the restarted group continues from step 18 (3 steps lost, not the
    epoch's 21), and the run ends as the uninterrupted one."""
    run, sent, _ = _signalled_run(tmp_path, signal.SIGKILL)
    folders = _folders(run.run_dir)
    assert "epoch-0002-step-00000018" in folders and f"epoch-0002-step-000000{PAUSE_AT}" not in folders, folders
    assert not [name for name in folders if "-r" in name], folders  # step 19 on trained once after the kill
    assert_same_as_uninterrupted(run, uninterrupted)


@pytest.mark.chaos
def test_a_stopped_worker_is_restarted_within_the_hang_timeout(tmp_path: Path, uninterrupted: SimpleNamespace) -> None:
    """SIGSTOP to one worker within step 21 (a frozen process: it never exits): with `hang_timeout_s` 30, its peer's
    next collective fails after 30 s, and Ray Train restarts the group from step 18, well before torch's 30
    minutes; the run ends as the uninterrupted one."""
    started = time.monotonic()
    run, sent, pid = _signalled_run(tmp_path, signal.SIGSTOP, hang_timeout_s=30)
    took = time.monotonic() - started
    assert "epoch-0002-step-00000018" in _folders(run.run_dir)
    assert_same_as_uninterrupted(run, uninterrupted)
    assert took < 30 + 90, took  # the timeout, the group's restart and the rest of the run on 2 cores
    said = run.run.data.tags[SILENT_TAG]  # who was silent, and how long, is on the MLflow run
    seconds = float(re.search(rf"pid {pid}\) silent for ([\d.]+) s", said).group(1))  # type: ignore[union-attr]
    assert 25 <= seconds <= 60, said


@pytest.mark.chaos
def test_a_sigterm_to_the_command_commits_the_step_first_and_resume_ends_as_uninterrupted(
    tmp_path: Path, uninterrupted: SimpleNamespace
) -> None:
    """SIGTERM to `prefect-raytrain train` while rank 0 is within step 21: before the command stops, the workers
    commit step 21 and MLflow pins it; `resume` continues from it (no step trained twice) and the run ends as the
    uninterrupted one, in the same MLflow run."""
    import ray
    from prefect.settings import PREFECT_API_URL

    marker = tmp_path / "paused"
    shown = {**SETTINGS, "checkpoints_to_keep": 100, "train_config": {"pause_at_step": PAUSE_AT, "marker": str(marker)}}
    flags = [f"--{key.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}" for key, v in shown.items()]
    flags = [flag for flag in flags if not flag.startswith("--register")] + ["--no-register"]
    locations = [
        "--storage-path",
        str(tmp_path / "storage"),
        "--experiment-name",
        "tests",
        "--mlflow-tracking-uri",
        f"sqlite:///{seed_mlflow_store(tmp_path / 'mlflow.db')}",
    ]
    ray_address = ["--ray-address", ray.get_runtime_context().gcs_address]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(PREFECT_API_URL=str(PREFECT_API_URL.value()), PYTHONPATH=str(REPO_ROOT))

    def command(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.command", *args, *locations],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    train = command("train", "--train-code", CODE, *flags, *ray_address)
    wait_for(marker.exists, 300, "rank 0 to pause in step 21")
    wait_for(lambda: _last_step(tmp_path) == "18, epoch 2", 60, "the step-18 checkpoint to be pinned")
    train.send_signal(signal.SIGTERM)
    time.sleep(1.0)  # the driver has asked the workers before the step goes on
    marker.unlink()
    output, _ = train.communicate(timeout=90)
    assert train.returncode != 0, output[-3000:]
    assert f"checkpoint at step {PAUSE_AT}, epoch 2 committed before stopping" in output, output[-3000:]
    (run_dir,) = (tmp_path / "storage" / "runs").iterdir()
    stopped = only_run(tmp_path)
    assert stopped.info.status == "KILLED"
    assert stopped.data.tags[LAST_STEP_TAG] == f"{PAUSE_AT}, epoch 2"

    resume = command("resume", run_dir.name)  # the run's own settings, its Ray among them
    output, _ = resume.communicate(timeout=600)
    assert resume.returncode == 0, output[-3000:]
    run = _seen(tmp_path, None)
    assert run.run.info.run_id == stopped.info.run_id
    assert not [name for name in _folders(run.run_dir) if "-r" in name], _folders(run.run_dir)
    assert_same_as_uninterrupted(run, uninterrupted)


EXAMPLE = "examples.long_epochs.train:training"
EXAMPLE_SETTINGS = {"epochs": 3, "register": False, "checkpoints_to_keep": 100}


@pytest.fixture(scope="module")
def example_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """examples/long_epochs run through (its checkpoints within epochs change nothing it trains)."""
    workdir = tmp_path_factory.mktemp("example-uninterrupted")
    settings = {**EXAMPLE_SETTINGS, "train_config": {"save_every_steps": 10}}
    return _seen(workdir, _run_code(workdir, EXAMPLE, **settings))


def assert_example_as_uninterrupted(run: SimpleNamespace, reference: SimpleNamespace) -> None:
    """Every epoch's scores equal the uninterrupted run's to 1e-6, each logged once."""
    for key in ("val_loss", "val_accuracy"):
        got, expected = _by_step(run.history[key]), _by_step(reference.history[key])
        assert len(run.history[key]) == len(got) and sorted(got) == sorted(expected), key
        for step, value in expected.items():
            assert got[step] == pytest.approx(value, abs=1e-6), (key, step)


@pytest.mark.chaos
def test_a_train_funcs_own_checkpoints_within_epochs_are_resumed_after_a_killed_worker(
    tmp_path: Path, example_uninterrupted: SimpleNamespace
) -> None:
    """examples/long_epochs (Ray Train's API alone: each rank writes its loader position) checkpoints every 10
    steps. A worker SIGKILLed in epoch 2, after such a checkpoint was pinned, restarts from it: the run ends as an
    uninterrupted one (to 1e-6), each epoch and each step point logged once."""
    settings = {**EXAMPLE_SETTINGS, "train_config": {"save_every_steps": 10}}
    with ThreadPoolExecutor(1) as pool:
        future = start_flow(pool, small_config(tmp_path, train_code=EXAMPLE, **settings))
        wait_for(lambda: (_last_step(tmp_path) or "").endswith("epoch 2"), 300, "a checkpoint within epoch 2")
        os.kill(train_worker_pids(2)[-1], signal.SIGKILL)
        state = future.result(timeout=600)
    assert state.is_completed(), state
    killed = _seen(tmp_path, state)
    assert_example_as_uninterrupted(killed, example_uninterrupted)
    got, expected = _by_step(killed.history[STEP_SERIES]), _by_step(example_uninterrupted.history[STEP_SERIES])
    assert got == pytest.approx(expected, abs=1e-6)
    loader_files = {path.name for path in killed.run_dir.glob("checkpoint_*/loader-rank*.json")}
    assert loader_files == {"loader-rank0.json", "loader-rank1.json"}


@pytest.mark.chaos
def test_a_sigterm_to_a_train_funcs_worker_commits_first_through_the_public_helper(
    tmp_path: Path, example_uninterrupted: SimpleNamespace
) -> None:
    """examples/long_epochs with no checkpoint due within its epochs: a SIGTERM to one worker after epoch 1 makes
    every rank save at its next step (``checkpoint_if_preempted``), the group stops and Ray Train restarts it from
    there, without the process told to go; the run ends as an uninterrupted one."""
    settings = {**EXAMPLE_SETTINGS, "train_config": {"save_every_steps": 1000}}
    config = small_config(tmp_path, train_code=EXAMPLE, **settings)
    with ThreadPoolExecutor(1) as pool:
        future = start_flow(pool, config)
        wait_for(lambda: committed_epochs(tmp_path), 300, "epoch 1 to be committed")
        pid = train_worker_pids(2)[-1]
        os.kill(pid, signal.SIGTERM)
        state = future.result(timeout=600)
    assert state.is_completed(), state
    run = _seen(tmp_path, state)
    steps = math.ceil(math.ceil(len(load_splits()[0]) / 2) / config.batch_size)  # an epoch's, on 2 workers
    within = set(_by_step(run.history[STEP_SERIES])) - {steps, 2 * steps, 3 * steps}
    assert len(within) == 1 and steps < within.pop() < 3 * steps, run.history[STEP_SERIES]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_example_as_uninterrupted(run, example_uninterrupted)
