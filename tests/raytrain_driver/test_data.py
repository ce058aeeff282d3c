"""prepare-data of the table classifier (the default train_code): deterministic splits, standardised features,
content-addressed versions, clear errors."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from raytrain_tasks.errors import DatasetError
from raytrain_tasks.table_classifier.data import DatasetRef, read_split
from raytrain_tasks.table_classifier.spec import Settings, described, prepare
from tests.helpers import small_config

_folders = itertools.count()


def prepare_table(tmp_path: Path, **settings: Any) -> DatasetRef:
    """What the table classifier's ``prepare`` writes for ``settings`` (its train_config), as its code reads it."""
    folder = tmp_path / "prepared" / str(next(_folders))
    folder.mkdir(parents=True)
    prepare({**Settings(**settings).model_dump(), "seed": 42, "data_dir": None}, folder)
    return described({"data_dir": str(folder)})


def test_digits_is_split_standardised_and_stored(tmp_path: Path) -> None:
    dataset = prepare_table(tmp_path)
    assert dataset.train_rows + dataset.val_rows + dataset.test_rows == 1797
    # Assigned by hash: close to the configured 70/20/10, not exactly.
    assert abs(dataset.val_rows / 1797 - 0.2) < 0.03 and abs(dataset.test_rows / 1797 - 0.1) < 0.03
    assert dataset.num_features == 64 and dataset.class_labels == tuple(str(i) for i in range(10))
    assert "test_fraction" not in dataset.split_rule and "u < 0.1" in dataset.split_rule
    x_train, y_train = read_split(dataset, "train")
    x_val, y_val = read_split(dataset, "val")
    x_test, y_test = read_split(dataset, "test")
    assert x_train.shape == (dataset.train_rows, 64) and x_test.shape == (dataset.test_rows, 64)
    assert np.abs(x_train.mean(axis=0)).max() < 1e-5  # standardised with train statistics
    assert set(np.unique(y_val)) == set(range(10)) and set(np.unique(y_test)) == set(range(10))
    rows = {tuple(row) for row in read_split(dataset, "train", standardised=False)[0]}
    assert not any(tuple(row) in rows for row in read_split(dataset, "test", standardised=False)[0])


def test_rows_keep_their_split_as_the_data_grows(tmp_path: Path) -> None:
    """Champion trained on N rows, data grows, run 2 retrains: no test row of run 2 was a training row of run 1."""
    rng = np.random.default_rng(7)
    frame = pd.DataFrame(rng.normal(size=(3000, 4)), columns=["a", "b", "c", "d"])
    frame["label"] = (frame["a"] + frame["b"] > 0).astype(int)
    small, grown = tmp_path / "small.csv", tmp_path / "grown.csv"
    frame.iloc[:2000].to_csv(small, index=False)
    frame.sample(frac=1.0, random_state=3).to_csv(grown, index=False)  # more rows, and in another order
    first = prepare_table(tmp_path, dataset=str(small))
    second = prepare_table(tmp_path, dataset=str(grown))
    assert first.content_hash != second.content_hash

    def rows(dataset: object, split: str) -> set[tuple[float, ...]]:
        return {tuple(r) for r in read_split(dataset, split, standardised=False)[0]}  # type: ignore[arg-type]

    assert rows(second, "test").isdisjoint(rows(first, "train"))
    assert rows(first, "test") <= rows(second, "test")  # every old test row is still a test row
    assert rows(first, "val") <= rows(second, "val")


def test_a_key_column_decides_the_split_and_is_not_a_feature(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    frame = pd.DataFrame({"customer_id": np.arange(500), "x": rng.normal(size=500), "label": np.arange(500) % 2})
    path = tmp_path / "keyed.csv"
    frame.to_csv(path, index=False)
    dataset = prepare_table(tmp_path, dataset=str(path), split_key_column="customer_id")
    assert dataset.feature_names == ("x",)
    assert "column 'customer_id'" in dataset.split_rule


def test_same_input_reuses_the_version(tmp_path: Path) -> None:
    """prepare-data of the same table and settings again stores nothing new: the stored version is reused."""
    from raytrain_driver.preflight import resolve_code
    from raytrain_driver.user_data import prepare_user_data

    config = small_config(tmp_path)
    first = prepare_user_data(config, resolve_code(config))
    assert first is not None and Path(first.uri) == tmp_path / "storage" / "datasets" / first.content_hash
    stored = {path: path.stat().st_mtime_ns for path in Path(first.uri).rglob("*")}
    second = prepare_user_data(config, resolve_code(config))
    assert second == first
    assert {path: path.stat().st_mtime_ns for path in Path(first.uri).rglob("*")} == stored  # reused, not rewritten
    assert len(list((tmp_path / "storage" / "datasets").iterdir())) == 1


def test_a_different_split_is_a_different_version(tmp_path: Path) -> None:
    a = prepare_table(tmp_path, val_fraction=0.2)
    b = prepare_table(tmp_path, val_fraction=0.3)
    assert a.content_hash != b.content_hash
    assert b.val_rows > a.val_rows


def test_csv_with_named_label_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(200, 3)), columns=["a", "b", "c"])
    frame["species"] = np.where(frame["a"] > 0, "setosa", "virginica")
    path = tmp_path / "flowers.csv"
    frame.to_csv(path, index=False)
    dataset = prepare_table(tmp_path, dataset=str(path), label_column="species")
    assert dataset.feature_names == ("a", "b", "c")
    assert dataset.class_labels == ("setosa", "virginica")
    assert dataset.train_rows + dataset.val_rows + dataset.test_rows == 200


