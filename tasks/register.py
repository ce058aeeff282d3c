"""register-model: log the best checkpoint's model to MLflow, register a version, decide its alias."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.data import DatasetRef, read_split
from raytrain_tasks.errors import TrackingError
from tasks import tracking
from tasks.fit import FitResult
from tasks.promotion import Promotion, PromotionDecision, decide_promotion
from tasks.storage import download_dir, locate

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous_champion"
PROMOTION_METRIC = "val_accuracy"


class ModelRef(BaseModel):
    """The registered version and what was decided about it."""

    model_config = ConfigDict(frozen=True)

    name: str
    version: str
    model_uri: str
    aliases: tuple[str, ...]
    decision: str
    reason: str
    val_accuracy: float
    champion_version: str | None
    champion_val_accuracy: float | None


@task(name="register-model", task_run_name="register-{fit.run_key}", cache_policy=NONE)
def register_model(config: TrainingConfig, dataset: DatasetRef, fit: FitResult) -> ModelRef:
    """Log the best checkpoint as an MLflow model in the fit's run and register a version of it."""
    import mlflow

    logger = get_run_logger()
    client = tracking.connect(config.mlflow_tracking_uri)
    x_val, y_val = read_split(dataset, "val")
    with tempfile.TemporaryDirectory(prefix="prt-register-") as tmp:
        checkpoint_dir = download_dir(locate(fit.best_checkpoint_uri), Path(tmp) / "checkpoint")
        model = _model_from_checkpoint(checkpoint_dir)
    candidate_score = _accuracy(model, x_val, y_val)

    mlflow.set_tracking_uri(config.mlflow_tracking_uri)
    with mlflow.start_run(run_id=fit.mlflow_run_id):
        info = _log_model(model, x_val, dataset, fit)
    # Register only after the upload succeeded: a version never points at missing artifacts.
    version = mlflow.register_model(info.model_uri, config.model_name, tags=_version_tags(dataset, fit))
    client.update_model_version(
        config.model_name,
        version.version,
        description=(
            f"{config.model} trained on dataset {dataset.content_hash} ({dataset.source}) by run {fit.run_key}; "
            f"val_accuracy {candidate_score:.4f} at epoch {fit.best_epoch}. Inputs: standardised features "
            "(mean/std in preprocessing.json of the run)."
        ),
    )
    champion_version, champion_score = _current_champion(client, config.model_name, x_val, y_val)
    decision = decide_promotion(
        candidate_score, champion_score, min_improvement=config.min_improvement, promote=config.promote
    )
    aliases = _apply_decision(client, config.model_name, version.version, champion_version, decision)
    logger.info(
        "registered %s version %s (val_accuracy %.4f): %s, %s",
        config.model_name,
        version.version,
        candidate_score,
        decision.action.value,
        decision.reason,
    )
    return ModelRef(
        name=config.model_name,
        version=str(version.version),
        model_uri=f"models:/{config.model_name}/{version.version}",
        aliases=aliases,
        decision=decision.action.value,
        reason=decision.reason,
        val_accuracy=candidate_score,
        champion_version=champion_version,
        champion_val_accuracy=champion_score,
    )


def _model_from_checkpoint(checkpoint_dir: Path) -> Any:
    from raytrain_tasks.checkpoint import load_checkpoint
    from raytrain_tasks.models import build_model

    loaded = load_checkpoint(checkpoint_dir)
    spec = loaded.state.spec
    model = build_model(spec.model, spec.in_features, spec.num_classes, spec.hidden_sizes)
    model.load_state_dict(loaded.model_state)
    return model.eval()


def _accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(1).numpy()
    return float((predicted == y).mean())


def _log_model(model: Any, x_val: np.ndarray, dataset: DatasetRef, fit: FitResult) -> Any:
    import mlflow
    import torch

    preprocessing = {
        "feature_names": dataset.feature_names,
        "feature_mean": dataset.feature_mean,
        "feature_std": dataset.feature_std,
        "class_labels": dataset.class_labels,
        "output": "logits; argmax is the index into class_labels",
    }
    mlflow.log_text(json.dumps(preprocessing, indent=1), "preprocessing.json")
    return mlflow.pytorch.log_model(
        model,
        name="model",
        input_example=x_val[:5],
        # Explicit requirements: inferring them spawns a subprocess that costs ~8 s.
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"],
        metadata={"run_key": fit.run_key, "dataset_hash": dataset.content_hash},
    )


def _version_tags(dataset: DatasetRef, fit: FitResult) -> dict[str, str]:
    return {
        "run_key": fit.run_key,
        "dataset_hash": dataset.content_hash,
        "best_epoch": str(fit.best_epoch),
        PROMOTION_METRIC: f"{fit.best_metrics.get(PROMOTION_METRIC, float('nan')):.6f}",
    }


def _current_champion(
    client: MlflowClient, name: str, x_val: np.ndarray, y_val: np.ndarray
) -> tuple[str | None, float | None]:
    """The champion's version and its accuracy on *this* validation data (None if it cannot score it)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None, None
    try:
        model = mlflow.pyfunc.load_model(f"models:/{name}/{champion.version}")
        logits = np.asarray(model.predict(x_val))
    except Exception:  # noqa: BLE001 - an incompatible champion (other features) is not comparable
        return str(champion.version), None
    if logits.ndim != 2 or logits.shape[0] != len(y_val):
        return str(champion.version), None
    return str(champion.version), float((logits.argmax(1) == y_val).mean())


def _apply_decision(
    client: MlflowClient,
    name: str,
    version: str,
    champion_version: str | None,
    decision: PromotionDecision,
) -> tuple[str, ...]:
    from mlflow.exceptions import MlflowException

    tags = {
        "promotion.decision": decision.action.value,
        "promotion.reason": decision.reason,
        "promotion.metric": PROMOTION_METRIC,
        "promotion.candidate_score": f"{decision.candidate_score:.6f}",
        "promotion.champion_score": "" if decision.champion_score is None else f"{decision.champion_score:.6f}",
        "promotion.champion_version": champion_version or "",
    }
    try:
        for key, value in tags.items():
            client.set_model_version_tag(name, version, key, value)
        if decision.action is Promotion.PROMOTE:
            if champion_version is not None:
                client.set_registered_model_alias(name, PREVIOUS_CHAMPION, champion_version)
            client.set_registered_model_alias(name, CHAMPION, version)
            return (CHAMPION,)
        client.set_registered_model_alias(name, CHALLENGER, version)
        return (CHALLENGER,)
    except MlflowException as exc:
        raise TrackingError(f"could not set aliases on {name} version {version}: {exc}") from exc
