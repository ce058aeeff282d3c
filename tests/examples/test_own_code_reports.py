"""What your code reports decides whether a run can give a model, checked without a cluster: a TrainSpec's loop
runs under Ray Train's local mode (`ScalingConfig(num_workers=0)`, in this process), the controller's epoch
logger and code stopper are called with real checkpoint folders and a real MLflow store, the driver's choice of
the best checkpoint reads real `ray.train.Result`s, and a train_func's reports are checked as its worker makes them
(local mode again). That such a UserCodeError fails the run once, with no retry, is shown
end to end in test_own_code.py (a worker's TypeError; the driver's never-reported gate metric)."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
import ray.train
import torch
from mlflow import MlflowClient
from torch.utils.data import TensorDataset

from raytrain_driver.fit_steps import best_checkpoint, trainer_function
from raytrain_driver.lease import HeldLease
from raytrain_tasks.api import Metric, Splits, TrainFunc, TrainSpec
from raytrain_tasks.errors import UserCodeError
from raytrain_tasks.storage.locations import locate
from raytrain_tasks.tracking.controller import MlflowEpochLogger
from raytrain_tasks.trainspec.loop import SpecTrainFunc
from raytrain_tasks.user_code import code_error_stopper
from tests.helpers import fit_context, seed_mlflow_store, small_config

PIPELINE_CONFIG = {"epochs": 2, "batch_size": 16, "lr": 0.1, "seed": 0, "num_workers": 1, "use_gpu": False}


@pytest.fixture
def local_mode() -> Iterator[None]:
    """Ray Train's local mode leaves its train-function utilities set in this process: cleared after the test, so
    no later test finds itself inside a Ray Train worker."""
    from ray.train.v2._internal.execution.train_fn_utils import set_train_fn_utils

    yield
    set_train_fn_utils(None)


@pytest.mark.usefixtures("local_mode")
def test_a_train_spec_metric_its_metrics_never_compute_stops_on_the_first_batch_before_any_training() -> None:
    """A TrainSpec whose metric its metrics=... never computes (`MAE` where they give `mae`) can never pick a
    checkpoint: its loop stops with a UserCodeError naming the metric and the likely one, on the first batch (its
    loss computed once, without a gradient), before an epoch trains or anything is reported (it was found after
    the last epoch)."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    losses: list[bool] = []

    def loss(outputs: Any, targets: Any) -> Any:
        losses.append(torch.is_grad_enabled())
        return torch.nn.functional.mse_loss(outputs, targets)

    rows = TensorDataset(torch.linspace(-1, 1, 30).unsqueeze(1), torch.linspace(-3, 3, 30).unsqueeze(1))
    spec = TrainSpec(
        data=lambda config: Splits(rows, rows, rows),
        model=lambda config, example: torch.nn.Linear(1, 1),
        loss=loss,
        metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
        metric=Metric("MAE", higher_is_better=False),
    )
    loop = SpecTrainFunc(spec)
    trainer = TorchTrainer(lambda: loop(dict(PIPELINE_CONFIG)), scaling_config=ScalingConfig(num_workers=0))
    with pytest.raises(UserCodeError) as raised:
        trainer.fit()
    says = r"TrainSpec\(metric='MAE'\) names no metric .* \(did you mean 'mae'\?\)"
    assert re.search(says, str(raised.value)), str(raised.value)
    assert losses == [False], losses  # the first batch, scored for its names; no training step


def _checkpoint(folder: Path) -> ray.train.Checkpoint:
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"the weights of an epoch")
    return ray.train.Checkpoint(str(folder), filesystem=pafs.LocalFileSystem())


def test_reports_without_a_checkpoint_are_never_logged_as_epochs_of_the_run(tmp_path: Path) -> None:
    """The controller logs an epoch to MLflow only with a persisted checkpoint: a train_func that reports without
    `checkpoint=` leaves the run without a step (anything else would be redone on resume)."""
    db = seed_mlflow_store(tmp_path / "mlflow.db")
    client = MlflowClient(f"sqlite:///{db}")
    run_id = client.create_run(client.create_experiment("reports")).info.run_id
    epochs = MlflowEpochLogger(f"sqlite:///{db}", run_id)
    for epoch in range(2):
        epochs.after_report(None, [{"epoch": epoch, "val_loss": 1.0 / (epoch + 1)}], None)
    assert client.get_metric_history(run_id, "val_loss") == []
    epochs.after_report(None, [{"epoch": 0, "val_loss": 1.0}], _checkpoint(tmp_path / "checkpoint_a"))
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_loss")] == [(1, 1.0)]


