"""What a run shows in MLflow beside its epochs: its prepared data as the run's input, and the best checkpoint's
scores as ``best_checkpoint_*`` metrics linked to its LoggedModel."""

from __future__ import annotations

import json
import warnings
from typing import TYPE_CHECKING

from raytrain_tasks.prepared import RunData
from raytrain_tasks.reports import EVALUATION_ARTIFACT_DIR

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

__all__ = ["EVALUATION_ARTIFACT_DIR", "PREDICT_BATCH_ROWS", "log_dataset_input", "scores_as_metrics"]

PREDICT_BATCH_ROWS = 4096  # rows per forward pass when scoring a split: bounded memory, whatever the split's size


def log_dataset_input(client: MlflowClient, run_id: str, dataset: RunData) -> None:
    """Record the run's prepared data version as its training input (lineage in the MLflow UI's Datasets column
    and run page): the folder your code's ``prepare`` wrote, by its content hash, with the line it returned."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import Dataset, DatasetInput, InputTag

    with warnings.catch_warnings():
        # MLflow registers LocalArtifactDatasetSource twice and warns that a local path "can be interpreted in
        # multiple ways" (the two are the same class): nothing for the user to act on.
        warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
        source = resolve_dataset_source(dataset.uri)
    meta = MetaDataset(  # type: ignore[abstract]  # concrete at runtime; the stub marks profile abstract
        source,
        name=f"{dataset.source}-{dataset.content_hash}",
        digest=dataset.content_hash[:36],  # MLflow keeps at most 36 characters of a digest
        schema=None,
    )
    entity = meta._to_mlflow_entity()
    summary = dataset.summary
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


def scores_as_metrics(scores: dict[str, float], best_epoch: int, model_id: str | None) -> list[Metric]:
    """``best_checkpoint_<score>`` at the best epoch's step, linked to the LoggedModel ``model_id``.

    A fixed timestamp: a retry logs the same points, which MLflow skips instead of adding a second one.
    """
    from mlflow.entities import Metric

    return [Metric(f"best_checkpoint_{k}", v, 0, best_epoch, model_id=model_id) for k, v in scores.items()]
