"""raytrain_tasks/table_classifier/: the default train_code, a plain ``TrainSpec``, run
through the whole pipeline the way a user runs their own table: a CSV file, a label column of names, a key
column, trained, registered behind the gate, served from the registry on raw rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.s3_server import LocalS3
from flows.training import training_pipeline
from raytrain_tasks.config import TrainingConfig, parameters_of
from raytrain_tasks.errors import UserCodeError
from raytrain_tasks.integrity import local_folder_digest
from raytrain_tasks.table_classifier.spec import Settings, data, prepare
from raytrain_tasks.tracking.runs import using_tracking_uri
from raytrain_tasks.user_code import resolve
from tests.helpers import mlflow_client, only_run, small_config

CLASSIFIER = "raytrain_tasks.table_classifier:classifier"
FEATURES = ("tenure", "spend", "visits", "tickets")
PLANS = ("basic", "family", "pro")


def write_table(path: Path, rows: int = 900) -> Path:
    """Customers: a key column, four numeric features on very different scales, and a plan name to predict."""
    import pandas as pd
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=rows, n_features=4, n_informative=3, n_redundant=0, n_classes=3, class_sep=2.0, random_state=7
    )
    frame = pd.DataFrame(x * np.array([1.0, 100.0, 10.0, 0.1]) + np.array([5.0, 300.0, 0.0, 1.0]), columns=FEATURES)
    frame.insert(0, "customer_id", [f"c{i:05d}" for i in range(rows)])
    frame["plan"] = [PLANS[label] for label in y]
    frame.to_csv(path, index=False)
    return path


def table_config(csv: Path, **settings: Any) -> dict[str, Any]:
    chosen = {"dataset": str(csv), "label_column": "plan", "split_key_column": "customer_id", **settings}
    return {**Settings(**chosen).model_dump(), "seed": 0, "data_dir": None}


def test_the_same_table_prepares_the_same_bytes_and_each_row_lands_in_one_split(tmp_path: Path) -> None:
    csv = write_table(tmp_path / "customers.csv")
    folders = [tmp_path / "first", tmp_path / "second"]
    said = []
    for folder in folders:
        folder.mkdir()
        said.append(prepare(table_config(csv), folder))
    assert local_folder_digest(folders[0]) == local_folder_digest(folders[1])  # one stored version for both
    splits = data({**table_config(csv), "data_dir": str(folders[0])})
    sizes = [len(split) for split in (splits.train, splits.val, splits.test)]
    assert sum(sizes) == 900 and min(sizes) > 50, sizes
    # What the run's log line and pages show of it, as the built-in classifier's did.
    assert said[0] == f"{sizes[0]} train / {sizes[1]} val / {sizes[2]} test rows, 4 features, 3 classes", said
    rows = {tuple(np.round(x.numpy(), 5)) for split in (splits.train, splits.val, splits.test) for x, _ in split}
    assert len(rows) == 900, "a row in two splits, or one lost"
    assert {int(y) for _, y in splits.train} == {0, 1, 2}


def test_its_schema_is_the_one_the_built_in_classifiers_versions_record(tmp_path: Path) -> None:
    """The table's columns and classes, as a digest equal to the built-in classifier's schema.digest for the same
    table: a champion the built-in registered stays comparable with this code's models, and one of other columns
    or classes does not."""
    from raytrain_driver.champion import digest_of_schema
    from raytrain_tasks.table_classifier.spec import classifier, described

    csv = write_table(tmp_path / "customers.csv")
    (tmp_path / "out").mkdir()
    prepare(table_config(csv), tmp_path / "out")
    config = {**table_config(csv), "data_dir": str(tmp_path / "out")}
    assert classifier.schema is not None
    given = classifier.schema(config)
    assert given == {"features": list(FEATURES), "classes": list(PLANS)}
    stored = described(config)  # the built-in's versions recorded this digest of the same table (releases <= 0.2)
    built_in = digest_of_schema({"features": list(stored.feature_names), "classes": list(stored.class_labels)})
    assert digest_of_schema(given) == built_in
    assert digest_of_schema({**given, "features": [*FEATURES[1:], FEATURES[0]]}) != digest_of_schema(given)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_ray_data_splits_that_fit_are_read_once_and_larger_ones_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With data_loader "ray_data", the splits are read and mapped once, on the driver, when they fit in the
    object store's share (the built-in rule): each epoch then reads them from memory, where lazy splits were read
    again from Parquet every epoch by every worker (12.6x the built-in's seconds per epoch, bench.own_code).
    Larger ones stay lazy and stream."""
    from ray.data.dataset import MaterializedDataset

    csv = write_table(tmp_path / "customers.csv")
    (tmp_path / "data").mkdir()
    prepare(table_config(csv), tmp_path / "data")
    config = {**table_config(csv, data_loader="ray_data"), "data_dir": str(tmp_path / "data")}
    kept = data(config)
    assert all(isinstance(split, MaterializedDataset) for split in (kept.train, kept.val, kept.test)), kept
    assert sum(split.count() for split in (kept.train, kept.val, kept.test)) == 900
    # Kept splits run no Ray Data task while the workers train: no CPU is set aside for them (two workers of 1 CPU
    # on 2 CPUs, as the built-in's ray_data loader gets; a whole CPU was set aside, each worker had 0.5)
    from raytrain_driver.preflight import data_tasks_during_fit
    from raytrain_tasks.table_classifier.spec import classifier
    from raytrain_tasks.trainspec.loop import as_train_func

    code = as_train_func(classifier)
    assert code.train_func.check_data(config) and not data_tasks_during_fit(code)  # type: ignore[attr-defined]
    monkeypatch.setattr(
        "raytrain_tasks.table_classifier.data.MATERIALIZE_SHARE", 0.0
    )  # as if the object store were too small
    streamed = data(config)
    assert not any(isinstance(split, MaterializedDataset) for split in (streamed.train, streamed.val, streamed.test))
    assert code.train_func.check_data(config) and data_tasks_during_fit(code)  # type: ignore[attr-defined]


