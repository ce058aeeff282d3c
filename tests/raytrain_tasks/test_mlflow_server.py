"""Against a real `mlflow server` over HTTP: browse what a user sees in the UI, and trust the champion alias."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from flows.training import PipelineResult, training_pipeline
from raytrain_tasks.config import parameters_of
from raytrain_tasks.table_classifier.data import read_split
from tests.helpers import small_config, table_dataset

EXPERIMENT = "server-tests"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def served_run(
    mlflow_server: str, tmp_path_factory: pytest.TempPathFactory, ray_cluster: object, prefect_api: None
) -> PipelineResult:
    workdir = tmp_path_factory.mktemp("served")
    return training_pipeline(
        **parameters_of(
            small_config(
                workdir,
                mlflow_tracking_uri=mlflow_server,
                experiment_name=EXPERIMENT,
                model_name="served",
                system_metrics=True,
            )
        )
    )


@pytest.mark.slow
def test_a_run_as_the_ui_shows_it(served_run: PipelineResult, mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None

    # Found by its name (after the Prefect flow run) and by its run-key tag.
    by_tag = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`prefect_raytrain.run_key` = '{served_run.run_key}'"
    )
    (run,) = by_tag
    by_name = client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = '{run.info.run_name}'"
    )
    assert [r.info.run_id for r in by_name] == [run.info.run_id]
    assert run.info.run_name.endswith(served_run.run_key)
    tags = run.data.tags
    assert tags["prefect.flow_run_id"]
    assert tags["prefect_raytrain.dataset_hash"] == served_run.dataset.content_hash
    assert tags["prefect_raytrain.backend"] == "gloo" and tags["prefect_raytrain.num_workers"] == "2"
    assert run.data.params["learning_rate"] == str(served_run.config.learning_rate)

    for key in ("train_loss", "val_loss", "val_accuracy", "epoch_seconds", "samples_per_second"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3]
    assert float(tags["summary.best_val_accuracy"]) >= 0.9 and "best_val_accuracy" not in run.data.metrics
    # Through the REST API too: the kept checkpoints are LoggedModels with their epoch's metrics linked.
    checkpoints = client.search_logged_models(
        [experiment.experiment_id],
        filter_string=f"source_run_id = '{run.info.run_id}'",
        order_by=[{"field_name": "metrics.val_accuracy", "ascending": False}],
    )
    checkpoints = [m for m in checkpoints if m.model_type == "checkpoint"]
    assert len(checkpoints) == served_run.config.checkpoints_to_keep
    best = next(m for m in checkpoints if m.model_id == served_run.fit.best_checkpoint_model_id)
    assert {m.key for m in best.metrics} >= {"val_accuracy", "best_checkpoint_test_accuracy"}
    assert any(key.startswith("system/cpu_utilization") for key in run.data.metrics)  # system_metrics=True

    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.digest == served_run.dataset.content_hash[:36]  # MLflow keeps 36 characters

    artifacts = {a.path: a for a in client.list_artifacts(run.info.run_id, "evaluation")}
    for name in ("learning_curves.png", "confusion_matrix.png"):
        artifact = artifacts[f"evaluation/{name}"]
        assert artifact.file_size and artifact.file_size > 5_000
        local = client.download_artifacts(run.info.run_id, artifact.path, str(tmp_path))
        assert Path(local).read_bytes()[:8] == PNG_MAGIC
    for name in ("per_class_report.json", "dataset_summary.json", "checkpoint.json"):
        assert artifacts[f"evaluation/{name}"].file_size
    per_class = Path(client.download_artifacts(run.info.run_id, "evaluation/per_class_report.json", str(tmp_path)))
    assert len(json.loads(per_class.read_text())["per_class"]) == 10  # every digit class


@pytest.mark.slow
def test_champion_over_http_loads_and_predicts(served_run: PipelineResult, mlflow_server: str) -> None:
    import mlflow

    client = MlflowClient(mlflow_server)
    version = client.get_model_version_by_alias("served", "champion")
    assert served_run.model is not None and str(version.version) == served_run.model.version
    assert version.tags["run_key"] == served_run.run_key
    assert version.tags["promotion.decision"] == "promote"
    assert "champion" in client.get_registered_model("served").aliases
    mlflow.set_tracking_uri(mlflow_server)
    model = mlflow.pyfunc.load_model("models:/served@champion")
    table = table_dataset(served_run.dataset)
    x_val, y_val = read_split(table, "test", standardised=False)  # raw features; score is on test
    accuracy = float((np.asarray(model.predict(x_val)).argmax(axis=1) == y_val).mean())
    assert accuracy == pytest.approx(served_run.model.score, abs=1e-9)


@pytest.mark.slow
def test_the_run_page_shows_the_learning_curves_and_links_the_version(
    served_run: PipelineResult, mlflow_server: str
) -> None:
    """The Prefect run page: the learning curves as an image artifact (served by the MLflow server) and links
    to the MLflow run and the registered version."""
    import urllib.request
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    run = MlflowClient(mlflow_server).get_run(served_run.fit.mlflow_run_id)
    flow_run_id = UUID(run.data.tags["prefect.flow_run_id"])
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    by_key = {artifact.key: artifact for artifact in artifacts if artifact.key}
    image = by_key["learning-curves"]
    assert image.type == "image" and str(image.data).startswith(mlflow_server)
    with urllib.request.urlopen(str(image.data), timeout=30) as reply:
        assert reply.read()[:8] == PNG_MAGIC
    summary = str(by_key["training-summary"].data)
    assert served_run.model is not None
    assert f"{mlflow_server}/#/models/served/versions/{served_run.model.version})" in summary
    assert f"{mlflow_server}/#/experiments/{served_run.fit.mlflow_experiment_id}/runs/{run.info.run_id}" in summary
    assert f"![learning curves]({image.data})" in summary