@pytest.mark.parametrize(
    ("reports", "says"),
    [
        ([], r"train_func never passed a checkpoint to ray.train.report\(\.\.\., checkpoint=\.\.\.\)"),
        (
            [{"epoch": 0, "loss": 1.0}],
            r"never reported \['val_score'\] with a checkpoint \(it reported \['loss'\]\)",
        ),
    ],
    ids=["no checkpoint", "not the gate metric"],
)
def test_a_fit_that_kept_no_checkpoint_with_the_gate_metric_gives_no_model_and_says_why(
    tmp_path: Path, reports: list[dict[str, Any]], says: str
) -> None:
    """Nothing can be registered, nor resumed, from a fit whose kept checkpoints are none, or hold no report of
    the code's metric: a UserCodeError (which Prefect does not retry) naming what the code should report, with
    the resume that fix allows. A fit that reported its metric gives its best checkpoint."""
    spec = _spec(Metric("val_score", higher_is_better=True))
    with pytest.raises(UserCodeError, match=says) as raised:
        best_checkpoint(_result(tmp_path, reports), spec, "20260101-000000-abcdef")
    assert "resume=20260101-000000-abcdef" in str(raised.value)

    scored = _result(tmp_path / "scored", [{"epoch": i, "val_score": score} for i, score in enumerate((0.2, 0.9, 0.5))])
    assert best_checkpoint(scored, spec, "20260101-000000-abcdef") == scored.best_checkpoints[1]  # higher is better


def _result(tmp_path: Path, reports: list[dict[str, Any]], ray_order: list[int] | None = None) -> ray.train.Result:
    """A Result whose kept checkpoints are ``reports`` (named in report order), listed in ``ray_order``."""
    kept = [(_checkpoint(tmp_path / f"checkpoint_{i}"), metrics) for i, metrics in enumerate(reports)]
    listed = [kept[i] for i in ray_order] if ray_order is not None else kept
    return ray.train.Result(metrics=None, checkpoint=None, error=None, path=str(tmp_path), best_checkpoints=listed)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("higher_is_better", "reports", "ray_order", "chosen"),
    [
        # Ray lists a NaN score first (lowest) and an infinity at either end: a diverged model must never win.
        (True, [{"score": NAN, "gate": 0.5}, {"score": 0.7, "gate": 0.5}], [0, 1], 1),
        (False, [{"score": 0.3, "gate": 0.5}, {"score": NAN, "gate": 0.5}], [1, 0], 0),
        (False, [{"score": -INF, "gate": 0.5}, {"score": 0.3, "gate": 0.5}], None, 1),
        (True, [{"score": INF, "gate": 0.5}, {"score": 0.3, "gate": 0.5}], None, 1),
        # Equal scores: the first reported wins, in whatever order Ray lists them.
        (True, [{"score": 0.9, "gate": 0.1}, {"score": 0.9, "gate": 0.2}], [1, 0], 0),
        (False, [{"score": 0.2, "gate": 0.1}, {"score": 0.2, "gate": 0.2}, {"score": 0.5, "gate": 0.3}], [2, 1, 0], 0),
        # The gate compares the chosen checkpoint's gate metric: a report without it, or with a NaN, never wins.
        (True, [{"score": 0.9}, {"score": 0.8, "gate": 0.4}], None, 1),
        (True, [{"score": 0.9, "gate": NAN}, {"score": 0.8, "gate": 0.4}], None, 1),
    ],
)
def test_the_best_checkpoint_has_finite_scores_for_both_metrics_and_ties_go_to_the_first(
    tmp_path: Path, higher_is_better: bool, reports: list[dict[str, Any]], ray_order: list[int] | None, chosen: int
) -> None:
    spec = _spec(Metric("score", higher_is_better=higher_is_better), gate_metric="gate")
    checkpoint, metrics = best_checkpoint(_result(tmp_path, reports, ray_order), spec, "20260101-000000-abcdef")
    assert checkpoint.path.endswith(f"checkpoint_{chosen}") and metrics == reports[chosen]


