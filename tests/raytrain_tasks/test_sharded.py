"""Checkpoints written by every rank: examples/fsdp_sharded shards its model with FSDP2 and saves it
with torch.distributed.checkpoint from both ranks. A killed worker resumes from the last checkpoint in one
MLflow run that ends where an uninterrupted one does; a checkpoint missing one rank's shard is never resumed
from (the run continues from the one before it and records why); one registered version loads and predicts.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow import MlflowClient

from flows.training import training_pipeline
from raytrain_tasks.config import parameters_of
from tests.helpers import mlflow_client, only_run, run_killing_a_worker, small_config

pytestmark = [pytest.mark.slow]

FSDP = "examples.fsdp_sharded.train:training"
EPOCHS = 4


def fsdp_config(workdir: Path, **overrides: Any) -> Any:
    return small_config(
        workdir,
        train_code=FSDP,
        **{"epochs": EPOCHS, "register": False, "checkpoints_to_keep": 10, "train_config": '{"hidden": 64}'}
        | overrides,
    )


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory, ray_cluster: Any, prefect_api: Any) -> SimpleNamespace:
    """An uninterrupted sharded run: what a killed one must end as, and the checkpoints a resume is tried on."""
    workdir = tmp_path_factory.mktemp("fsdp-reference")
    return SimpleNamespace(workdir=workdir, result=training_pipeline(**parameters_of(fsdp_config(workdir))))


@pytest.mark.chaos
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_sharded_run_with_a_killed_worker_ends_as_an_uninterrupted_one_and_registers_one_model(
    tmp_path: Path, fsdp_reference: SimpleNamespace
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
    expected = {int(entry["epoch"]) + 1: entry for entry in fsdp_reference.result.fit.history}
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


def test_a_checkpoint_missing_a_ranks_shard_is_passed_over_and_the_run_says_why(
    fsdp_reference: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rank's shard is in each committed checkpoint and the digest MLflow recorded at commit covers them all.
    One rank's shard is then deleted from the newest checkpoint of the run (left as a driver killed before its
    record leaves it): the resume continues from the checkpoint before it, in the same MLflow run, says why, and
    logs every epoch once."""
    from raytrain_tasks.integrity import local_folder_digest
    from raytrain_tasks.tracking.names import pinned_digests

    workdir, run_key = fsdp_reference.workdir, fsdp_reference.result.run_key
    run_dir = workdir / "storage" / "runs" / run_key
    run_before = only_run(workdir)
    assert run_before.info.status == "FINISHED"
    pinned = pinned_digests(run_before.data.tags)
    committed = sorted(p.name for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert len(committed) == EPOCHS and sorted(pinned) == committed, (committed, pinned)
    for name in committed:
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {f.name for f in (run_dir / name).iterdir()}, name
        assert local_folder_digest(run_dir / name) == pinned[name], f"{name}: the pin covers every rank's files"
    newest, before = committed[-1], committed[-2]
    (run_dir / newest / "__1_0.distcp").unlink()
    (run_dir / "fit.json").unlink()

    resumed = training_pipeline(**parameters_of(fsdp_config(workdir, resume=run_key)))
    said = [record.getMessage() for record in caplog.records]
    assert any(f"resumes from checkpoint {before}, not a newer one" in line for line in said), said[-40:]
    assert not resumed.fit.best_checkpoint_uri.rstrip("/").endswith(newest)
    run = only_run(workdir)
    assert run.info.run_id == run_before.info.run_id and run.info.status == "FINISHED"
    assert newest in run.data.tags["prefect_raytrain.resume_fallback"]
    history = mlflow_client(workdir).get_metric_history(run.info.run_id, "val_accuracy")
    assert sorted(m.step for m in history) == list(range(1, EPOCHS + 1))