def test_parquet_file_works_too(tmp_path: Path) -> None:
    frame = pd.DataFrame({"x": np.arange(100.0), "y": np.arange(100.0) ** 2, "target": np.arange(100) % 2})
    path = tmp_path / "data.parquet"
    frame.to_parquet(path)
    dataset = prepare_table(tmp_path, dataset=str(path), label_column="target")
    assert dataset.num_classes == 2 and dataset.num_features == 2


def test_missing_label_column_names_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    pd.DataFrame({"x": range(20), "y": range(20)}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match="label column 'label' is not in dataset.*set `label_column`"):
        prepare_table(tmp_path, dataset=str(path))


def test_missing_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist; set `dataset`"):
        prepare_table(tmp_path, dataset=str(tmp_path / "nope.csv"))


def test_non_numeric_features_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    pd.DataFrame({"colour": ["red", "blue"] * 10, "label": [0, 1] * 10}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match="non-numeric feature columns \\['colour'\\]"):
        prepare_table(tmp_path, dataset=str(path))


@pytest.mark.parametrize(
    ("rows", "says"), [(0, "has no rows, only a header; it needs at least 10 rows"), (3, "has 3 rows; it needs")]
)
def test_a_table_with_too_few_rows_says_so_not_that_its_columns_are_non_numeric(
    tmp_path: Path, rows: int, says: str
) -> None:
    path = tmp_path / "data.csv"
    pd.DataFrame({"a": range(rows), "b": range(rows), "label": [0, 1, 0][:rows]}).to_csv(path, index=False)
    with pytest.raises(DatasetError, match=says):
        prepare_table(tmp_path, dataset=str(path))


def _csv(tmp_path: Path, frame: pd.DataFrame) -> str:
    path = tmp_path / "bad.csv"
    frame.to_csv(path, index=False)
    return str(path)


def _frame(rows: int = 300) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(rows, 2)), columns=["x", "y"])
    frame["label"] = np.arange(rows) % 3
    return frame


@pytest.mark.parametrize(
    ("spoil", "overrides", "message"),
    [
        (lambda f: f.assign(y=f["y"].where(f.index != 17)), {}, "feature column 'y' has 1 NaN or infinite values"),
        (lambda f: f.assign(x=f["x"].where(f.index != 3, np.inf)), {}, "feature column 'x' has 1 NaN or infinite"),
        (lambda f: f.assign(label=f["label"].where(f.index != 5)), {}, "1 rows have no value in label column 'label'"),
        (lambda f: pd.concat([f, f.iloc[:2].assign(label=9)]), {}, "class '9' of 'label' has 2 rows; each class needs"),
        (
            lambda f: f.iloc[:30],
            {"test_fraction": 0.05},
            "the test split has .* rows, fewer than the 3 classes; raise `test_fraction`",
        ),
    ],
)
def test_data_that_cannot_train_or_be_scored_is_refused_naming_column_and_setting(
    tmp_path: Path, spoil: object, overrides: dict[str, object], message: str
) -> None:
    path = _csv(tmp_path, spoil(_frame()))  # type: ignore[operator]
    with pytest.raises(DatasetError, match=message):
        prepare_table(tmp_path, dataset=path, **overrides)


def test_a_split_that_changed_after_it_was_prepared_is_refused_when_read(tmp_path: Path) -> None:
    """Another valid Parquet file in place of the train split (the val split, copied over it) is refused by the
    reader, naming the file and both SHA-256 digests."""
    dataset = prepare_table(tmp_path)
    train = Path(dataset.split_uri("train"))
    train.write_bytes(Path(dataset.split_uri("val")).read_bytes())
    with pytest.raises(DatasetError, match="SHA-256") as refused:
        read_split(dataset, "train")
    assert str(train) in str(refused.value) and dataset.split_sha256["train"] in str(refused.value)
    read_split(dataset, "val")  # the others still read
