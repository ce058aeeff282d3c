"""A labelled table as the table classifier trains on it: loaded (a bundled dataset, or a CSV/Parquet file),
checked, split by a stable hash of each row's key, and planned as Parquet split files with a ``dataset.json``
(``data.DatasetRef``) that records the train split's statistics. The table classifier's ``prepare`` (``spec.py``)
writes it into its folder.
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_tasks.errors import DatasetError
from raytrain_tasks.storage.filesystem import StorageOptions
from raytrain_tasks.storage.locations import StorageLocation, locate
from raytrain_tasks.table_classifier.data import (
    LABEL_INDEX_COLUMN,
    MANIFEST_NAME,
    ROW_INDEX_COLUMN,
    STORAGE_LAYOUT,
    DatasetRef,
)
from raytrain_tasks.table_classifier.datasets import BUILTIN_DATASETS, DatasetRequest

if TYPE_CHECKING:
    import pandas as pd


class TableSettings(Protocol):
    """What shapes a prepared table: the table classifier's settings (``spec._Table``)."""

    @property
    def dataset(self) -> str: ...
    @property
    def label_column(self) -> str: ...
    @property
    def synthetic_samples(self) -> int: ...
    @property
    def synthetic_features(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def split_key_column(self) -> str: ...
    @property
    def val_fraction(self) -> float: ...
    @property
    def test_fraction(self) -> float: ...
    @property
    def storage_options(self) -> StorageOptions: ...


# Bump when the prepared layout changes, so old versions are never read as new ones.
PREPARED_FORMAT = 1


def load_raw_frame(config: TableSettings) -> pd.DataFrame:
    """The dataset as loaded, with the label column present and numeric features only."""
    if config.dataset in BUILTIN_DATASETS:
        request = DatasetRequest(
            label_column=config.label_column,
            samples=config.synthetic_samples,
            features=config.synthetic_features,
            seed=config.seed,
        )
        frame = BUILTIN_DATASETS[config.dataset](request)
    else:
        frame = _read_table_file(config.dataset, config)
    if config.label_column not in frame.columns:
        raise DatasetError(
            f"label column {config.label_column!r} is not in dataset {config.dataset!r} "
            f"(columns: {', '.join(map(str, frame.columns[:20]))}); set `label_column`"
        )
    if config.split_key_column and config.split_key_column not in frame.columns:
        raise DatasetError(
            f"split key column {config.split_key_column!r} is not in dataset {config.dataset!r}; set `split_key_column`"
        )
    # Counted first: a file with a header and no rows gives columns of no type, which would read as non-numeric.
    if len(frame) < 10:
        rows = "no rows, only a header" if len(frame) == 0 else f"{len(frame)} rows"
        raise DatasetError(f"dataset {config.dataset!r} has {rows}; it needs at least 10 rows")
    features = _feature_frame(frame, config)
    from pandas.api.types import is_numeric_dtype

    non_numeric = [str(c) for c in features.columns if not is_numeric_dtype(features[c])]
    if non_numeric:
        raise DatasetError(
            f"dataset {config.dataset!r} has non-numeric feature columns {non_numeric}; encode them first"
        )
    if features.shape[1] == 0:
        raise DatasetError(f"dataset {config.dataset!r} has no feature column beside the label")
    check_values(frame, config)
    return frame


def check_values(frame: pd.DataFrame, config: TableSettings) -> None:
    """Refuse what would train on garbage or leave a split without a class, naming the column and setting."""
    label = config.label_column
    missing_labels = int(frame[label].isna().sum())
    if missing_labels:
        raise DatasetError(
            f"dataset {config.dataset!r}: {missing_labels} rows have no value in label column {label!r}; "
            "drop or label them (or set `label_column`)"
        )
    for column in _feature_frame(frame, config).columns:
        values = frame[column].to_numpy(dtype=np.float64)
        bad = ~np.isfinite(values)
        if bad.any():
            raise DatasetError(
                f"dataset {config.dataset!r}: feature column {column!r} has {int(bad.sum())} NaN or infinite "
                f"values (first at row {int(np.argmax(bad))}); clean or impute them before training, or point "
                "`dataset` at a cleaned file"
            )
    if frame[label].nunique() < 2:
        raise DatasetError(f"dataset {config.dataset!r}: `label_column` {label!r} has one class")


def _feature_frame(frame: pd.DataFrame, config: TableSettings) -> pd.DataFrame:
    dropped = [config.label_column, *([config.split_key_column] if config.split_key_column else [])]
    return frame.drop(columns=dropped)


SPLIT_BUCKETS = 1_000_000
TRAIN, VAL, TEST = 0, 1, 2


def split_rule(config: TableSettings) -> str:
    key = f"column {config.split_key_column!r}" if config.split_key_column else "the row's values"
    val_below = round(config.test_fraction + config.val_fraction, 9)
    return (
        f"u = (pandas.util.hash_pandas_object of {key}, index=False) mod {SPLIT_BUCKETS} / {SPLIT_BUCKETS}; "
        f"test if u < {config.test_fraction}, validation if u < {val_below}, else train"
    )


def assign_splits(keys: pd.DataFrame | pd.Series, val_fraction: float, test_fraction: float) -> np.ndarray:
    """TRAIN, VAL or TEST per row, from a hash of the row's key alone: adding rows never moves another row."""
    import pandas as pd

    hashes = pd.util.hash_pandas_object(keys, index=False).to_numpy(dtype=np.uint64)
    u = (hashes % np.uint64(SPLIT_BUCKETS)).astype(np.float64) / SPLIT_BUCKETS
    return np.where(u < test_fraction, TEST, np.where(u < test_fraction + val_fraction, VAL, TRAIN))


def dataset_hash(frame: pd.DataFrame, config: TableSettings) -> str:
    """Content hash of the data and of everything that shapes the prepared splits."""
    import pandas as pd

    digest = hashlib.sha256()
    digest.update(json.dumps([[str(c), str(t)] for c, t in frame.dtypes.items()]).encode())
    digest.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    split_params = {
        "layout": STORAGE_LAYOUT,
        "label_column": config.label_column,
        "rule": split_rule(config),
        "format": PREPARED_FORMAT,
    }
    digest.update(json.dumps(split_params, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _read_table_file(uri: str, config: TableSettings) -> pd.DataFrame:
    import pyarrow.csv as pacsv

    location = locate(uri, config.storage_options)
    if not location.exists():
        raise DatasetError(f"dataset file {uri!r} does not exist; set `dataset` to an existing CSV/Parquet file")
    try:
        if uri.lower().endswith(".csv"):
            with location.filesystem.open_input_stream(location.path) as stream:
                table = pacsv.read_csv(stream)
        else:
            table = pq.read_table(location.path, filesystem=location.filesystem)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetError(f"cannot parse dataset file {uri!r}: {exc}") from exc
    return table.to_pandas()


def plan_version(
    frame: pd.DataFrame, config: TableSettings, target: StorageLocation, content_hash: str
) -> tuple[DatasetRef, dict[str, pa.Table]]:
    """The version's description (without split digests) and its split tables, as ``write_version`` stores them."""
    labels = frame[config.label_column]
    class_values = sorted(labels.unique(), key=str)
    class_index = {value: i for i, value in enumerate(class_values)}
    y = labels.map(class_index).to_numpy(dtype=np.int64)
    features = _feature_frame(frame, config)
    feature_names = tuple(str(c) for c in features.columns)
    x = features.to_numpy(dtype=np.float32)
    keys = frame[config.split_key_column].astype(str) if config.split_key_column else frame
    assignment = assign_splits(keys, config.val_fraction, config.test_fraction)
    _check_split_sizes(assignment, y, class_values, config)

    x_train = x[assignment == TRAIN]
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    # Constant columns (digits has some all-zero pixels) would divide by zero.
    std = np.where(std > 1e-8, std, 1.0).astype(np.float32)

    # Raw features are stored; readers standardise with the train statistics of the manifest (numpy in
    # read_split, map_batches on Ray Data's CPU workers), so both loaders see the same numbers.
    rows, tables = {}, {}
    for split, code in (("train", TRAIN), ("val", VAL), ("test", TEST)):
        xs, ys = x[assignment == code], y[assignment == code]
        rows[split] = len(ys)
        columns: dict[str, np.ndarray] = {name: xs[:, i] for i, name in enumerate(feature_names)}
        columns[LABEL_INDEX_COLUMN] = ys
        columns[ROW_INDEX_COLUMN] = np.arange(len(ys), dtype=np.int64)
        tables[split] = pa.table(columns)

    dataset = DatasetRef(
        uri=target.uri,
        content_hash=content_hash,
        source=config.dataset,
        label_column=config.label_column,
        feature_names=feature_names,
        class_labels=tuple(str(v) for v in class_values),
        train_rows=rows["train"],
        val_rows=rows["val"],
        test_rows=rows["test"],
        split_rule=split_rule(config),
        feature_mean=tuple(float(v) for v in mean),
        feature_std=tuple(float(v) for v in std),
    )
    return dataset, tables


def write_version(planned: DatasetRef, tables: dict[str, pa.Table], target: StorageLocation) -> DatasetRef:
    target.filesystem.create_dir(target.path, recursive=True)
    digests = {}
    for split, table in tables.items():
        buffer = io.BytesIO()
        pq.write_table(table, buffer)
        data = buffer.getvalue()
        digests[split] = hashlib.sha256(data).hexdigest()  # readers check it (data.read_split)
        target.child(f"{split}.parquet").write_bytes(data)
    dataset = planned.model_copy(update={"split_sha256": digests})
    # The manifest goes last: a version folder without it is incomplete and gets rewritten.
    target.child(MANIFEST_NAME).write_text(dataset.model_dump_json(indent=1))
    return dataset


def _check_split_sizes(
    assignment: np.ndarray, y: np.ndarray, class_values: list[object], config: TableSettings
) -> None:
    num_classes = len(class_values)
    counts = np.bincount(y, minlength=num_classes)
    for index, count in enumerate(counts):
        if count < 3:
            raise DatasetError(
                f"dataset {config.dataset!r}: class {str(class_values[index])!r} of {config.label_column!r} has "
                f"{count} rows; each class needs at least 3 (train, validation and test); add rows or drop the class"
            )
    in_train = np.bincount(y[assignment == TRAIN], minlength=num_classes)
    if (in_train == 0).any():
        absent = [str(class_values[i]) for i in np.flatnonzero(in_train == 0)]
        raise DatasetError(
            f"dataset {config.dataset!r}: no training rows of class(es) {', '.join(absent)} after holding out "
            f"val_fraction={config.val_fraction} and test_fraction={config.test_fraction}; add rows of those "
            "classes or lower `val_fraction` / `test_fraction`"
        )
    for name, code, setting in (("validation", VAL, "val_fraction"), ("test", TEST, "test_fraction")):
        size = int((assignment == code).sum())
        if size < num_classes:
            raise DatasetError(
                f"dataset {config.dataset!r}: the {name} split has {size} rows, fewer than the {num_classes} "
                f"classes; raise `{setting}` (now {getattr(config, setting)}) or add rows"
            )
