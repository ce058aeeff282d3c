"""The whole flow on real components: local Ray (2 workers), the Prefect API, MLflow on SQLite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from flows.training import PipelineResult, training_pipeline
from raytrain_driver.champion_history import read_history
from raytrain_tasks.config import parameters_of
from raytrain_tasks.integrity import local_folder_digest
from raytrain_tasks.table_classifier.data import LABEL_INDEX_COLUMN
from raytrain_tasks.tracking.names import EPOCH_METRICS, STEP_SERIES, pin_tag
from tests.helpers import small_config, table_dataset

TABLE_CLASSIFIER = "raytrain_tasks.table_classifier:classifier"

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster", "prefect_api")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def first_run(workdir: Path, ray_cluster: object, prefect_api: None) -> PipelineResult:
    exported = os.environ.get("MLFLOW_TRACKING_URI")
    result = training_pipeline(**parameters_of(small_config(workdir)))
    # A run leaves the process's MLflow settings as it found them: the next run's default is not redirected.
    assert os.environ.get("MLFLOW_TRACKING_URI") == exported
    return result


@pytest.fixture(scope="module")
def client(first_run: PipelineResult) -> MlflowClient:
    return MlflowClient(first_run.config.mlflow_tracking_uri)


def test_two_workers_three_epochs_reach_accuracy(first_run: PipelineResult) -> None:
    assert first_run.fit.epochs_completed == 3
    assert first_run.fit.backend == "gloo"
    assert first_run.fit.final_metrics["val_accuracy"] >= 0.90


def test_every_epoch_checkpointed_in_storage_keeping_the_best(first_run: PipelineResult, workdir: Path) -> None:
    run_dir = workdir / "storage" / "runs" / first_run.run_key
    kept = sorted(p.name for p in run_dir.glob("epoch-*"))
    # checkpoints_to_keep=2: the two best by val_accuracy survive (the latest always does). Folders are named by
    # the epoch's number, as the console counts: epoch-0003 holds "epoch 3/3".
    assert kept == ["epoch-0002", "epoch-0003"]
    # Each as committed: its folder hashes to the digest the fit pinned in the MLflow run.
    tags = MlflowClient(first_run.config.mlflow_tracking_uri).get_run(first_run.fit.mlflow_run_id).data.tags
    for name in kept:
        assert tags[pin_tag(name)] == local_folder_digest(run_dir / name)
    assert Path(first_run.fit.best_checkpoint_uri) == run_dir / f"epoch-{first_run.fit.best_epoch:04d}"


def test_mlflow_run_has_each_epoch_exactly_once(first_run: PipelineResult, client: MlflowClient) -> None:
    run = client.get_run(first_run.fit.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect_raytrain.run_key"] == first_run.run_key
    assert run.data.params["num_workers"] == "2" and run.data.params["epochs"] == "3"
    assert run.data.tags["prefect.flow_run_id"]
    assert run.data.tags.get("prefect.flow_run_url", "http").startswith("http")  # a link, or none at all
    # The MLflow UI shows a source and a description, not "Source —" and "No description".
    assert run.data.tags["mlflow.source.name"] == "flows/training.py:training_pipeline"
    assert run.data.tags["mlflow.source.type"] == "JOB" and run.data.tags["mlflow.source.git.commit"]
    description = run.data.tags["mlflow.note.content"]
    assert f"resume={first_run.run_key}" in description and first_run.config.storage_path in description
    assert run.data.tags["prefect.flow_run_id"] in description and "3 epochs" in description
    for key in EPOCH_METRICS:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == [1, 2, 3], key  # MLflow's step is the epoch number
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_accuracy")}
    assert history[3] == pytest.approx(first_run.fit.final_metrics["val_accuracy"])


def test_one_epoch_numbering_and_the_summary_as_a_table(first_run: PipelineResult, client: MlflowClient) -> None:
    """The epoch a person reads is the same number in the summary, MLflow's step, tags, description and folder,
    and the summary values are not metrics (the MLflow UI would draw each as a one-point chart)."""
    run = client.get_run(first_run.fit.mlflow_run_id)
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val_accuracy")}
    best = first_run.fit.best_epoch
    assert history[best] == max(history.values())
    assert first_run.fit.best_checkpoint_uri.endswith(f"/epoch-{best:04d}")
    # Every metric is an epoch's (one point per epoch) but the best checkpoint's held-out scores, logged once.
    scores = {key for key in run.data.metrics if key.startswith("best_checkpoint_")}
    assert scores == {f"best_checkpoint_{key}" for key in first_run.fit.scores}
    per_epoch = set(run.data.metrics) - scores - {key for key in run.data.metrics if key.startswith("system/")}
    per_epoch -= {STEP_SERIES}  # by global step: below
    assert per_epoch >= {"train_loss", "val_loss", "val_accuracy"}
    for key in per_epoch:
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [1, 2, 3], key
    # The step series' x-axis is the global step: at each epoch's end (no checkpoints within), the epoch's train loss.
    series = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, STEP_SERIES))
    steps_per_epoch = series[0][0]
    assert [step for step, _ in series] == [steps_per_epoch * epoch for epoch in (1, 2, 3)], series
    losses = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train_loss"))
    assert [value for _, value in series] == pytest.approx([value for _, value in losses], abs=1e-9)
    tags = run.data.tags
    assert tags["summary.best_epoch"] == str(best)
    assert float(tags["summary.best_val_accuracy"]) == pytest.approx(history[best], abs=1e-6)
    assert float(tags["summary.final_val_accuracy"]) == pytest.approx(history[3], abs=1e-6)
    description = tags["mlflow.note.content"]
    assert f"| best by val_accuracy: {best} |" in description and "| final: 3 |" in description
    assert description.count("#### Result") == 1


def test_kept_checkpoints_are_logged_models_and_the_version_links_its_model_and_run(
    first_run: PipelineResult, client: MlflowClient, workdir: Path
) -> None:
    """MLflow 3: each kept checkpoint is a LoggedModel with its epoch's metrics (the best one is a sort in the
    Models tab), and the registered version points to its LoggedModel and its run."""
    fit = first_run.fit
    models = client.search_logged_models(
        [fit.mlflow_experiment_id],
        filter_string=f"source_run_id = '{fit.mlflow_run_id}'",
        order_by=[{"field_name": "metrics.val_accuracy", "ascending": False}],
    )
    checkpoints = [m for m in models if m.model_type == "checkpoint"]
    run_dir = workdir / "storage" / "runs" / first_run.run_key
    assert sorted(m.name for m in checkpoints) == sorted(p.name for p in run_dir.glob("epoch-*"))
    history = {m.step: m.value for m in client.get_metric_history(fit.mlflow_run_id, "val_accuracy")}
    for model in checkpoints:
        epoch = int(model.name.removeprefix("epoch-"))
        assert str(model.status).endswith("READY") and model.tags["prefect_raytrain.epoch"] == str(epoch)
        assert model.tags["prefect_raytrain.checkpoint_uri"] == str(run_dir / model.name)
        linked = {m.key: m for m in model.metrics}
        assert linked["val_accuracy"].step == epoch and linked["val_accuracy"].value == history[epoch]
    # The best first, by the sort alone (two epochs can tie on val_accuracy: the fit's pick is one of the tied).
    accuracy = {m.model_id: next(x.value for x in m.metrics if x.key == "val_accuracy") for m in checkpoints}
    top = [m.model_id for m in checkpoints if accuracy[m.model_id] == accuracy[checkpoints[0].model_id]]
    assert accuracy[checkpoints[0].model_id] == max(accuracy.values()) and fit.best_checkpoint_model_id in top
    best = next(m for m in checkpoints if m.model_id == fit.best_checkpoint_model_id)
    assert {m.key for m in best.metrics} >= {"best_checkpoint_test_accuracy", "train_loss"}
    # Linking re-logged the run's own points: the run still has each epoch once.
    assert sorted(history) == [1, 2, 3] and len(client.get_metric_history(fit.mlflow_run_id, "val_accuracy")) == 3

    assert first_run.model is not None
    version = client.get_model_version(first_run.model.name, first_run.model.version)
    # The version's source is its LoggedModel (models:/<model_id>), which the MLflow UI links, and its run.
    assert version.source.startswith("models:/m-") and version.run_id == fit.mlflow_run_id
    registered = client.get_logged_model(version.source.removeprefix("models:/"))
    assert registered.source_run_id == fit.mlflow_run_id
    assert registered.tags["prefect_raytrain.checkpoint_model_id"] == fit.best_checkpoint_model_id
    scores = {m.key: m.value for m in registered.metrics}
    assert scores["best_checkpoint_test_accuracy"] == pytest.approx(fit.scores["test_accuracy"])


def test_champion_loads_and_reproduces_logged_accuracy(first_run: PipelineResult, client: MlflowClient) -> None:
    import mlflow

    assert first_run.model is not None and first_run.model.aliases == ("champion",)
    # The promotion is the first move in the model's champion history: the version, its run, why.
    first = read_history(client, first_run.model.name)[0].moves[0]
    assert (first.version, first.run_key) == (first_run.model.version, first_run.run_key)
    assert first.reason == "no champion yet"
    mlflow.set_tracking_uri(first_run.config.mlflow_tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/{first_run.model.name}@champion")
    table = table_dataset(first_run.dataset)
    val = pd.read_parquet(Path(table.uri) / "val.parquet")
    features = np.array(val[list(table.feature_names)], dtype=np.float32)
    predicted = np.asarray(model.predict(features)).argmax(axis=1)
    accuracy = float((predicted == val[LABEL_INDEX_COLUMN].to_numpy()).mean())
    logged = {m.step: m.value for m in client.get_metric_history(first_run.fit.mlflow_run_id, "val_accuracy")}
    assert accuracy == pytest.approx(logged[first_run.fit.best_epoch], abs=1e-9)


def test_the_logged_model_stores_no_real_row_by_default(first_run: PipelineResult) -> None:
    """`input_example='synthetic'` (the default): the artifact store holds the schema, not a record of the data."""
    import json

    import mlflow

    assert first_run.config.train_config.get("input_example", "synthetic") == "synthetic"
    assert first_run.model is not None
    mlflow.set_tracking_uri(first_run.config.mlflow_tracking_uri)
    info = mlflow.models.get_model_info(f"models:/{first_run.model.name}/{first_run.model.version}")
    local = Path(mlflow.artifacts.download_artifacts(info.model_uri))
    example = json.loads((local / "input_example.json").read_text())
    if isinstance(example, dict):  # {"inputs": ...} or {"data": ...} depending on the example's type
        example = example.get("inputs", example.get("data"))
    rows = np.asarray(example, dtype=np.float32)
    table = table_dataset(first_run.dataset)
    assert rows.shape[1] == len(table.feature_names)
    stored = np.concatenate(
        [
            pd.read_parquet(Path(table.uri) / f"{split}.parquet")[list(table.feature_names)].to_numpy(dtype=np.float32)
            for split in ("train", "val", "test")
        ]
    )
    for row in rows:
        assert not (np.abs(stored - row).max(axis=1) < 1e-6).any(), "a real row of the dataset was logged"


@pytest.fixture(scope="module")
def challenger(first_run: PipelineResult, client: MlflowClient, workdir: Path) -> tuple[PipelineResult, dict[str, str]]:
    """A worse model (one epoch at a tiny step size) registered into the first run's model, and the tags of the
    champion it was judged against. That champion (the first run's version) is tagged as the built-in classifier
    of releases up to 0.2 tagged its versions: no train_code, its gate in other tags. The table classifier, which
    trains the same model on the same table, registers into the same model and is compared with it; it was
    incomparable, and every one of its models stayed `challenger`. The tags are put back after."""
    from raytrain_driver.register_steps import GATE_DIRECTION_TAG, GATE_METRIC_TAG, TRAIN_CODE_TAG

    assert first_run.model is not None
    name, version = first_run.model.name, first_run.model.version
    tags = client.get_model_version(name, version).tags
    removed = {tag: tags[tag] for tag in (TRAIN_CODE_TAG, GATE_METRIC_TAG, GATE_DIRECTION_TAG)}
    for tag in removed:  # what the built-in's versions lack
        client.delete_model_version_tag(name, version, tag)
    try:
        as_built_in = client.get_model_version(name, version).tags
        worse = training_pipeline(**parameters_of(small_config(workdir, epochs=1, learning_rate=1e-4, num_workers=1)))
    finally:
        for tag, value in removed.items():
            client.set_model_version_tag(name, version, tag, value)
    return worse, as_built_in


def test_champion_moves_only_for_a_better_model(
    first_run: PipelineResult,
    client: MlflowClient,
    workdir: Path,
    challenger: tuple[PipelineResult, dict[str, str]],
) -> None:
    assert first_run.model is not None
    name, first_version = first_run.model.name, first_run.model.version

    worse, _ = challenger
    assert worse.model is not None and worse.model.decision == "keep_champion"
    assert str(client.get_model_version_by_alias(name, "champion").version) == first_version
    assert str(client.get_model_version_by_alias(name, "challenger").version) == worse.model.version
    tags = client.get_model_version(name, worse.model.version).tags
    assert tags["promotion.decision"] == "keep_champion"
    assert float(tags["promotion.champion_score"]) == pytest.approx(first_run.model.score)

    better = training_pipeline(**parameters_of(small_config(workdir, epochs=8)))
    assert better.model is not None and better.model.decision == "promote", better.model.reason
    assert better.model.score > first_run.model.score
    assert str(client.get_model_version_by_alias(name, "champion").version) == better.model.version
    assert str(client.get_model_version_by_alias(name, "previous_champion").version) == first_version


def test_the_table_classifiers_model_is_judged_against_the_built_in_champion(
    first_run: PipelineResult, client: MlflowClient, challenger: tuple[PipelineResult, dict[str, str]]
) -> None:
    """Compared with the built-in's champion (the same pt2 model of the same table), scored on this run's test
    split by the spec's own evaluate, not kept as incomparable."""
    from raytrain_driver.register_steps import GATE_DIRECTION_TAG, GATE_METRIC_TAG, TRAIN_CODE_TAG

    result, champion_tags = challenger
    assert first_run.model is not None
    assert not {TRAIN_CODE_TAG, GATE_METRIC_TAG, GATE_DIRECTION_TAG} & set(champion_tags)
    assert {"schema.digest", "promotion.metric", "test_accuracy"} <= set(champion_tags)  # what they have
    assert result.config.train_code == TABLE_CLASSIFIER
    assert result.model is not None and result.model.name == first_run.model.name, result.model
    tags = client.get_model_version(first_run.model.name, result.model.version).tags
    assert tags["promotion.decision"] in ("promote", "keep_champion"), tags
    assert tags["promotion.champion_version"] == str(first_run.model.version), tags
    assert float(tags["promotion.champion_score"]) > 0.8, tags  # the built-in champion's test_accuracy, scored


def test_run_page_shows_progress_per_epoch_and_a_summary(first_run: PipelineResult, client: MlflowClient) -> None:
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    flow_run_id = UUID(client.get_run(first_run.fit.mlflow_run_id).data.tags["prefect.flow_run_id"])
    with get_client(sync_client=True) as prefect:
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        logs = prefect.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    (progress,) = [a for a in artifacts if a.type == "progress"]
    assert float(progress.data) == 100.0
    (summary,) = [a for a in artifacts if a.type == "markdown"]
    assert first_run.run_key in summary.data and first_run.fit.mlflow_run_id in summary.data
    assert f"version **{first_run.model.version}** -> champion" in summary.data
    # The metric table has one row per metric with its final and best value, and the split sizes are listed.
    final_accuracy = first_run.fit.final_metrics["val_accuracy"]
    assert f"| metric | final (epoch 3) | best (epoch {first_run.fit.best_epoch}) |" in summary.data, summary.data
    assert f"| val_accuracy | {final_accuracy:.4f} |" in summary.data, summary.data
    assert f"| train_loss | {first_run.fit.final_metrics['train_loss']:.4f} |" in summary.data
    assert first_run.dataset.content_hash in summary.data  # the stored version of the data it trained on
    # ... and what it holds, as its prepare said: "N train / N val / N test rows, F features, C classes".
    assert first_run.dataset.summary.endswith("classes") and first_run.dataset.summary in summary.data
    messages = [log.message for log in logs]
    for epoch in (1, 2, 3):
        assert sum(m.startswith(f"epoch {epoch}/3 committed:") for m in messages) == 1, messages


def test_resuming_a_finished_run_trains_and_registers_nothing_new(
    first_run: PipelineResult, client: MlflowClient, workdir: Path
) -> None:
    assert first_run.model is not None
    name = first_run.model.name
    versions_before = sorted(str(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    steps_before = [m.step for m in client.get_metric_history(first_run.fit.mlflow_run_id, "val_accuracy")]
    run_dir = workdir / "storage" / "runs" / first_run.run_key
    written = {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}

    again = training_pipeline(**parameters_of(small_config(workdir, resume=first_run.run_key)))
    assert again.fit.mlflow_run_id == first_run.fit.mlflow_run_id
    assert again.model is not None and again.model.version == first_run.model.version
    assert sorted(str(v.version) for v in client.search_model_versions(f"name = '{name}'")) == versions_before
    assert [m.step for m in client.get_metric_history(first_run.fit.mlflow_run_id, "val_accuracy")] == steps_before
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == written  # nothing retrained
    assert client.get_run(first_run.fit.mlflow_run_id).info.status == "FINISHED"


def test_a_run_finished_again_from_its_checkpoints_records_nothing_twice(
    first_run: PipelineResult, client: MlflowClient, workdir: Path
) -> None:
    """A crash between writing fit.json and recording its digest: the resume finishes the run again from its
    checkpoints (Ray Train finds every epoch done) and adds no metric point, LoggedModel or version."""
    from raytrain_tasks.tracking.runs import FIT_RECORD_TAG

    assert first_run.model is not None
    fit, name = first_run.fit, first_run.model.name

    def recorded() -> tuple[object, ...]:
        models = client.search_logged_models([fit.mlflow_experiment_id], f"source_run_id = '{fit.mlflow_run_id}'")
        run = client.get_run(fit.mlflow_run_id)
        points = {key: len(client.get_metric_history(fit.mlflow_run_id, key)) for key in run.data.metrics}
        return (
            sorted((m.name, m.model_id, len(m.metrics)) for m in models),
            sorted(str(v.version) for v in client.search_model_versions(f"name = '{name}'")),
            points,
            run.data.tags["mlflow.note.content"].split("#### Result"),  # the flow run it names is the latest
        )

    before = recorded()
    client.delete_tag(fit.mlflow_run_id, FIT_RECORD_TAG)
    again = training_pipeline(**parameters_of(small_config(workdir, resume=first_run.run_key)))
    assert again.fit.best_checkpoint_model_id == fit.best_checkpoint_model_id
    assert again.model is not None and again.model.version == first_run.model.version
    after = recorded()
    assert after[:3] == before[:3]
    assert len(after[3]) == len(before[3]) == 2 and after[3][1] == before[3][1]  # one result table, the same
    assert client.get_run(fit.mlflow_run_id).data.tags[FIT_RECORD_TAG]  # complete again


def test_a_resume_with_changed_settings_is_refused_before_anything_is_written(
    first_run: PipelineResult, client: MlflowClient, workdir: Path
) -> None:
    from raytrain_tasks.errors import TrackingError

    before = client.get_run(first_run.fit.mlflow_run_id)
    state = training_pipeline(
        **parameters_of(small_config(workdir, resume=first_run.run_key, epochs=5, learning_rate=0.01)),
        return_state=True,
    )
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, TrackingError) and "epochs: '3' -> '5'" in str(error)
    after = client.get_run(first_run.fit.mlflow_run_id)
    assert after.info.status == before.info.status == "FINISHED"
    assert after.info.end_time == before.info.end_time
    assert after.data.tags == before.data.tags and after.data.params == before.data.params


@pytest.fixture(scope="module")
def by_loss(workdir: Path, ray_cluster: object, prefect_api: None) -> Iterator[tuple[PipelineResult, Path]]:
    """A run with `promotion_metric=val_loss` (a large step size, one worker), and what a worker SIGKILLed while it
    wrote or uploaded a checkpoint of the same run key left on this node before it: its local staging folder, half
    a model and a stale file in it. Returns the run and that folder."""
    import tempfile

    from raytrain_tasks.config import new_run_key
    from raytrain_tasks.trainspec.checkpoint import STAGING_PREFIX

    key = new_run_key()
    root = Path(tempfile.gettempdir()) / f"{STAGING_PREFIX}{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    left = root / key
    left.mkdir()
    (left / "model.pt").write_bytes(os.urandom(1 << 20))  # a model half-written when the worker was killed
    (left / "stale.bin").write_bytes(b"from the killed attempt")
    # One torch thread, as the val_loss trajectory was found with (more threads sum in another order: another one).
    config = small_config(
        workdir / "by-loss",
        epochs=6,
        num_workers=1,
        cpus_per_worker=1,
        learning_rate=0.05,
        promotion_metric="val_loss",
    )
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("flows.training.new_run_key", lambda: key)
            result = training_pipeline(**parameters_of(config))
        yield result, left
    finally:
        if left.exists():
            import shutil

            shutil.rmtree(left)


def test_the_best_checkpoint_by_val_loss_is_the_lowest_loss_not_the_highest_accuracy(
    by_loss: tuple[PipelineResult, Path],
) -> None:
    """`promotion_metric=val_loss`: the best checkpoint, the checkpoints Ray Train keeps (the default two best plus
    the latest) and the registered version all follow val_loss, lower wins. This config (a large step size)
    overfits so that val_loss and val_accuracy disagree on the best epoch, or on the two best. The trajectory
    depends on the installed torch and numpy builds (a fresh install changed it once); the assertion says so when
    the metrics agree."""
    result, _ = by_loss
    config = result.config
    history = result.fit.history
    by_loss_epoch = min(range(len(history)), key=lambda epoch: history[epoch]["val_loss"])
    by_accuracy = max(range(len(history)), key=lambda epoch: history[epoch]["val_accuracy"])
    two_best = sorted(range(len(history)), key=lambda epoch: history[epoch]["val_loss"])[:2]
    two_best_by_accuracy = sorted(range(len(history)), key=lambda epoch: -history[epoch]["val_accuracy"])[:2]
    # Where the two metrics pick the same best epoch, the checkpoints kept (the two best) still tell them apart.
    assert by_loss_epoch != by_accuracy or set(two_best) != set(two_best_by_accuracy), (
        f"the metrics agree on the best two epochs {two_best}: the test needs a config where they do not"
    )
    assert result.fit.best_epoch == by_loss_epoch + 1  # epochs are numbered from 1 where people read them
    assert result.fit.best_metrics["val_loss"] == pytest.approx(history[by_loss_epoch]["val_loss"])
    run_dir = Path(config.storage_path) / "runs" / result.run_key
    expected = sorted({f"epoch-{epoch + 1:04d}" for epoch in [*two_best, len(history) - 1]})
    assert sorted(p.name for p in run_dir.glob("epoch-*")) == expected
    assert Path(result.fit.best_checkpoint_uri) == run_dir / f"epoch-{by_loss_epoch + 1:04d}"
    assert result.model is not None and result.model.metric == "test_loss"
    version = MlflowClient(config.mlflow_tracking_uri).get_model_version(config.model_name, result.model.version)
    assert version.tags["best_epoch"] == str(by_loss_epoch + 1)


def test_what_a_killed_checkpoint_write_left_on_the_node_is_gone_after_the_runs_next_checkpoint(
    by_loss: tuple[PipelineResult, Path],
) -> None:
    """A worker SIGKILLed while it wrote or uploaded an epoch's checkpoint leaves its local folder behind. The
    run's next checkpoint on that node (here: the run's next attempt) removes it, and none of it reaches storage.
    A TrainSpec's loop wrote each checkpoint in a fresh temporary folder, which a killed worker left for ever."""
    result, left = by_loss
    assert result.run_key == left.name and result.fit.epochs_completed == result.config.epochs
    assert not left.exists()
    stored = Path(result.config.storage_path) / "runs" / result.run_key
    assert sorted(p.name for p in stored.rglob("stale.bin")) == []
    assert [p.name for p in Path(result.fit.best_checkpoint_uri).iterdir()] == ["spec_state.pt"]
