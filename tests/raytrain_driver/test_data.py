"""prepare-data: deterministic splits, standardised features, content-addressed versions, clear errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from raytrain_driver.dataset import prepare_dataset
from raytrain_tasks.data import MANIFEST_NAME, read_split
from raytrain_tasks.errors import DatasetError
from tests.helpers import small_config


def test_digits_is_split_standardised_and_stored(tmp_path: Path) -> None:
    dataset = prepare_dataset(small_config(tmp_path))
    assert dataset.train_rows + dataset.val_rows + dataset.test_rows == 1797
    # Assigned by hash: close to the configured 70/20/10, not exactly.
    assert abs(dataset.val_rows / 1797 - 0.2) < 0.03 and abs(dataset.test_rows / 1797 - 0.1) < 0.03
    assert dataset.num_features == 64 and dataset.class_labels == tuple(str(i) for i in range(10))
    assert Path(dataset.uri) == tmp_path / "storage" / "datasets" / dataset.content_hash
    assert "test_fraction" not in dataset.split_rule and "u < 0.1" in dataset.split_rule
    x_train, y_train = read_split(dataset, "train")
    x_val, y_val = read_split(dataset, "val")
    x_test, y_test = read_split(dataset, "test")
    assert x_train.shape == (dataset.train_rows, 64) and x_test.shape == (dataset.test_rows, 64)
    assert np.abs(x_train.mean(axis=0)).max() < 1e-5  # standardised with train statistics
    assert set(np.unique(y_val)) == set(range(10)) and set(np.unique(y_test)) == set(range(10))
    rows = {tuple(row) for row in read_split(dataset, "train", standardised=False)[0]}
    assert not any(tuple(row) in rows for row in read_split(dataset, "test", standardised=False)[0])


def test_a_version_written_again_never_truncates_a_split_a_reader_has_open(tmp_path: Path) -> None:
    """Two prepare-data runs of the same version at once (the folder has no manifest yet, so both write): the
    second replaces each split whole. A fit's worker that opened the first one's file keeps reading all of it
    (writing in place truncated it under that reader)."""
    config = small_config(tmp_path)
    dataset = prepare_dataset(config)
    split = Path(dataset.uri) / "train.parquet"
    original = split.read_bytes()
    with split.open("rb") as reader:  # a worker in the middle of reading its split
        held = os.fstat(reader.fileno())
        (Path(dataset.uri) / MANIFEST_NAME).unlink()  # the version is incomplete again: the next run writes it
        assert prepare_dataset(config).split_sha256 == dataset.split_sha256
        # The file the reader holds was never written to (in place, it was truncated, then filled again while
        # the reader went on reading); the new bytes went to a new file renamed over it.
        assert os.fstat(reader.fileno()).st_mtime_ns == held.st_mtime_ns
        assert reader.read() == original
    assert split.read_bytes() == original
    assert not list(Path(dataset.uri).glob("*.tmp"))  # nothing left behind


def test_rows_keep_their_split_as_the_data_grows(tmp_path: Path) -> None:
    """Champion trained on N rows, data grows, run 2 retrains: no test row of run 2 was a training row of run 1."""
    rng = np.random.default_rng(7)
    frame = pd.DataFrame(rng.normal(size=(3000, 4)), columns=["a", "b", "c", "d"])
    frame["label"] = (frame["a"] + frame["b"] > 0).astype(int)
    small, grown = tmp_path / "small.csv", tmp_path / "grown.csv"
    frame.iloc[:2000].to_csv(small, index=False)
    frame.sample(frac=1.0, random_state=3).to_csv(grown, index=False)  # more rows, and in another order
    first = prepare_dataset(small_config(tmp_path, dataset=str(small)))
    second = prepare_dataset(small_config(tmp_path, dataset=str(grown)))
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
    dataset = prepare_dataset(small_config(tmp_path, dataset=str(path), split_key_column="customer_id"))
    assert dataset.feature_names == ("x",)
    assert "column 'customer_id'" in dataset.split_rule


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
    a = prepare_dataset(small_config(tmp_path, val_fraction=0.2))
    b = prepare_dataset(small_config(tmp_path, val_fraction=0.3))
    assert a.content_hash != b.content_hash
    assert b.val_rows > a.val_rows


def test_csv_with_named_label_column(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(200, 3)), columns=["a", "b", "c"])
    frame["species"] = np.where(frame["a"] > 0, "setosa", "virginica")
    path = tmp_path / "flowers.csv"
    frame.to_csv(path, index=False)
    dataset = prepare_dataset(small_config(tmp_path, dataset=str(path), label_column="species"))
    assert dataset.feature_names == ("a", "b", "c")
    assert dataset.class_labels == ("setosa", "virginica")
    assert dataset.train_rows + dataset.val_rows + dataset.test_rows == 200


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
        prepare_dataset(small_config(tmp_path, dataset=path, **overrides))
    assert not (tmp_path / "storage" / "datasets").exists() or not any((tmp_path / "storage" / "datasets").iterdir())


def test_a_split_that_changed_after_it_was_prepared_is_refused_when_read(tmp_path: Path) -> None:
    """Another valid Parquet file in place of the train split (the val split, copied over it) is refused by every
    reader, naming the file and both SHA-256 digests."""
    config = small_config(tmp_path)
    dataset = prepare_dataset(config)
    train = Path(dataset.split_uri("train"))
    train.write_bytes(Path(dataset.split_uri("val")).read_bytes())
    with pytest.raises(DatasetError, match="SHA-256") as refused:
        read_split(prepare_dataset(config), "train")  # the torch loader, scoring, registration
    assert str(train) in str(refused.value) and dataset.split_sha256["train"] in str(refused.value)
    from raytrain_tasks.data import check_split_file

    with pytest.raises(DatasetError, match="SHA-256") as refused:
        check_split_file(prepare_dataset(config), "train")  # before Ray Data's read tasks
    assert str(train) in str(refused.value)
    read_split(dataset, "val")  # the others still read


def test_a_manifest_that_changed_after_it_was_prepared_is_refused(tmp_path: Path) -> None:
    """dataset.json's train statistics (which standardise every input) must be those of the data it is named after."""
    import json

    config = small_config(tmp_path)
    dataset = prepare_dataset(config)
    manifest = Path(dataset.uri) / MANIFEST_NAME
    stored = json.loads(manifest.read_text())
    stored["feature_mean"][3] += 0.5
    manifest.write_text(json.dumps(stored))
    with pytest.raises(DatasetError, match="feature_mean") as refused:
        prepare_dataset(config)
    assert MANIFEST_NAME in str(refused.value) and dataset.content_hash in str(refused.value)