@pytest.mark.parametrize(
    ("reports", "says"),
    [
        ([{"score": NAN, "gate": 0.5}, {"score": INF, "gate": 0.5}], r"\['score'\] .*only as NaN .*diverged"),
        ([{"score": 0.9, "gate": NAN}, {"score": NAN, "gate": 0.4}], r"holds \['gate', 'score'\] together as finite"),
        ([{"score": 0.9}, {"gate": 0.4}], r"holds \['gate', 'score'\] together as finite"),
        ([{"score": 0.9}], r"never reported \['gate'\] .*\(it reported \['score'\]\).*resume=20260101-000000-abcdef"),
    ],
    ids=["diverged", "never both finite", "never both", "never the gate metric"],
)
def test_a_fit_whose_reports_never_hold_both_metrics_finite_gives_no_model(
    tmp_path: Path, reports: list[dict[str, Any]], says: str
) -> None:
    """A UserCodeError (not retried) saying which metric is missing or diverged. Only a metric never reported can
    be fixed by naming another one and resuming; the others need a new run."""
    spec = _spec(Metric("score", higher_is_better=True), gate_metric="gate")
    with pytest.raises(UserCodeError, match=says) as raised:
        best_checkpoint(_result(tmp_path, reports), spec, "20260101-000000-abcdef")
    assert ("resume=" in str(raised.value)) == ("never reported" in str(raised.value))


def _spec(metric: Metric, **options: Any) -> TrainFunc:
    return TrainFunc(
        lambda config: None,
        metric=metric,
        load_model=lambda path, config: torch.nn.Linear(1, 1),
        input_example=lambda config: torch.zeros(1, 1),
        **options,
    )


# A train_func of user code that reports a checkpoint each epoch with REPORT, and counts the reports Ray Train took.
OWN_CODE = """
import tempfile, ray.train, torch
from raytrain_tasks.api import Metric, TrainFunc

TAKEN = []

def train_func(config):
    for epoch in range(config["epochs"]):
        with tempfile.TemporaryDirectory() as folder:
            open(f"{folder}/state.pt", "wb").write(b"the weights of an epoch")
            saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report(REPORT)
            TAKEN.append(epoch)

training = TrainFunc(
    train_func,
    metric=Metric("val_loss", higher_is_better=False),
    load_model=lambda path, config: torch.nn.Linear(1, 1),
    input_example=lambda config: torch.zeros(1, 1),
)
"""


@pytest.mark.usefixtures("local_mode")
@pytest.mark.parametrize(
    ("report", "says"),
    [
        (
            '{"epoch": epoch, "loss": 0.5}, checkpoint=saved',
            r"reported a checkpoint without 'val_loss' as a number \(its report holds \['epoch', 'loss'\]\)",
        ),
        (
            '{"epoch": epoch, "val_loss": 0.5}, checkpoint=saved, checkpoint_dir_name=f"epoch_{epoch}"',
            r"passed checkpoint_dir_name='epoch_0' to ray.train.report",
        ),
        ('{"epoch": epoch, "val_loss": 0.5}, checkpoint=saved', None),
    ],
    ids=["without the metric", "a folder name of its own", "as it should"],
)
def test_a_report_ray_train_would_keep_wrongly_is_refused_on_the_worker_before_ray_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: str, says: str | None
) -> None:
    """Ray Train scores a checkpoint whose report lacks the metric as -inf times the direction: for a lower-is-better
    metric, best, so it keeps those and deletes the ones that have it. A checkpoint named by the code
    (`checkpoint_dir_name`) is one the pipeline cannot verify or resume from by its name. Either is refused at the
    first report, on the worker, before Ray Train takes it: a UserCodeError (not retried) naming what to change."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    name = "own_" + re.sub(r"\W", "_", tmp_path.name)  # a module of its own per case: imports are cached
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(OWN_CODE).replace("REPORT", report))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(tmp_path, train_code=f"{name}:training", epochs=2, num_workers=1)
    worker, loop_config, _ = trainer_function(fit_context(config, "20261206-100000-abcdef"), "")
    trainer = TorchTrainer(lambda: worker(loop_config), scaling_config=ScalingConfig(num_workers=0))
    if says is None:
        trainer.fit()
        assert sys.modules[name].TAKEN == [0, 1]
        return
    with pytest.raises(UserCodeError, match=says):
        trainer.fit()
    assert sys.modules[name].TAKEN == []  # the first report was refused: Ray Train took nothing


@pytest.mark.usefixtures("local_mode")
@pytest.mark.parametrize("holder", ["this-driver", "another-driver", None], ids=["held", "taken over", "gone"])
def test_a_fit_whose_driver_lost_the_lease_commits_no_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, holder: str | None
) -> None:
    """Only the driver renews and watches the run's lease. A driver frozen past it (a paused VM,
    Ctrl-Z) cannot stop its Ray Train controller and workers, which went on committing checkpoints beside the new
    driver's. Every rank now checks the lease before each checkpoint and stops with RunLeaseLostError."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytrain_tasks.errors import RunLeaseLostError

    name = "own_" + re.sub(r"\W", "_", tmp_path.name)
    report = '{"epoch": epoch, "val_loss": 0.5}, checkpoint=saved'
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(OWN_CODE).replace("REPORT", report))
    monkeypatch.syspath_prepend(str(tmp_path))
    lease = tmp_path / "runs" / "20261206-100000-abcdef" / "raytrain_driver.lease"
    lease.parent.mkdir(parents=True)
    if holder is not None:
        lease.write_text(json.dumps({"holder": holder, "duration_s": 60.0, "renewals": 3}))
    config = small_config(tmp_path, train_code=f"{name}:training", epochs=2, num_workers=1)
    held = HeldLease(locate(str(lease)), "20261206-100000-abcdef", "this-driver", 60.0, "", time.monotonic())
    worker, loop_config, _ = trainer_function(fit_context(config, "20261206-100000-abcdef", lease=held), "")
    trainer = TorchTrainer(lambda: worker(loop_config), scaling_config=ScalingConfig(num_workers=0))
    if holder == "this-driver":
        trainer.fit()
        assert sys.modules[name].TAKEN == [0, 1]
        return
    with pytest.raises(RunLeaseLostError, match="held by another-driver" if holder else "is gone"):
        trainer.fit()
    assert sys.modules[name].TAKEN == []


