"""register-model: log the best checkpoint's model to MLflow, register a version, decide its alias.

Order matters: the model's artifacts are uploaded first, the version is registered only after that
succeeded, and the champion decision runs under a registry-wide lock, so two pipelines finishing at once
compare against each other rather than both against the old champion.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.data import DatasetRef, read_split
from raytrain_tasks.errors import TrackingError
from raytrain_tasks.models import with_standardisation
from tasks import tracking
from tasks.evaluation import Scores, load_checkpoint_model, predict_logits, score
from tasks.fit import FitResult
from tasks.promotion import Promotion, PromotionDecision, decide_promotion

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous_champion"
LOCK_SUFFIX = ".promotion-lock"
LOCK_TIMEOUT_S = 300.0
LOCK_STALE_AFTER_S = 900.0


class ModelRef(BaseModel):
    """The registered version and what was decided about it."""

    model_config = ConfigDict(frozen=True)

    name: str
    version: str
    model_uri: str
    aliases: tuple[str, ...]
    decision: str
    reason: str
    metric: str
    score: float
    champion_version: str | None
    champion_score: float | None


@task(name="register-model", task_run_name="register-{fit.run_key}", cache_policy=NONE)
def register_model(config: TrainingConfig, dataset: DatasetRef, fit: FitResult) -> ModelRef:
    """Log the best checkpoint as an MLflow model in the fit's run and register a version of it."""
    import mlflow

    logger = get_run_logger()
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    # The registered model takes raw features (it standardises them itself), as a user's data comes.
    x_val, y_val = read_split(dataset, "val", config.storage_options, standardised=False)
    model = with_standardisation(
        load_checkpoint_model(fit.best_checkpoint_uri, config.storage_options),
        dataset.feature_mean,
        dataset.feature_std,
    ).eval()
    candidate = score(predict_logits(model, x_val), y_val)

    # MLflow's fluent API (log_model, register_model, pyfunc) reads a process-wide URI that set_tracking_uri
    # also exports as MLFLOW_TRACKING_URI: scoped here, so a later run in this process is not redirected.
    with tracking.using_tracking_uri(config.mlflow_tracking_uri):
        with mlflow.start_run(run_id=fit.mlflow_run_id):
            info = _log_model(model, x_val, dataset, fit)
        # Only now, with the artifacts uploaded, does a version exist: it can never point at missing files.
        tags = _version_tags(dataset, fit, candidate)
        version = str(mlflow.register_model(info.model_uri, config.model_name, tags=tags).version)
        description = _description(config, dataset, fit, candidate)
        client.update_model_version(config.model_name, version, description=description)

        with promotion_lock(client, config.model_name, owner=fit.run_key):
            champion_version = _champion_version(client, config.model_name)
            champion = _score_version(config.model_name, champion_version, x_val, y_val) if champion_version else None
            decision = decide_promotion(
                candidate.get(config.promotion_metric),
                None if champion is None else champion.get(config.promotion_metric),
                min_improvement=config.min_improvement,
                promote=config.promote,
                higher_is_better=config.promotion_metric != "val_loss",
            )
            aliases = apply_decision(
                client, config.model_name, version, champion_version, decision, config.promotion_metric
            )
    logger.info(
        "registered %s version %s (%s %.4f): %s, %s",
        config.model_name,
        version,
        config.promotion_metric,
        decision.candidate_score,
        decision.action.value,
        decision.reason,
    )
    return ModelRef(
        name=config.model_name,
        version=version,
        model_uri=f"models:/{config.model_name}/{version}",
        aliases=aliases,
        decision=decision.action.value,
        reason=decision.reason,
        metric=config.promotion_metric,
        score=decision.candidate_score,
        champion_version=champion_version,
        champion_score=decision.champion_score,
    )


