"""prepare-data: deterministic splits, standardised features, content-addressed versions, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from raytrain_tasks.data import MANIFEST_NAME, read_split
from raytrain_tasks.errors import DatasetError
from tasks.data import prepare_dataset
from tests.conftest import small_config


def test_digits_is_split_standardised_and_stored(tmp_path: Path) -> None:
    dataset = prepare_dataset(small_config(tmp_path))
    assert (dataset.train_rows, dataset.val_rows) == (1437, 360)
    assert dataset.num_features == 64 and dataset.class_labels == tuple(str(i) for i in range(10))
    assert Path(dataset.uri) == tmp_path / "storage" / "datasets" / dataset.content_hash
    x_train, y_train = read_split(dataset, "train")
    x_val, y_val = read_split(dataset, "val")
    assert x_train.shape == (1437, 64) and x_val.shape == (360, 64)
    assert np.abs(x_train.mean(axis=0)).max() < 1e-5  # standardised with train statistics
    assert set(np.unique(y_val)) == set(range(10))  # stratified: every class in validation


def test_same_input_reuses_the_version(tmp_path: Path) -> None:
    config = small_config(tmp_path)
    first = prepare_dataset(config)
    manifest = Path(first.uri) / MANIFEST_NAME
    written_at = manifest.stat().st_mtime_ns
    second = prepare_dataset(config)
    assert second == first
    assert manifest.stat().st_mtime_ns == written_at  # reused, not rewritten
    assert len(list((tmp_path / "storage" / "datasets").iterdir())) == 1


def test_a_different_split_is_a_different_version(tmp_path: Path) -> None:
    a = prepare_dataset(small_config(tmp_path, seed=1))
    b = prepare_dataset(small_config(tmp_path, seed=2))
    assert a.content_hash != b.content_hash
    assert not np.array_equal(read_split(a, "val")[1], read_split(b, "val")[1])


def test_csv_with_named_label_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(200, 3)), columns=["a", "b", "c"])
    frame["species"] = np.where(frame["a"] > 0, "setosa", "virginica")
    path = tmp_path / "flowers.csv"
    frame.to_csv(path, index=False)
    dataset = prepare_dataset(small_config(tmp_path, dataset=str(path), label_column="species"))
    assert dataset.feature_names == ("a", "b", "c")
    assert dataset.class_labels == ("setosa", "virginica")
    assert dataset.train_rows + dataset.val_rows == 200


def test_parquet_file_works_too(tmp_path: Path) -> None:
    frame = pd.DataFrame({"x": np.arange(100.0), "y": np.arange(100.0) ** 2, "target": np.arange(100) % 2})
    path = tmp_path / "data.parquet"
    frame.to_parquet(path)
    dataset = prepare_dataset(small_config(tmp_path, dataset=str(path), label_column="target"))
    assert dataset.num_classes == 2 and dataset.num_features == 2


def test_missing_label_column_names_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    pd.DataFrame({"x": range(20), "y": range(20)}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match="label column 'label' is not in dataset.*set `label_column`"):
        prepare_dataset(small_config(tmp_path, dataset=str(path)))


def test_missing_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist; set `dataset`"):
        prepare_dataset(small_config(tmp_path, dataset=str(tmp_path / "nope.csv")))


def test_non_numeric_features_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    pd.DataFrame({"colour": ["red", "blue"] * 10, "label": [0, 1] * 10}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match="non-numeric feature columns \\['colour'\\]"):
        prepare_dataset(small_config(tmp_path, dataset=str(path)))
