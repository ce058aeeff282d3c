"""register-model for the built-in classifier: what differs from the user's own code (raytrain_driver/user_register.py).

Its model takes raw features and standardises them itself (the train split's statistics in the run's
preprocessing.json); its input example is synthetic; a champion is comparable only when it was trained on the
same input schema (feature names and class labels, ``SCHEMA_TAG``) and is re-scored on this run's test split.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_driver.champion import (
    SCHEMA_TAG,
    TRAIN_CODE_TAG,
    check_model_layout,
    digest_of_schema,
    download_model,
    predict_without_pickles,
    read_champion,
)
from raytrain_driver.evaluation import load_checkpoint_model, score
from raytrain_driver.fit_record import FitResult
from raytrain_driver.promotion import CHAMPION, Champion
from raytrain_tasks.builtin_aliases import TABLE_CLASSIFIER
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.data import DatasetRef, read_split
from raytrain_tasks.models import with_standardisation

if TYPE_CHECKING:
    from mlflow import MlflowClient


def builtin_model(
    config: TrainingConfig, dataset: DatasetRef, fit: FitResult, digest: str
) -> tuple[Any, np.ndarray, dict[str, str], dict[str, str]]:
    """The model to register from the best checkpoint (verified against ``digest``): (model, input example,
    metadata, text artifacts of the run)."""
    # The registered model takes raw features (it standardises them itself), as a user's data comes.
    model = with_standardisation(
        load_checkpoint_model(fit.best_checkpoint_uri, config.storage_options, digest),
        dataset.feature_mean,
        dataset.feature_std,
    ).eval()
    preprocessing = {
        "feature_names": dataset.feature_names,
        "feature_mean": dataset.feature_mean,
        "feature_std": dataset.feature_std,
        "class_labels": dataset.class_labels,
        "input": "raw features in feature_names order; the model applies (x - feature_mean) / feature_std",
        "output": "logits; argmax is the index into class_labels",
    }
    metadata = {"run_key": fit.run_key, "dataset_hash": dataset.content_hash}
    return model, input_example(config, dataset), metadata, {"preprocessing.json": json.dumps(preprocessing, indent=1)}


def schema_digest(dataset: DatasetRef) -> str:
    """What a model's input and output mean: feature names in order, and class labels in order (the table
    classifier's ``schema``, raytrain_tasks.table_classifier, gives the same)."""
    return digest_of_schema({"features": list(dataset.feature_names), "classes": list(dataset.class_labels)})


def assess_champion_on_test_split(client: MlflowClient, config: TrainingConfig, dataset: DatasetRef) -> Champion:
    """The current champion scored on this run's test split, by the config's gate metric."""
    x_test, y_test = read_split(dataset, "test", config.storage_options, standardised=False)
    return assess_champion(client, config.model_name, schema_digest(dataset), x_test, y_test, config.gate.name)


def assess_champion(
    client: MlflowClient, name: str, digest: str, x_test: np.ndarray, y_test: np.ndarray, metric: str
) -> Champion:
    """The current champion scored on this run's test split; only a missing alias means there is none.

    It is scored only in this project's exact pt2 layout, from the local copy that was checked
    (raytrain_driver.champion).
    """
    found = read_champion(client, name)
    if isinstance(found, Champion):
        return found
    version, tags = found
    if tags.get(TRAIN_CODE_TAG, TABLE_CLASSIFIER) != TABLE_CLASSIFIER:  # another's model: its inputs are its own
        return Champion(
            version,
            incomparable=f"it was trained by train_code {tags[TRAIN_CODE_TAG]!r}, this run by the built-in classifier",
        )
    recorded = tags.get(SCHEMA_TAG)
    if recorded is None:
        return Champion(version, incomparable="it records no input schema (registered by an older release)")
    if recorded != digest:
        return Champion(
            version,
            incomparable=f"its input schema {recorded} (features, class labels) differs from this run's {digest}",
        )
    try:
        with tempfile.TemporaryDirectory(prefix="prt-champion-") as scratch:
            local = download_model(f"models:/{name}/{version}", Path(scratch))
            layout = check_model_layout(local)
            if layout.foreign:
                return Champion(version, incomparable=layout.foreign)
            if layout.tampered:
                return Champion(
                    version,
                    error=f"{name} version {version} was refused: {layout.tampered}. Look at who wrote there, then "
                    f"remove those files or point '{CHAMPION}' at a version you trust",
                )
            logits = predict_without_pickles(local, x_test)
    except Exception as exc:  # noqa: BLE001 - any failure to load or run the champion leaves it in place (tested)
        return Champion(
            version, error=f"loading or scoring {name} version {version} failed: {type(exc).__name__}: {exc}"
        )
    if logits.ndim != 2 or logits.shape[0] != len(y_test) or logits.shape[1] <= int(y_test.max()):
        return Champion(version, error=f"{name} version {version} returned outputs of shape {logits.shape}")
    return Champion(version, score=score(logits, y_test).get(metric.removeprefix("test_")))


def input_example(config: TrainingConfig, dataset: DatasetRef) -> np.ndarray:
    """The logged model's input example: no real record unless `input_example='validation_rows'`.

    The artifact store is often readable by more people than the training data (anyone with the MLflow UI),
    and a row of it may be personal data. The synthetic rows (mean, mean - std, mean + std of the training
    split, already in preprocessing.json) give MLflow the schema and the shapes it needs to export the model.
    """
    if config.input_example == "validation_rows":
        x_val, _ = read_split(dataset, "val", config.storage_options, standardised=False)
        return np.array(x_val[:5])
    mean = np.asarray(dataset.feature_mean, dtype=np.float32)
    std = np.asarray(dataset.feature_std, dtype=np.float32)
    return np.stack([mean, mean - std, mean + std]).astype(np.float32)
