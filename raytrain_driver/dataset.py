"""What prepare-data does for the built-in classifier (the Prefect task is tasks/data.py): the run's table
(raytrain_tasks/tables.py), stored as a content-addressed version in shared storage."""

from __future__ import annotations

import numpy as np

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.data import MANIFEST_NAME, SPLITS, DatasetRef
from raytrain_tasks.errors import DatasetError
from raytrain_tasks.storage.locations import DATASETS_DIR, StorageLocation, check_writable, locate
from raytrain_tasks.tables import dataset_hash, load_raw_frame, plan_version, write_version


def prepare_dataset(config: TrainingConfig) -> DatasetRef:
    # Storage first: a wrong bucket or bad credentials fail in seconds, before any data is loaded.
    root = locate(config.storage_path, config.storage_options)
    check_writable(root, create_bucket=config.create_bucket)
    frame = load_raw_frame(config)
    content_hash = dataset_hash(frame, config)
    target = root.child(DATASETS_DIR, content_hash)
    manifest = target.child(MANIFEST_NAME)
    planned, splits = plan_version(frame, config, target, content_hash)
    if manifest.exists():
        stored = _read_manifest(manifest, content_hash)
        if stored is not None:
            _check_manifest(stored, planned, manifest)
            return stored.model_copy(update={"uri": target.uri})
    return write_version(planned, splits, target)


def _read_manifest(manifest: StorageLocation, content_hash: str) -> DatasetRef | None:
    """The stored version's dataset.json; None for one an older release wrote (no split digests: rewritten)."""
    from pydantic import ValidationError

    try:
        stored = DatasetRef.model_validate_json(manifest.read_text())
    except (ValidationError, ValueError) as exc:
        raise DatasetError(
            f"{manifest.uri} is not a dataset manifest ({exc}); delete its folder and run prepare-data again"
        ) from exc
    if stored.content_hash != content_hash:
        raise DatasetError(
            f"{manifest.uri} names dataset {stored.content_hash}, but it lies in the folder of {content_hash} (the "
            "hash of `dataset` as loaded now); delete the folder and run prepare-data again"
        )
    return stored if set(stored.split_sha256) == set(SPLITS) else None


def _check_manifest(stored: DatasetRef, planned: DatasetRef, manifest: StorageLocation) -> None:
    """dataset.json must say what the data its folder is named after gives: the same splits, columns, classes and
    train statistics (standardisation reads them from here, on every worker and in the registered model)."""
    differs = [
        name
        for name in (
            "source",
            "label_column",
            "feature_names",
            "class_labels",
            "train_rows",
            "val_rows",
            "test_rows",
            "split_rule",
        )
        if getattr(stored, name) != getattr(planned, name)
    ]
    for name in ("feature_mean", "feature_std"):
        a, b = np.asarray(getattr(stored, name)), np.asarray(getattr(planned, name))
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-6, atol=1e-7):
            differs.append(name)
    if differs:
        raise DatasetError(
            f"{manifest.uri} does not describe the data of dataset {planned.content_hash} (differs in "
            f"{', '.join(differs)}): it changed after it was prepared; delete its folder and run prepare-data again"
        )
