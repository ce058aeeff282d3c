"""The controller's record of a checkpoint committed within an epoch while MLflow is down: its pin goes to the
run's pin journal, and the driver copies it into MLflow once it is back, so a resume can start from it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import ray.train
from mlflow import MlflowClient

from raytrain_tasks.integrity import folder_digest
from raytrain_tasks.tracking import pins
from raytrain_tasks.tracking.controller import MlflowEpochLogger
from raytrain_tasks.tracking.names import pin_tag, pinned_digests
from raytrain_tasks.tracking.pin_journal import PinJournal
from tests.helpers import free_port


def test_a_checkpoint_within_an_epoch_committed_while_mlflow_is_down_is_pinned_from_the_journal(
    tmp_path: Path,
) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outage")).info.run_id
    folder = tmp_path / "epoch-0002-step-00000018"
    folder.mkdir()
    (folder / "spec_state.pt").write_bytes(b"the model at step 18")
    checkpoint = ray.train.Checkpoint(str(folder), filesystem=pafs.LocalFileSystem())
    journal = PinJournal.for_run(tmp_path / "journal", "20261206-000000-abcdef")
    down = f"http://127.0.0.1:{free_port()}"  # no MLflow server there: every request is refused
    logger = MlflowEpochLogger(down, run_id, journal=journal)

    within = {"in_epoch": 1, "global_step": 18, "step_train_loss": 0.25, "val_accuracy": float("nan")}
    logger.after_report(None, [within], checkpoint)  # logged as a warning, not raised

    assert pinned_digests(client.get_run(run_id).data.tags) == {}
    assert pins.pins_from_journal(client, run_id, journal) == [folder.name]
    tags = client.get_run(run_id).data.tags
    assert tags[pin_tag(folder.name)] == folder_digest(pafs.LocalFileSystem(), str(folder))
    assert client.get_run(run_id).data.metrics == {}  # no epoch's metrics for it: it has none
