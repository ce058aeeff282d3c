"""The prepared dataset as workers see it: a versioned folder of Parquet splits in shared storage."""

from __future__ import annotations

import hashlib
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field

from raytrain_tasks.errors import DatasetError
from raytrain_tasks.storage.filesystem import StorageOptions, open_filesystem

LABEL_INDEX_COLUMN = "__label_index__"
ROW_INDEX_COLUMN = "__row__"  # position within its split: lets a reader tell which rows it saw
# Part of every dataset's content hash: a change of what the Parquet files hold makes new versions.
STORAGE_LAYOUT = 3  # 2: raw features, standardised by readers; 3: train/val/test assigned by a stable row hash
# A split is preprocessed once per run and kept in Ray's object store when both splits take at most this share of
# the cluster's object store memory; larger data streams through read and preprocess tasks every epoch.
MATERIALIZE_SHARE = 0.25
MANIFEST_NAME = "dataset.json"
Split = Literal["train", "val", "test"]
SPLITS: tuple[Split, ...] = ("train", "val", "test")


class DatasetRef(BaseModel):
    """Where a prepared dataset version lives and what it holds."""

    model_config = ConfigDict(frozen=True)

    uri: str
    content_hash: str
    source: str
    label_column: str
    feature_names: tuple[str, ...]
    class_labels: tuple[str, ...]
    train_rows: int
    val_rows: int
    test_rows: int = 0
    split_rule: str = ""
    feature_mean: tuple[float, ...]
    feature_std: tuple[float, ...]
    # SHA-256 of each split file as prepare-data wrote it: a split is read only if it still hashes to this.
    split_sha256: dict[str, str] = Field(default_factory=dict)

    def describe(self) -> str:
        """One line on what the version holds (logs, run pages)."""
        return f"dataset {self.content_hash} ({self.source}): {self.sizes()} at {self.uri}"

    def sizes(self) -> str:
        """``1437 train / 180 val / 180 test rows, 64 features, 10 classes``."""
        return (
            f"{self.train_rows} train / {self.val_rows} val / {self.test_rows} test rows, {self.num_features} "
            f"features, {self.num_classes} classes"
        )

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def num_classes(self) -> int:
        return len(self.class_labels)

    def split_uri(self, split: Split) -> str:
        return f"{self.uri.rstrip('/')}/{split}.parquet"

    @property
    def preprocessed_bytes(self) -> int:
        """Train and val splits as the workers' pipeline holds them (float32 features, int64 label and row), the
        train split twice: whole, and divided into the workers' shards."""
        return (2 * self.train_rows + self.val_rows) * (4 * self.num_features + 16)


def streams(data_loader: str, dataset: DatasetRef, object_store_bytes: float) -> bool:
    """Whether a ``ray_data`` fit reads and preprocesses its splits on CPU tasks every epoch, beside the workers
    (too big to keep), rather than once per run before the workers start (see ``MATERIALIZE_SHARE``)."""
    return data_loader == "ray_data" and dataset.preprocessed_bytes > MATERIALIZE_SHARE * object_store_bytes


def read_split(
    dataset: DatasetRef, split: Split, options: StorageOptions | None = None, *, standardised: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 ``[N, F]`` (standardised, or raw as stored) and class indices as int64 ``[N]``."""
    uri = dataset.split_uri(split)
    try:
        filesystem, path = open_filesystem(uri, options or StorageOptions())
        with filesystem.open_input_file(path) as stream:
            data = stream.read()
    except (OSError, ValueError) as exc:
        raise DatasetError(
            f"cannot read the {split} split at {uri}: {exc}. Every Ray node must reach `storage_path`; "
            "re-run prepare-data or check the storage settings."
        ) from exc
    check_split_digest(dataset, split, hashlib.sha256(data).hexdigest())  # hashed as read: no second read
    table = pq.read_table(pa.BufferReader(data))
    features = np.column_stack(
        [table.column(name).to_numpy().astype(np.float32, copy=False) for name in dataset.feature_names]
    )
    # A writable copy: Arrow's buffers are read-only, which torch.from_numpy warns about.
    labels = table.column(LABEL_INDEX_COLUMN).to_numpy().astype(np.int64, copy=True)
    return (standardise(features, dataset) if standardised else features), labels


def check_split_digest(dataset: DatasetRef, split: Split, actual: str) -> None:
    uri = dataset.split_uri(split)
    expected = dataset.split_sha256.get(split)
    if expected is None:
        raise DatasetError(
            f"{MANIFEST_NAME} of dataset {dataset.content_hash} records no SHA-256 for {uri} (prepared by an older "
            "release); run prepare-data again, which rewrites the version"
        )
    if actual != expected:
        raise DatasetError(
            f"{uri} is not the split prepare-data wrote: its SHA-256 is {actual}, {dataset.uri}/{MANIFEST_NAME} "
            f"recorded {expected}. It changed after it was prepared; delete the folder {dataset.uri} and run "
            "prepare-data again (it rewrites the version from `dataset`)"
        )


def standardise(features: np.ndarray, dataset: DatasetRef) -> np.ndarray:
    """Features scaled by the train split's mean and deviation, in float32 (the model's input)."""
    mean = np.asarray(dataset.feature_mean, dtype=np.float32)
    std = np.asarray(dataset.feature_std, dtype=np.float32)
    return ((features - mean) / std).astype(np.float32, copy=False)
