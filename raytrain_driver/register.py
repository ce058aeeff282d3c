"""Registering a fit's model (the register-model task, tasks/register.py): log the best checkpoint's model to
MLflow, register one version per run key, decide its alias.

Order matters, and every step can be repeated (a Prefect retry, a resume of the same run key, a kill in
between) without a second model or version:
1. The model is logged once per MLflow run: a READY logged model of the run is reused.
2. Under the model's registry lock (``raytrain_driver.registry_lock``), the run key's version is looked up and
   registered only if missing, so two attempts never both register.
3. Still under the lock, the decision is recorded as version tags, then the aliases move, then the move goes
   into the champion history (``raytrain_driver.champion_history``), then ``promotion.applied`` marks it done.
   A final decision is never redone; an undecided one (the champion could not be assessed) keeps every alias
   where it was and fails the task, and the next attempt decides again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from raytrain_driver import register_steps
from raytrain_driver.champion_history import read_history, record_promotion, was_champion
from raytrain_driver.evaluation import EVALUATION_ARTIFACT_DIR, scores_as_metrics
from raytrain_driver.fit_record import FitResult
from raytrain_driver.hooks import run_logger, stopped_by
from raytrain_driver.origin import registered_version, version_description, version_tags
from raytrain_driver.preflight import resolve_code
from raytrain_driver.promotion import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    Champion,
    Promotion,
    PromotionDecision,
    decide_again,
    decide_promotion,
)
from raytrain_driver.register_steps import (
    Candidate,
    assess_user_champion,
    registering,
    user_artifacts,
    user_metadata,
    user_model,
    user_schema,
)
from raytrain_driver.registry_lock import LockHandle, model_lock
from raytrain_tasks.api import TrainFunc
from raytrain_tasks.code_settings import secret_keys
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import PromotionError, TrackingError
from raytrain_tasks.prepared import RunData, data_dir_of
from raytrain_tasks.redact import redacted_errors
from raytrain_tasks.tracking import pins
from raytrain_tasks.tracking import runs as tracking
from raytrain_tasks.tracking.outcome import CHECKPOINT_URI_TAG

if TYPE_CHECKING:
    from pathlib import Path

    from mlflow import MlflowClient

APPLIED_TAG = "promotion.applied"
LOGGED_MODEL_NAME = "model"


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


def register(
    config: TrainingConfig, dataset: RunData | None, fit: FitResult, tags: dict[str, str] | None = None
) -> ModelRef:
    """Log the best checkpoint as an MLflow model in the fit's run and register (at most) one version of it,
    with ``tags`` beside the version's own (the Prefect flow run it came from). A stop from outside (a Prefect
    cancellation, Ctrl-C) marks the MLflow run KILLED; at most one version is registered either way."""
    with redacted_errors():
        try:
            return _register_model(config, dataset, fit, tags or {})
        except BaseException as exc:
            if (how := stopped_by(exc)) is None:
                raise
            tracking.stop_run(
                tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url),
                fit.mlflow_run_id,
                f"stopped by {how} during register-model; its checkpoints are kept and at most one version is "
                f"registered: continue it with resume={fit.run_key}",
                exc,
            )
            raise


def _register_model(
    config: TrainingConfig, dataset: RunData | None, fit: FitResult, origin_tags: dict[str, str]
) -> ModelRef:
    logger = run_logger()
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    spec = resolve_code(config)  # its gate (metric, direction) and selection: the fit's own
    gate, selection = spec.gate, spec.selection
    metric, higher_is_better = gate.name, gate.higher_is_better
    candidate_score = fit.scores[metric]
    data_dir = data_dir_of(dataset, config.storage_options)  # once, before the registry lock is taken
    schema = user_schema(config, spec, data_dir)  # the code's, once: before it too
    with registering(config, fit):
        model_uri = _logged_model_uri(fit) or _log_model(client, config, dataset, fit, spec, data_dir)
        _link_logged_model(client, fit, model_uri.removeprefix("models:/"))
        with model_lock(client, config.model_name, owner=fit.run_key) as lock:
            version = _version_of_run(client, config.model_name, fit.run_key)
            if version is None:
                lock.check()  # a holder taken over while it looked must not register a second version
                version = _create_version(
                    client,
                    config.model_name,
                    model_uri,
                    fit,
                    tags=version_tags(config, dataset, fit, spec, schema) | origin_tags,
                    description=version_description(config, dataset, fit, selection.name, secret_keys(spec.settings)),
                )
            else:
                logger.info("run %s already registered %s version %s", fit.run_key, config.model_name, version)
            ref = _decided(client, config, version, candidate_score, metric, lock)
            if ref is None:
                candidate = Candidate(config, spec, model_uri, data_dir, schema)
                champion, candidate_score = _current_champion(client, candidate, fit)
                decision = decide_promotion(
                    candidate_score,
                    champion,
                    min_improvement=config.min_improvement,
                    promote=config.promote,
                    higher_is_better=higher_is_better,
                    replace_incomparable=config.replace_incomparable_champion,
                )
                aliases = apply_decision(client, config.model_name, version, decision, metric, lock)
                ref = _model_ref(config, version, aliases, decision, metric)
    logger.info(
        "%s version %s (%s %.4f): %s, %s",
        config.model_name,
        ref.version,
        metric,
        ref.score,
        ref.decision,
        ref.reason,
    )
    if ref.decision == Promotion.UNDECIDED.value:
        raise PromotionError(
            f"{config.model_name} version {ref.version} is registered as '{CHALLENGER}', but the champion decision "
            f"could not be made: {ref.reason}. No alias moved; {decide_again(ref.reason, fit.run_key)}"
        )
    return ref


def _current_champion(client: MlflowClient, candidate: Candidate, fit: FitResult) -> tuple[Champion, float]:
    """(the champion, the candidate's score) as the gate compares them, assessed the way its kind of code allows
    (fail closed: a champion that cannot be assessed comes back with an error, and nothing moves)."""
    recorded = fit.scores[candidate.spec.gate.name]
    if not candidate.config.promote:
        return Champion.absent(), recorded
    return assess_user_champion(client, candidate, recorded)


def apply_decision(
    client: MlflowClient, name: str, version: str, decision: PromotionDecision, metric: str, lock: LockHandle
) -> tuple[str, ...]:
    """Record the decision on the version, then move aliases; returns the version's aliases."""
    from mlflow.exceptions import MlflowException

    champion_version = decision.champion_version

    tags = {
        "promotion.decision": decision.action.value,
        "promotion.reason": decision.reason[:4000],
        "promotion.metric": metric,
        "promotion.candidate_score": f"{decision.candidate_score:.6f}",
        "promotion.champion_score": "" if decision.champion_score is None else f"{decision.champion_score:.6f}",
        "promotion.champion_version": champion_version or "",
    }
    try:
        for key, value in tags.items():
            client.set_model_version_tag(name, version, key, value)
        lock.check()  # never move an alias on a lock that was taken over
        if decision.action.moves_champion:
            _check_champion_unmoved(client, name, champion_version)
            client.set_registered_model_alias(name, CHAMPION, version)
            if champion_version is not None:
                client.set_registered_model_alias(name, PREVIOUS_CHAMPION, champion_version)
            # After the move: a record never claims one that did not happen (a kill before it: see _decided).
            record_promotion(client, name, version)
            aliases: tuple[str, ...] = (CHAMPION,)
        else:
            client.set_registered_model_alias(name, CHALLENGER, version)
            aliases = (CHALLENGER,)
        if decision.action.is_final:
            client.set_model_version_tag(name, version, APPLIED_TAG, "true")
        return aliases
    except MlflowException as exc:
        raise TrackingError(f"could not record the decision on {name} version {version}: {exc}") from exc


def _check_champion_unmoved(client: MlflowClient, name: str, decided_against: str | None) -> None:
    """TrackingError unless `champion` still names the version the decision was made against. The registry has
    no compare-and-set for aliases: a holder frozen past its lease (a paused VM) may have been overtaken by one
    that moved `champion` since; reading it right before the move leaves that race milliseconds, not the minutes
    a champion's assessment can take."""
    now = client.get_registered_model(name).aliases.get(CHAMPION)
    if str(now or "") != str(decided_against or ""):
        raise TrackingError(
            f"{name}'s champion is version {now} now, not {decided_against or 'none'} as when this run's decision "
            "was made: another pipeline moved it. No alias moved; retry the run to decide against the new champion"
        )


def _decided(
    client: MlflowClient, config: TrainingConfig, version: str, score: float, metric: str, lock: LockHandle
) -> ModelRef | None:
    """The version's decision if an earlier attempt made it final; None when it must be (re)decided."""
    name = config.model_name
    tags = client.get_model_version(name, version).tags
    action = tags.get("promotion.decision")
    if action is None or not Promotion(action).is_final:
        return None
    champion_now = client.get_registered_model(name).aliases.get(CHAMPION)
    applied = tags.get(APPLIED_TAG) == "true"
    if not applied and str(champion_now) != version:
        if not Promotion(action).moves_champion or not was_champion(read_history(client, name)[0].moves, version):
            return None  # recorded but never applied (killed in between): nothing moved, decide again
        # It moved, and was moved away since (a rollback): deciding again could undo that. Finish it as it is.
        client.set_model_version_tag(name, version, APPLIED_TAG, "true")
        applied = True
    recorded_champion = tags.get("promotion.champion_version") or None
    if not applied:  # champion moved to this version; finish what the kill interrupted
        lock.check()  # the repair moves an alias: only while the lock is still ours
        if recorded_champion is not None:
            client.set_registered_model_alias(name, PREVIOUS_CHAMPION, recorded_champion)
        record_promotion(client, name, version, unless_explained=True)  # the interrupted attempt may have
        client.set_model_version_tag(name, version, APPLIED_TAG, "true")
    champion_score = tags.get("promotion.champion_score")
    # The log line and the summary say so: a retry or a resume of a registered run does not decide again.
    earlier = "; ".join(
        filter(None, [tags.get("promotion.reason"), "decided earlier, when this run registered the version"])
    )
    decision = PromotionDecision(
        Promotion(action),
        earlier,
        score,
        float(champion_score) if champion_score else None,
        recorded_champion,
    )
    aliases = tuple(alias for alias, v in client.get_registered_model(name).aliases.items() if str(v) == version)
    return _model_ref(config, version, aliases, decision, metric)


def _model_ref(
    config: TrainingConfig,
    version: str,
    aliases: tuple[str, ...],
    decision: PromotionDecision,
    metric: str,
) -> ModelRef:
    return ModelRef(
        name=config.model_name,
        version=version,
        model_uri=f"models:/{config.model_name}/{version}",
        aliases=aliases,
        decision=decision.action.value,
        reason=decision.reason,
        metric=metric,
        score=decision.candidate_score,
        champion_version=decision.champion_version,
        champion_score=decision.champion_score,
    )


def _version_of_run(client: MlflowClient, name: str, run_key: str) -> str | None:
    found = registered_version(client, name, run_key)
    return None if found is None else str(found.version)


def _logged_model_uri(fit: FitResult) -> str | None:
    """The model an earlier attempt of this run logged completely, if any."""
    import mlflow
    from mlflow.entities import LoggedModelStatus

    models = mlflow.search_logged_models(
        experiment_ids=[fit.mlflow_experiment_id],
        filter_string=f"source_run_id = '{fit.mlflow_run_id}' AND name = '{LOGGED_MODEL_NAME}'",
        output_format="list",
    )
    ready = [m for m in models if m.status == LoggedModelStatus.READY]
    return f"models:/{ready[0].model_id}" if ready else None


def _log_model(
    client: MlflowClient,
    config: TrainingConfig,
    dataset: RunData | None,
    fit: FitResult,
    spec: TrainFunc,
    data_dir: Path | None,
) -> str:
    """The code's model (its load_model, on a verified copy of the best checkpoint) logged in the fit's run."""
    digest = pins.recorded_digest(client, fit.mlflow_run_id, fit.best_checkpoint_uri)
    model, example = user_model(config, fit, spec, digest, data_dir)
    lineage = {"dataset_hash": dataset.content_hash} if dataset is not None else {}
    metadata = user_metadata(config, spec, data_dir) | {"run_key": fit.run_key, "train_code": config.train_code}
    with user_artifacts(config, spec, model, data_dir) as artifacts:
        return _log_pt2(fit, model, example, metadata | lineage, artifacts=artifacts)


def _log_pt2(fit: FitResult, model: Any, example: Any, metadata: dict[str, Any], artifacts: Path | None) -> str:
    """Log ``model`` (the files in ``artifacts`` as run artifacts) in the fit's MLflow run; its URI."""
    import mlflow
    import torch

    # start_run's exit writes the run's end: a stop raised in a query of the block must not hold that query's lock.
    with (
        register_steps.EXPORT_LOCK,
        mlflow.start_run(run_id=fit.mlflow_run_id),
        tracking.releasing_interrupted_reads(),
    ):
        if artifacts is not None:
            mlflow.log_artifacts(str(artifacts), EVALUATION_ARTIFACT_DIR)
        info = mlflow.pytorch.log_model(
            model,
            name=LOGGED_MODEL_NAME,
            input_example=example,
            # Explicit: MLflow's default is "pickle" on some tracking servers (Databricks); pt2 loads no pickles.
            serialization_format="pt2",
            # Explicit requirements: inferring them spawns a subprocess that costs ~8 s.
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"],
            metadata=metadata,
        )
    return str(info.model_uri)


def _create_version(
    client: MlflowClient, name: str, model_uri: str, fit: FitResult, tags: dict[str, str], description: str
) -> str:
    """Register one version of ``model_uri`` (``models:/<model_id>``) with its tags and description in one call.

    MlflowClient, not ``mlflow.register_model``: the fluent call prints to stderr on its own ("Successfully
    registered model ...") and sets the description in a second request, which a crash in between would leave
    unset."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    created = client.create_model_version(
        name,
        source=model_uri,
        run_id=fit.mlflow_run_id,
        tags=tags,
        description=description,
        model_id=model_uri.removeprefix("models:/"),
    )
    return str(created.version)


def _link_logged_model(client: MlflowClient, fit: FitResult, model_id: str) -> None:
    """The registered model's LoggedModel carries the best checkpoint's scores (so the experiment's Models tab
    can sort by them) and says which checkpoint it was made from; idempotent (MLflow skips a metric it has)."""
    client.log_batch(fit.mlflow_run_id, metrics=scores_as_metrics(fit.scores, fit.best_epoch, model_id))
    tags = {
        "prefect_raytrain.run_key": fit.run_key,
        "prefect_raytrain.epoch": str(fit.best_epoch),
        CHECKPOINT_URI_TAG: fit.best_checkpoint_uri,
    }
    if fit.best_checkpoint_model_id:
        tags["prefect_raytrain.checkpoint_model_id"] = fit.best_checkpoint_model_id
    client.set_logged_model_tags(model_id, tags)