@contextmanager
def promotion_lock(client: MlflowClient, model_name: str, owner: str) -> Iterator[None]:
    """Serialise champion decisions for one model across processes, using the registry itself.

    Creating a registered model is atomic (names are unique), so whoever creates ``<name>.promotion-lock``
    holds the lock. A lock older than LOCK_STALE_AFTER_S is taken to be left by a crashed pipeline.
    """
    from mlflow.exceptions import MlflowException

    lock = f"{model_name}{LOCK_SUFFIX}"
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            client.create_registered_model(
                lock,
                tags={"owner": owner, "acquired_at": f"{time.time():.3f}"},
                description=f"Held while pipeline run {owner} decides the '{CHAMPION}' alias of {model_name}.",
            )
            break
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise TrackingError(f"cannot take the promotion lock {lock!r}: {exc}") from exc
        try:
            holder = client.get_registered_model(lock)
            acquired_at = float(holder.tags.get("acquired_at", "0"))
        except MlflowException:
            continue  # released between our create and this read
        if time.time() - acquired_at > LOCK_STALE_AFTER_S:
            client.delete_registered_model(lock)
            continue
        if time.monotonic() > deadline:
            raise TrackingError(
                f"registered model {lock!r} has been held by run {holder.tags.get('owner')} for over "
                f"{LOCK_TIMEOUT_S:.0f}s; if no pipeline is registering {model_name}, delete it in the MLflow UI"
            )
        time.sleep(0.2 + random.random() * 0.5)
    try:
        yield
    finally:
        client.delete_registered_model(lock)


def apply_decision(
    client: MlflowClient,
    name: str,
    version: str,
    champion_version: str | None,
    decision: PromotionDecision,
    metric: str,
) -> tuple[str, ...]:
    """Record the decision on the version and move aliases accordingly; returns the version's aliases."""
    from mlflow.exceptions import MlflowException

    tags = {
        "promotion.decision": decision.action.value,
        "promotion.reason": decision.reason,
        "promotion.metric": metric,
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


def _champion_version(client: MlflowClient, name: str) -> str | None:
    from mlflow.exceptions import MlflowException

    # get_model_version_by_alias, not a search: search results may omit aliases.
    try:
        return str(client.get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException:
        return None


def _score_version(name: str, version: str, x_val: np.ndarray, y_val: np.ndarray) -> Scores | None:
    """The version's scores on *this* validation split, or None when it cannot score it (other features)."""
    import mlflow

    try:
        logits = np.asarray(mlflow.pyfunc.load_model(f"models:/{name}/{version}").predict(x_val))
    except Exception:  # noqa: BLE001 - an incompatible champion is not comparable, whatever the reason
        return None
    if logits.ndim != 2 or logits.shape[0] != len(y_val) or logits.shape[1] <= int(y_val.max()):
        return None
    return score(logits, y_val)


def _log_model(model: Any, x_val: np.ndarray, dataset: DatasetRef, fit: FitResult) -> Any:
    import mlflow
    import torch

    preprocessing = {
        "feature_names": dataset.feature_names,
        "feature_mean": dataset.feature_mean,
        "feature_std": dataset.feature_std,
        "class_labels": dataset.class_labels,
        "input": "raw features in feature_names order; the model applies (x - feature_mean) / feature_std",
        "output": "logits; argmax is the index into class_labels",
    }
    mlflow.log_text(json.dumps(preprocessing, indent=1), "preprocessing.json")
    return mlflow.pytorch.log_model(
        model,
        name="model",
        input_example=np.array(x_val[:5]),
        # Explicit requirements: inferring them spawns a subprocess that costs ~8 s.
        pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"],
        metadata={"run_key": fit.run_key, "dataset_hash": dataset.content_hash},
    )


def _version_tags(dataset: DatasetRef, fit: FitResult, scores: Scores) -> dict[str, str]:
    from prefect.runtime import flow_run

    tags = {
        "run_key": fit.run_key,
        "dataset_hash": dataset.content_hash,
        "best_epoch": str(fit.best_epoch),
        "val_accuracy": f"{scores.val_accuracy:.6f}",
        "val_loss": f"{scores.val_loss:.6f}",
    }
    if flow_run.get_id():
        tags["prefect.flow_run_id"] = str(flow_run.get_id())
    return tags


def _description(config: TrainingConfig, dataset: DatasetRef, fit: FitResult, scores: Scores) -> str:
    return (
        f"{config.model} {config.hidden_sizes} trained on dataset {dataset.content_hash} ({dataset.source}) by "
        f"run {fit.run_key}: val_accuracy {scores.val_accuracy:.4f}, val_loss {scores.val_loss:.4f} at epoch "
        f"{fit.best_epoch}. Input: raw float32 features in feature_names order (the model standardises them "
        "with the train statistics in the run's preprocessing.json); output: logits over class_labels."
    )
