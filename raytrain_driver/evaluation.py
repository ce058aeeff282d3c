"""The best checkpoint as a model: loaded on the driver, scored on the validation split, shown in MLflow."""

from __future__ import annotations

import json
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_tasks.data import DatasetRef, read_split
from raytrain_tasks.prepared import RunData, is_builtin_dataset
from raytrain_tasks.reports import EVALUATION_ARTIFACT_DIR, dataset_summary, evaluation_report, write_report_files
from raytrain_tasks.storage.filesystem import StorageOptions
from raytrain_tasks.storage.locations import download_dir, locate

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from raytrain_driver.fit_record import FitResult


@dataclass(frozen=True)
class Scores:
    """A model's scores on one split; comparable only with scores on the same split."""

    accuracy: float
    loss: float

    def get(self, metric: str) -> float:
        return float(getattr(self, metric))


def load_checkpoint_model(checkpoint_uri: str, options: StorageOptions, expected_digest: str) -> Any:
    """Rebuild the network stored in a checkpoint (local or remote storage), in eval mode, on CPU.

    ``expected_digest``: the manifest digest the run recorded in MLflow when the checkpoint was committed
    (``raytrain_tasks.tracking.pins.recorded_digest``); a checkpoint that no longer has it is refused before
    anything is loaded.
    """
    from raytrain_tasks.checkpoint import load_weights, manifest_digest
    from raytrain_tasks.errors import UnsafeCheckpointError
    from raytrain_tasks.models import build_model

    with tempfile.TemporaryDirectory(prefix="prt-model-") as tmp:
        directory = download_dir(locate(checkpoint_uri, options), Path(tmp) / "checkpoint")
        actual = manifest_digest(directory)
        if actual != expected_digest:
            raise UnsafeCheckpointError(
                f"checkpoint {checkpoint_uri} is not the one its run committed: its manifest hashes to "
                f"{actual[:12]}..., the MLflow run recorded {expected_digest[:12]}.... Someone or something replaced "
                "it in storage; check who can write `storage_path`; nothing was loaded or registered"
            )
        state, weights = load_weights(directory)
    spec = state.spec
    model = build_model(spec.model, spec.in_features, spec.num_classes, spec.hidden_sizes)
    model.load_state_dict(weights)
    return model.eval()


PREDICT_BATCH_ROWS = 4096  # rows per forward pass when scoring a split: bounded memory, whatever the split's size


def predict_logits(model: Any, features: np.ndarray, batch_rows: int = PREDICT_BATCH_ROWS) -> np.ndarray:
    """The model's logits for ``features``, ``batch_rows`` rows per forward pass."""
    import torch

    with torch.no_grad():
        parts = [
            model(torch.from_numpy(features[start : start + batch_rows])).numpy()
            for start in range(0, len(features), batch_rows)
        ]
    return np.concatenate(parts) if parts else np.empty((0, 0), dtype=np.float32)


def score(logits: np.ndarray, labels: np.ndarray) -> Scores:
    """Accuracy and mean cross-entropy, computed the way the train loop computes them."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(len(labels)), labels].mean())
    return Scores(accuracy=float((logits.argmax(axis=1) == labels).mean()), loss=loss)


def log_dataset_input(client: MlflowClient, run_id: str, dataset: RunData) -> None:
    """Record the run's prepared data version as its training input (lineage in the MLflow UI's Datasets column
    and run page): the built-in classifier's table, with its feature columns as the schema, or the folder your
    code's ``prepare`` wrote, by its content hash."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.types import ColSpec, DataType, Schema

    schema = (
        Schema([ColSpec(DataType.float, name) for name in dataset.feature_names])
        if is_builtin_dataset(dataset)
        else None
    )
    with warnings.catch_warnings():
        # MLflow registers LocalArtifactDatasetSource twice and warns that a local path "can be interpreted in
        # multiple ways" (the two are the same class): nothing for the user to act on.
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
        source = resolve_dataset_source(dataset.uri)
    meta = MetaDataset(  # type: ignore[abstract]  # concrete at runtime; the stub marks profile abstract
        source,
        name=f"{dataset.source}-{dataset.content_hash}",
        digest=dataset.content_hash[:36],  # MLflow keeps at most 36 characters of a digest
        schema=schema,
    )
    entity = meta._to_mlflow_entity()
    summary = dataset.sizes() if isinstance(dataset, DatasetRef) else dataset.summary
    if summary:  # the MLflow UI shows a dataset's profile beside its digest
        entity = Dataset(
            entity.name,
            entity.digest,
            entity.source_type,
            entity.source,
            entity.schema,
            json.dumps({"summary": summary}),
        )
    client.log_inputs(run_id, datasets=[DatasetInput(entity, tags=[InputTag("mlflow.data.context", "training")])])


def log_evaluation(
    client: MlflowClient,
    run_id: str,
    dataset: DatasetRef,
    fit: FitResult,
    checkpoint: dict[str, Any],
    options: StorageOptions,
    expected_digest: str,
    model_id: str | None,
) -> dict[str, float]:
    """Score the best checkpoint on the validation and test splits, log plots and reports as run artifacts and
    the scores as metrics (``best_checkpoint_*`` at the best epoch's step, linked to the checkpoint's LoggedModel
    ``model_id``); returns them (``val_accuracy``, ``val_loss``, ``test_accuracy``, ``test_loss``)."""
    model = load_checkpoint_model(checkpoint["uri"], options, expected_digest)
    _, y_train = read_split(dataset, "train", options)
    x_val, y_val = read_split(dataset, "val", options)
    x_test, y_test = read_split(dataset, "test", options)
    logits = predict_logits(model, x_val)
    test_scores = score(predict_logits(model, x_test), y_test)
    evaluation = evaluation_report(logits, y_val, dataset.class_labels)
    with tempfile.TemporaryDirectory(prefix="prt-report-") as tmp:
        write_report_files(
            Path(tmp),
            history=fit.history,
            evaluation=evaluation,
            summary=dataset_summary(dataset, y_train, y_val),
            class_labels=dataset.class_labels,
            checkpoint_pointer=checkpoint,
        )
        client.log_artifacts(run_id, tmp, artifact_path=EVALUATION_ARTIFACT_DIR)
    val_scores = score(logits, y_val)
    scores = {
        "val_accuracy": val_scores.accuracy,
        "val_loss": val_scores.loss,
        "test_accuracy": test_scores.accuracy,
        "test_loss": test_scores.loss,
    }
    client.log_batch(run_id, metrics=scores_as_metrics(scores, fit.best_epoch, model_id))
    return scores


def scores_as_metrics(scores: dict[str, float], best_epoch: int, model_id: str | None) -> list[Metric]:
    """``best_checkpoint_<score>`` at the best epoch's step, linked to the LoggedModel ``model_id``.

    A fixed timestamp: a retry logs the same points, which MLflow skips instead of adding a second one.
    """
    from mlflow.entities import Metric

    return [Metric(f"best_checkpoint_{k}", v, 0, best_epoch, model_id=model_id) for k, v in scores.items()]
