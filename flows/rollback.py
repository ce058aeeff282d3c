"""The rollback flow: move a model's `champion` back to an earlier version, recorded with why (the deployment
`rollback-champion` in deployments/prefect.yaml; `prefect-raytrain rollback` does the same from a shell)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from prefect.runtime import deployment, flow_run
from pydantic import Field

from flows.run_settings import check_deployment_pins
from raytrain_driver.champion_history import ChampionMove
from raytrain_driver.rollback import roll_back
from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.redact import install_log_redaction, redact_uri, redacted_errors
from raytrain_tasks.settings import MODEL_NAME_MAX, MODEL_NAME_PATTERN
from raytrain_tasks.tracking import runs as tracking

ModelName = Annotated[str, Field(min_length=1, max_length=MODEL_NAME_MAX, pattern=MODEL_NAME_PATTERN)]


@flow(name="rollback-champion")
def rollback_champion(
    model_name: ModelName,
    to_version: Annotated[int, Field(ge=1)],
    reason: Annotated[str, Field(min_length=1)],
    mlflow_tracking_uri: str = "",
) -> ChampionMove:
    """Move a registered model's `champion` alias back to an earlier version, and `previous_champion` to the one it
    replaces, through the model's registry lock; the move is recorded with the reason and this flow run.

    Args:
        model_name: The registered model (the `model_name` of its training runs).
        to_version: The version to make champion again: one that exists, is not the champion, and whose MLflow
            run exists.
        reason: Why: recorded with the move, and listed by `prefect-raytrain champions`.
        mlflow_tracking_uri: Empty: the training runs' default (MLFLOW_TRACKING_URI, or the SQLite store under
            ./.pipeline/). Pinned by a deployment: a run of a deployment that sets another value than the
            deployment's is refused.
    """
    install_log_redaction("prefect", "prefect.flow_runs", "mlflow")
    with redacted_errors():
        given = TrainingConfig(mlflow_tracking_uri=mlflow_tracking_uri)
        # Whoever may only trigger runs must not send the worker's MLflow credentials to a server of their choosing.
        check_deployment_pins(given, deployment.get_id(), flow_run.get_id())
        config = given.resolved(Path.cwd(), os.environ)
        client = tracking.connect(config.mlflow_tracking_uri)
        move = roll_back(client, model_name, str(to_version), reason, by=_mover())
    get_run_logger().info(
        "%s@champion: version %s -> version %s at %s, recorded as move %s: %s",
        model_name,
        move.previous or "none",
        move.version,
        redact_uri(config.mlflow_tracking_uri),
        move.seq,
        move.reason,
    )
    return move


def _mover() -> str:
    """``by`` of the move: this flow run, its deployment and host (Prefect's runs carry no user)."""
    run = f"Prefect flow run {flow_run.get_name()} ({flow_run.get_id()})"
    via = f" of deployment {deployment.get_name()}" if deployment.get_name() else ""
    return f"rollback by {run}{via} on {socket.gethostname()}"
