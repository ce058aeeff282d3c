"""The fit task's run page (tasks/run_page.py): its progress display is best effort, and never replaces the fit's
own outcome."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tests.helpers import free_port, stop_process_group


def test_an_mlflow_outage_at_the_start_of_the_progress_display_leaves_the_fit_its_own_error(
    monkeypatch: Any, caplog: Any
) -> None:
    """MLflow unreachable when the display starts: the fit's error is the one that propagates, and a warning says
    the display is off (before, the display's MlflowException replaced it: a retryable failure)."""
    import logging

    from raytrain_tasks.errors import CheckpointError
    from tasks.run_page import EpochProgress

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    client = MlflowClient(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    logger = logging.getLogger("prt-progress-test")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        try:
            with EpochProgress(client, "0" * 32, 3, logger):
                raise CheckpointError("the fit's own error")
        except CheckpointError as exc:
            assert "the fit's own error" in str(exc)
        else:
            raise AssertionError("the fit's error did not propagate")
    assert any("progress" in record.getMessage() for record in caplog.records), caplog.text


@pytest.mark.slow
def test_an_mlflow_outage_at_the_end_of_the_progress_display_masks_neither_an_error_nor_a_success(
    tmp_path: Path, prefect_api: None, monkeypatch: Any, caplog: Any
) -> None:
    """A real `mlflow server` answers when the display starts and is gone when the fit ends: a propagating
    error stays the fit's own; a fit that succeeded still succeeds (the display's last poll only warns)."""
    import logging

    from raytrain_tasks.errors import CheckpointError
    from tasks.run_page import EpochProgress
    from tests.helpers import start_mlflow_server

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    logger = logging.getLogger("prt-progress-test")
    for outcome in ("error", "success"):
        root = tmp_path / outcome
        root.mkdir()
        port = free_port()
        server = start_mlflow_server(root, port)
        try:
            client = MlflowClient(f"http://127.0.0.1:{port}")
            run_id = client.create_run(client.create_experiment("progress")).info.run_id
            with caplog.at_level(logging.WARNING, logger=logger.name):
                try:
                    with EpochProgress(client, run_id, 3, logger):
                        stop_process_group(server)  # MLflow goes away during the fit
                        if outcome == "error":
                            raise CheckpointError("the fit's own error")
                except CheckpointError as exc:
                    assert outcome == "error" and "the fit's own error" in str(exc)
                else:
                    assert outcome == "success"
        finally:
            stop_process_group(server)
        assert any("progress" in record.getMessage() for record in caplog.records), caplog.text
        caplog.clear()


def test_code_that_trains_past_epochs_is_told_to_read_config_epochs_once(caplog: Any) -> None:
    """A train_func ported from Ray's docs reads its own `num_epochs`: at the first step past `epochs` the log says
    to read config['epochs'] (once), and the run page's progress stops at 100%, not 166.7%."""
    import logging

    from tasks.run_page import EpochProgress

    logger = logging.getLogger("prt-progress-test")
    progress = EpochProgress(None, "0" * 32, 3, logger)  # type: ignore[arg-type]  # no MLflow: steps handed in
    history = {"val_loss": {step: 1.0 / step for step in range(1, 6)}}
    with caplog.at_level(logging.INFO, logger=logger.name):
        progress._log_committed([1, 2, 3], history)
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
        progress._log_committed([4, 5], history)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step 4 of `epochs` 3" in warnings[0] and "config['epochs']" in warnings[0]
    assert "epoch 5/3 committed" in caplog.text and progress._percent() == 100.0


def test_a_train_specs_epoch_line_shows_its_losses_and_metrics_and_the_epochs_seconds(caplog: Any) -> None:
    """A TrainSpec's loop reports its timing figures and its test-split scores every epoch beside its losses and
    metrics: its epoch line showed them all, by name (`epoch_seconds=0.1032 samples_per_second=12425.3162
    test_accuracy=...`); it shows what the built-in classifier's line shows (train loss, val loss, val metrics, and
    the epoch's seconds). A train_func's line still shows every metric it reports."""
    import logging

    import torch

    from raytrain_driver.fit_steps import left_off
    from raytrain_driver.hooks import EpochView
    from raytrain_tasks.api import Metric, Splits, TrainFunc, TrainSpec
    from raytrain_tasks.trainspec.loop import as_train_func
    from tasks.run_page import EpochProgress

    spec = TrainSpec(
        data=lambda config: Splits(*([(torch.zeros(1), torch.zeros(()))] * 3)),
        model=lambda config, example: torch.nn.Linear(1, 1),
        loss=torch.nn.functional.mse_loss,
        metrics=lambda outputs, targets: {"accuracy": torch.tensor(0.0)},
        metric=Metric("accuracy", higher_is_better=True),
    )
    func = TrainFunc(lambda config: None, metric=Metric("val_accuracy", higher_is_better=True))
    reported = ("epoch_seconds", "samples_per_second", "test_accuracy", "test_loss", "train_loss", "val_accuracy")
    history = {key: {1: 0.5} for key in (*reported, "val_loss", "workers")}
    logger = logging.getLogger("prt-progress-test")
    lines = {}
    for kind, code in (("spec", as_train_func(spec)), ("func", func)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=logger.name):
            progress = EpochProgress(None, "0" * 32, 3, logger, EpochView(left_off=left_off(code)))  # type: ignore[arg-type]
            progress._log_committed([1], history)
        lines[kind] = caplog.records[-1].getMessage()
    assert lines["spec"] == "epoch 1/3 committed: train_loss=0.5000 val_loss=0.5000 val_accuracy=0.5000 (0.5 s)"
    assert lines["func"].startswith("epoch 1/3 committed: train_loss=0.5000 val_loss=0.5000 val_accuracy=0.5000")
    assert "test_accuracy=0.5000" in lines["func"] and "epoch_seconds=0.5000" in lines["func"], lines
