"""The table classifier, written as your own code is: a ``TrainSpec`` of the public API (raytrain_tasks.api)::

    prefect-raytrain train --train-config '{"dataset": "data/customers.csv", "label_column": "churned"}'

``dataset`` is ``"digits"`` (scikit-learn's bundled 8x8 digits), ``"synthetic"`` (a generated 4-class problem) or
a CSV/Parquet file: a local path, or an ``s3://`` URI. Its store's endpoint is ``s3_endpoint_url`` in
``train_config`` or the environment's; its credentials are the environment's. It needs numeric feature columns
and a label column.

``prepare`` assigns each row to train, validation or test by a hash of its key, so a row keeps its split as the
table grows. It writes the three splits as Parquet, with a ``dataset.json`` describing them: feature names, class
labels, the train split's mean and deviation. The pipeline stores that folder by its content hash.

The model is an MLP behind a fixed standardisation layer, so the registered model takes raw feature rows. Its
MLflow metadata names the features and the classes. The run's ``evaluation/`` artifacts hold the validation
confusion matrix, a per-class report and a summary of the data.

It reads its table through the helpers of its own package (``tables``, ``data``, ``reports``). To start your own
code, copy one of examples/ instead: they use the public API alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn
from torch.utils.data import TensorDataset

from raytrain_tasks.api import DATA_DIR_KEY, Metric, Splits, TrainSpec
from raytrain_tasks.storage.filesystem import StorageOptions, s3_endpoint_and_region
from raytrain_tasks.storage.locations import locate
from raytrain_tasks.table_classifier.data import (
    LABEL_INDEX_COLUMN,
    MANIFEST_NAME,
    SPLITS,
    DatasetRef,
    read_split,
    streams,
)
from raytrain_tasks.table_classifier.datasets import check_held_out_share, checked_dataset, dataset_stem
from raytrain_tasks.table_classifier.models import build_mlp, with_standardisation
from raytrain_tasks.table_classifier.reports import dataset_summary, evaluation_report, plot_confusion_matrix
from raytrain_tasks.table_classifier.tables import dataset_hash, load_raw_frame, plan_version, write_version

SCORING_ROWS = 4096  # rows per forward pass where a whole split is scored on the driver


class Settings(BaseModel):
    """The classifier's own settings (``--train-config``), beside the pipeline's epochs, batch_size, lr, seed..."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(default="digits", description="'digits', 'synthetic', or a .csv/.parquet file's path or URI")
    label_column: str = Field(default="label", min_length=1, description="the column holding each row's class")
    split_key_column: str = Field(
        default="", description="a column identifying a row, whose hash decides its split (empty: the row's values)"
    )
    val_fraction: float = Field(default=0.2, gt=0.0, lt=0.9, description="share of rows that pick the checkpoint")
    test_fraction: float = Field(default=0.1, gt=0.0, lt=0.9, description="share of rows the gate compares on")
    synthetic_samples: int = Field(default=4000, ge=100, le=10_000_000, description="rows of 'synthetic'")
    synthetic_features: int = Field(default=20, ge=2, le=10_000, description="feature columns of 'synthetic'")
    hidden_sizes: list[Annotated[int, Field(ge=1, le=65_536)]] = Field(
        default=[128, 64], min_length=1, max_length=16, description="the MLP's hidden layer widths"
    )
    metric: Literal["accuracy", "loss"] = Field(
        default="accuracy", description="picks the best checkpoint (val_) and is what the gate compares (test_)"
    )
    data_loader: Literal["torch", "ray_data"] = Field(
        default="torch",
        description=(
            "'torch': every worker reads the splits; 'ray_data': Ray Datasets read from the driver's copy of them, "
            "the train split sharded (one node: Ray Data's read tasks run where the cluster puts them)"
        ),
    )
    input_example: Literal["synthetic", "validation_rows"] = Field(
        default="synthetic",
        description="what the registered model is exported with: rows made of the train statistics, or 5 real ones",
    )
    s3_endpoint_url: str = Field(
        default="",
        description=(
            "the S3-compatible store holding an s3:// dataset, e.g. 'http://127.0.0.1:8333' (credentials from the "
            "environment); empty: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS"
        ),
    )
    s3_region: str = Field(
        default="",
        description="the region of an s3:// dataset's bucket (empty: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1)",
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        return checked_dataset(value)

    @model_validator(mode="after")
    def _held_out_share(self) -> Settings:
        check_held_out_share(self.val_fraction, self.test_fraction)
        return self

    @field_validator("s3_endpoint_url")
    @classmethod
    def _an_address_without_credentials(cls, value: str) -> str:
        if "@" in value or "?" in value:  # train_config is logged as MLflow params
            raise ValueError(
                "holds credentials: give the address alone (e.g. http://127.0.0.1:8333), with AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY in the environment"
            )
        if value and urlparse(value).scheme not in ("http", "https"):
            raise ValueError(f"{value!r} is not an http:// or https:// address (e.g. http://127.0.0.1:8333)")
        return value


@dataclass(frozen=True)
class _Table:
    """What shapes the prepared table (``tables.TableSettings``), from this code's settings."""

    dataset: str
    label_column: str
    split_key_column: str
    val_fraction: float
    test_fraction: float
    synthetic_samples: int
    synthetic_features: int
    seed: int
    storage_options: StorageOptions = field(default_factory=StorageOptions)


def prepare(config: dict[str, Any], folder: Path) -> str:
    """prepare-data: the table's train/val/test splits as Parquet, and ``dataset.json`` describing them. The same
    table and settings write the same bytes, so the pipeline stores one version of it however many runs use it.
    Returns its rows, features and classes: the line the run's log and pages show."""
    names = _Table.__dataclass_fields__.keys() - {"storage_options"}
    endpoint, region = s3_endpoint_and_region(config["s3_endpoint_url"], config["s3_region"], os.environ)
    options = StorageOptions(endpoint_url=endpoint, region=region)
    table = _Table(**{name: config[name] for name in names}, storage_options=options)
    frame = load_raw_frame(table)
    content_hash = dataset_hash(frame, table)
    target = locate(folder.as_posix())
    planned, splits = plan_version(frame, table, target, content_hash)
    # Neither the folder's path (data() reads it wherever the pipeline put it) nor how the table's path was spelt
    # is part of what it holds. (pyarrow writes its version into each Parquet file: after an upgrade the same
    # table is a new stored version, and a run started before it is refused a resume.)
    source = PurePosixPath(table.dataset.rstrip("/")).name or table.dataset
    return write_version(planned.model_copy(update={"uri": ".", "source": source}), splits, target).sizes()


def described(config: dict[str, Any]) -> DatasetRef:
    """What ``prepare`` wrote, as found in ``config["data_dir"]`` (on the driver and on every worker)."""
    folder = Path(config[DATA_DIR_KEY])
    stored = DatasetRef.model_validate_json((folder / MANIFEST_NAME).read_text())
    return stored.model_copy(update={"uri": folder.as_posix()})


def data(config: dict[str, Any]) -> Splits:
    """Raw features and class indices of each split (the model standardises); Ray Datasets with ``ray_data``."""
    dataset = described(config)
    if config["data_loader"] == "ray_data":
        import ray

        splits = [_ray_split(dataset, split) for split in SPLITS]
        if not streams("ray_data", dataset, ray.cluster_resources().get("object_store_memory", 0.0)):
            # Read and mapped once per fit, here, as Ray Data's guide advises for data that fits in the object
            # store (the workers take their shards of these; none calls data()), not every epoch on every worker.
            splits = [split.materialize() for split in splits]
        return Splits(*splits)
    tensors = (read_split(dataset, split, standardised=False) for split in SPLITS)
    return Splits(*(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)) for x, y in tensors))