def test_the_same_table_by_another_path_is_the_same_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csv = write_table(tmp_path / "customers.csv")
    monkeypatch.chdir(tmp_path)
    folders = [tmp_path / "absolute", tmp_path / "relative"]
    for folder, spelt in zip(folders, (str(csv), "./customers.csv"), strict=True):
        folder.mkdir()
        prepare(table_config(csv, dataset=spelt), folder)
    assert local_folder_digest(folders[0]) == local_folder_digest(folders[1])


def test_a_table_in_an_s3_compatible_store_is_read_through_its_endpoint_setting(
    s3_server: LocalS3, tmp_path: Path
) -> None:
    """`dataset` as an s3:// URI of a store other than AWS, its endpoint in the `s3_endpoint_url` setting (the
    credentials in the environment): the same version as the same table read from a local file. An endpoint holding
    credentials is refused: train_config is logged as MLflow params."""
    import boto3
    from pydantic import ValidationError

    csv = write_table(tmp_path / "customers.csv")
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1")
    if "prt-tables" not in [bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket="prt-tables")
    client.upload_file(str(csv), "prt-tables", "raw/customers.csv")
    folders = [tmp_path / "local", tmp_path / "s3"]
    for folder in folders:
        folder.mkdir()
    prepare(table_config(csv), folders[0])
    prepare(
        table_config(csv, dataset="s3://prt-tables/raw/customers.csv", s3_endpoint_url=s3_server.endpoint_url),
        folders[1],
    )
    assert local_folder_digest(folders[0]) == local_folder_digest(folders[1])
    for spelt in ("http://prt-admin:prt-admin-secret@127.0.0.1:8333", "prt-admin:prt-admin-secret@127.0.0.1:8333"):
        with pytest.raises(ValidationError, match=r"(?s)s3_endpoint_url.*holds credentials"):
            Settings(s3_endpoint_url=spelt)
    with pytest.raises(ValidationError, match=r"(?s)s3_endpoint_url.*not an http:// or https:// address"):
        Settings(s3_endpoint_url="127.0.0.1:8333")  # pyarrow would take "127.0.0.1" for the scheme


