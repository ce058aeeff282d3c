"""The scoring pipeline: resolve-model -> score-table. `prefect-raytrain score` and the `score-champion` deployment
run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import deployment, flow_run

from flows.parameters import with_fields_as_parameters
from flows.run_settings import check_deployment_pins
from raytrain_driver.scoring import scratch_folder
from raytrain_driver.scoring_run import ScoringResult
from raytrain_tasks.config import PINNED, TrainingConfig
from raytrain_tasks.redact import install_log_redaction, redacted_errors
from raytrain_tasks.scoring.config import ScoringConfig
from tasks.score import resolve_model, score_table


@flow(name="score")
@with_fields_as_parameters(ScoringConfig)
def scoring_pipeline(**settings: Any) -> ScoringResult:
    """Score a table with a registered model: one Parquet file of predictions, with the input's key column.

    Every ScoringConfig field is a parameter of its own: the model (`models:/NAME@ALIAS`, resolved once when the run
    starts), the input (a CSV or Parquet file or folder, local or s3://), the output (one Parquet file), the key
    column, the actors, and where MLflow, Ray and S3 are.
    """
    install_log_redaction("prefect", "prefect.flow_runs", "prefect.task_runs", "ray", "mlflow")
    with redacted_errors():
        config = ScoringConfig(**settings)
        # Whoever may only trigger runs of a deployment must not point MLflow, S3 or Ray, and with them the worker's
        # credentials, at a server of their choosing: the same pins as the training deployments'.
        pinned = {name: getattr(config, name) for name in PINNED if name in ScoringConfig.model_fields}
        check_deployment_pins(TrainingConfig(**pinned), deployment.get_id(), flow_run.get_id())
        config = config.resolved(Path.cwd())
    with scratch_folder() as scratch:
        plan = resolve_model(config, scratch)
        return score_table(config, plan)