def _ray_split(dataset: DatasetRef, split: str) -> Any:
    import ray.data

    names = list(dataset.feature_names)

    def rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = np.column_stack([batch[name].astype(np.float32, copy=False) for name in names])
        return {"inputs": inputs, "target": batch[LABEL_INDEX_COLUMN].astype(np.int64, copy=False)}

    return ray.data.read_parquet(dataset.split_uri(split)).map_batches(rows, batch_format="numpy")  # type: ignore[arg-type]


def build_model(config: dict[str, Any], example: torch.Tensor) -> nn.Module:
    """An MLP over the standardised features; the registered model takes raw rows as the table has them."""
    dataset = described(config)
    net = build_mlp(dataset.num_features, dataset.num_classes, config["hidden_sizes"])
    model = with_standardisation(net, dataset.feature_mean, dataset.feature_std)
    # The standardisation's mean and deviation are constants, the same on every rank: DDP would broadcast them from
    # rank 0 before every forward pass (a collective per step, a tenth of an epoch's time on CPUs), as it must
    # buffers that training changes (a BatchNorm's, which stay synchronised). DistributedDataParallel reads this
    # attribute when it wraps the model (torch 2.x; a test checks it still does).
    standardise = next(iter(model.children()))
    model._ddp_params_and_buffers_to_ignore = [f"0.{name}" for name, _ in standardise.named_buffers()]  # type: ignore[assignment]
    return model


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (outputs.argmax(1) == targets).float().mean()}


