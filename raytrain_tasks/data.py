"""The prepared dataset as workers see it: a versioned folder of Parquet splits in shared storage."""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from raytrain_tasks.errors import DatasetError
from raytrain_tasks.fs import StorageOptions, open_filesystem

LABEL_INDEX_COLUMN = "__label_index__"
MANIFEST_NAME = "dataset.json"
Split = Literal["train", "val"]


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
    feature_mean: tuple[float, ...]
    feature_std: tuple[float, ...]

    @property
    def num_features(self) -> int:
        return len(self.feature_names)

    @property
    def num_classes(self) -> int:
        return len(self.class_labels)

    def split_uri(self, split: Split) -> str:
        return f"{self.uri.rstrip('/')}/{split}.parquet"


def read_split(
    dataset: DatasetRef, split: Split, options: StorageOptions | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Features as float32 ``[N, F]`` and class indices as int64 ``[N]``, in stored order."""
    uri = dataset.split_uri(split)
    try:
        filesystem, path = open_filesystem(uri, options or StorageOptions())
        table = pq.read_table(path, filesystem=filesystem)
    except (OSError, ValueError) as exc:
        raise DatasetError(
            f"cannot read the {split} split at {uri}: {exc}. Every Ray node must reach `storage_path`; "
            "re-run prepare-data or check the storage settings."
        ) from exc
    features = np.column_stack(
        [table.column(name).to_numpy().astype(np.float32, copy=False) for name in dataset.feature_names]
    )
    # A writable copy: Arrow's buffers are read-only, which torch.from_numpy warns about.
    labels = table.column(LABEL_INDEX_COLUMN).to_numpy().astype(np.int64, copy=True)
    return features, labels