def test_a_lease_lost_on_a_worker_stops_the_fit_and_leaves_the_mlflow_run_to_its_holder(tmp_path: Path) -> None:
    """The controller ends the fit on it (a restarted worker group would find the lease taken again), and the
    driver, which may not have seen the lease taken yet, leaves the MLflow run alone: it is the new holder's."""
    import ray.train
    from mlflow import MlflowClient

    from raytrain_driver.fit import _end_unfinished_run
    from raytrain_tasks.errors import RunLeaseLostError

    lost = RunLeaseLostError("the run's lease is held by another-driver")
    with pytest.raises(RunLeaseLostError, match="worker rank 1: the run's lease is held by another-driver") as ended:
        code_error_stopper("my_code:training", "val_loss").after_exception(None, {1: lost})
    config = small_config(tmp_path)
    client = MlflowClient(config.mlflow_tracking_uri)
    run_id = client.create_run(client.create_experiment("lease")).info.run_id
    with pytest.raises(RunLeaseLostError, match="training run 20261206-100000-abcdef: worker rank 1"):
        context = fit_context(config, "20261206-100000-abcdef", spec=object(), client=client)
        _end_unfinished_run(ray.train.ControllerError(ended.value), context, run_id)
    assert client.get_run(run_id).info.status == "RUNNING"  # not FAILED: the new holder trains it


def test_a_checkpoint_ray_train_attaches_a_report_without_the_metric_to_stops_the_fit_at_once(tmp_path: Path) -> None:
    """Ray Train attaches rank 0's metrics to a checkpoint any rank reports: where rank 0 passed none, only the
    controller sees that the checkpoint's report lacks the metric. It stops the fit there (a UserCodeError, not
    retried); a report without a checkpoint, or with the metric, goes on."""
    stopper = code_error_stopper("my_code:training", "val_loss")
    saved = _checkpoint(tmp_path / "checkpoint_2026-01-01_00-00-00.000000")
    stopper.after_report(None, [{"epoch": 0, "loss": 0.5}, {"epoch": 0, "val_loss": 0.4}], None)
    stopper.after_report(None, [{"epoch": 0, "val_loss": 0.4}, {"epoch": 0}], saved)
    with pytest.raises(UserCodeError, match=r"without 'val_loss' as a number \(its report holds \['epoch', 'loss'\]\)"):
        stopper.after_report(None, [{"epoch": 1, "loss": 0.5}, {"epoch": 1, "val_loss": 0.4}], saved)