def choose_metric(config: dict[str, Any]) -> Metric:
    return Metric(config["metric"], higher_is_better=config["metric"] == "accuracy")


def input_example(config: dict[str, Any]) -> np.ndarray:
    """No real row unless ``input_example`` says so: the MLflow UI's readers may not be the data's. Rows made of
    the train split's mean, mean - std and mean + std give the signature its shape."""
    dataset = described(config)
    if config["input_example"] == "validation_rows":
        return read_split(dataset, "val", standardised=False)[0][:5]
    mean = np.asarray(dataset.feature_mean, dtype=np.float32)
    std = np.asarray(dataset.feature_std, dtype=np.float32)
    return np.stack([mean, mean - std, mean + std]).astype(np.float32)


def artifacts(model: nn.Module, config: dict[str, Any], folder: Path) -> None:
    """The registered model on the validation split: confusion matrix, per-class report; and what it was fed."""
    dataset = described(config)
    _, y_train = read_split(dataset, "train", standardised=False)
    x_val, y_val = read_split(dataset, "val", standardised=False)
    with torch.no_grad():
        logits = np.concatenate(
            [
                model(torch.from_numpy(x_val[start : start + SCORING_ROWS])).numpy()
                for start in range(0, len(x_val), SCORING_ROWS)
            ]
        )
    evaluation = evaluation_report(logits, y_val, dataset.class_labels)
    plot_confusion_matrix(evaluation["confusion_matrix"], dataset.class_labels, folder / "confusion_matrix.png")
    (folder / "per_class_report.json").write_text(json.dumps(evaluation, indent=1))
    (folder / "dataset_summary.json").write_text(json.dumps(dataset_summary(dataset, y_train, y_val), indent=1))


def schema(config: dict[str, Any]) -> dict[str, Any]:
    """What the model's inputs and outputs mean: a champion of other columns or classes is not compared with it
    (versions of releases up to 0.2, its model before it was a TrainSpec, record the same digest)."""
    dataset = described(config)
    return {"features": list(dataset.feature_names), "classes": list(dataset.class_labels)}


def model_name(config: dict[str, Any]) -> str:
    """One registered model per table (a model of other columns or classes is not comparable with its champion):
    ``digits-classifier``, ``synthetic-classifier``, or the file's name (``churn-classifier`` for churn.csv)."""
    return f"{dataset_stem(config['dataset'])}-classifier"


def model_metadata(config: dict[str, Any]) -> dict[str, Any]:
    """What whoever serves the model needs: the input columns in order, and the class each output stands for."""
    dataset = described(config)
    return {
        "feature_names": list(dataset.feature_names),
        "class_labels": list(dataset.class_labels),
        "input": "raw features in feature_names order; the model standardises them itself",
        "output": "logits; argmax is the index into class_labels",
    }


classifier = TrainSpec(
    data=data,
    model=build_model,
    loss=F.cross_entropy,
    metrics=accuracy,
    metric=choose_metric,
    input_example=input_example,
    prepare=prepare,
    settings=Settings,
    artifacts=artifacts,
    model_metadata=model_metadata,
    schema=schema,
    model_name=model_name,
)