def test_ddp_does_not_broadcast_the_standardisation_constants_every_step(tmp_path: Path) -> None:
    """The model's mean and deviation are the same on every rank: DDP is told to leave them out of the buffers it
    broadcasts before each forward pass (a collective per step), and still syncs a buffer training changes."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from raytrain_tasks.table_classifier.spec import build_model

    csv = write_table(tmp_path / "customers.csv")
    (tmp_path / "data").mkdir()
    prepare(table_config(csv), tmp_path / "data")
    config = {**table_config(csv), "data_dir": str(tmp_path / "data"), "hidden_sizes": [8]}
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DistributedDataParallel(build_model(config, torch.zeros(2, 4)))
        assert not model.will_sync_module_buffers()
        with_norm = build_model(config, torch.zeros(2, 4))
        with_norm.append(torch.nn.BatchNorm1d(3))
        assert DistributedDataParallel(with_norm).will_sync_module_buffers()
    finally:
        dist.destroy_process_group()


def test_a_label_column_the_table_lacks_is_named_before_anything_trains(tmp_path: Path) -> None:
    csv = write_table(tmp_path / "customers.csv")
    (tmp_path / "out").mkdir()
    with pytest.raises(Exception, match="label column 'plann' is not in dataset .*set `label_column`"):
        prepare(table_config(csv, label_column="plann"), tmp_path / "out")
    with pytest.raises(UserCodeError, match="'hiden_sizes'.*did you mean 'hidden_sizes'"):
        from raytrain_tasks.code_settings import code_values

        code_values(resolve(CLASSIFIER), {"hiden_sizes": [8]}, CLASSIFIER)


@pytest.mark.parametrize(
    ("train_config", "says"),
    [
        ({"dataset": "customers.txt"}, r"train_config.dataset: Value error, unknown dataset 'customers.txt': use one"),
        ({"val_fraction": 0.5, "test_fraction": 0.45}, r"val_fraction \(0.5\) \+ test_fraction \(0.45\) must leave"),
    ],
)
def test_a_table_it_cannot_read_or_splits_that_leave_nothing_to_train_are_refused_before_anything_starts(
    train_config: dict[str, Any], says: str
) -> None:
    """As the built-in classifier's settings refuse them: a file of no table format (it failed in prepare-data,
    once the flow and its run key had started, saying to set `dataset`), and held-out splits of 90% or more."""
    from raytrain_tasks.code_settings import code_values

    with pytest.raises(UserCodeError, match=says):
        code_values(resolve(CLASSIFIER), train_config, CLASSIFIER)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster", "prefect_api")
def test_a_csv_table_trains_registers_and_its_model_takes_raw_rows(tmp_path: Path) -> None:
    """The spec trains a CSV table through the flow; the registered champion names its features and classes in
    its metadata, has the validation confusion matrix beside it, and predicts the raw rows of the file (its
    standardisation inside) as well as the run scored it on the test split. The table is named with the built-in
    classifier's flags (--dataset, --label-column...): they reach the classifier as its train_config."""
    import mlflow
    import pandas as pd

    csv = write_table(tmp_path / "customers.csv")
    # Said as the built-in classifier's users say it (its flags), not in train_config: the run carries them there.
    settings = {"dataset": str(csv), "label_column": "plan", "split_key_column": "customer_id", "hidden_sizes": [32]}
    config = small_config(tmp_path, train_code=CLASSIFIER, epochs=4, register=True, batch_size=64, **settings)
    # model_name left at its default: the code names the model after its table, as the built-in classifier does
    config = config.model_copy(update={"model_name": TrainingConfig.model_fields["model_name"].default})
    result = training_pipeline(**parameters_of(config))

    assert result.model is not None and result.model.aliases == ("champion",), result.model
    assert result.model.name == "customers-classifier", result.model
    assert result.fit.best_metrics["val_accuracy"] > 0.8, result.fit.best_metrics
    run = only_run(tmp_path)
    assert run.info.status == "FINISHED"
    assert run.data.params["train_config.label_column"] == "plan"
    assert json.loads(run.data.params["train_config"]) == settings  # one value, in one place
    client = mlflow_client(tmp_path)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_accuracy")] == [1, 2, 3, 4]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "evaluation")}
    assert {"evaluation/confusion_matrix.png", "evaluation/per_class_report.json"} <= artifacts, artifacts

    with using_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        info = mlflow.models.get_model_info("models:/customers-classifier@champion")
        model = mlflow.pyfunc.load_model("models:/customers-classifier@champion")
    assert info.metadata["class_labels"] == list(PLANS) and info.metadata["feature_names"] == list(FEATURES)
    frame = pd.read_csv(csv)
    logits = np.asarray(model.predict(frame[list(FEATURES)].to_numpy(np.float32)))
    predicted = [info.metadata["class_labels"][i] for i in logits.argmax(1)]
    accuracy = float(np.mean(np.array(predicted) == frame["plan"].to_numpy()))
    assert accuracy > 0.8, "the served model takes raw rows: standardising them twice (or never) fails this"
