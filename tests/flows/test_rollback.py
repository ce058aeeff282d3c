"""The rollback-champion flow (what the deployment's run form starts) on the Prefect test API and a real SQLite
registry: the move, recorded with the flow run that made it; a refusal fails the run and moves nothing."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client

from flows.rollback import rollback_champion
from raytrain_driver.champion_history import read_history
from raytrain_tasks.errors import RollbackError
from tests.registered_versions import registered_versions


def test_the_flow_rolls_back_and_records_its_flow_run(tmp_path: Path, prefect_api: None) -> None:
    uri, client, (v1, v2) = registered_versions(tmp_path, "flowed", 2)
    client.set_registered_model_alias("flowed", "champion", v2)
    move = rollback_champion(model_name="flowed", to_version=int(v1), reason="v2 drifts", mlflow_tracking_uri=uri)
    history, champion = read_history(client, "flowed")
    assert champion == v1 and history.moves == (move,)
    assert move.by.startswith("rollback by Prefect flow run ") and move.reason == "v2 drifts"

    with pytest.raises(RollbackError, match="version 1 is the champion already"):
        rollback_champion(model_name="flowed", to_version=int(v1), reason="again", mlflow_tracking_uri=uri)
    assert read_history(client, "flowed")[0].moves == (move,)


def _deployed(uri: str) -> Any:
    """rollback-champion deployed as `prefect deploy` does it, its MLflow store the deployment's own."""
    with get_client(sync_client=True) as client:
        return client.create_deployment(
            flow_id=client.create_flow(rollback_champion),
            name="rollback-champion",
            parameters={"mlflow_tracking_uri": uri},
            parameter_openapi_schema=rollback_champion.parameters.model_dump(),
            enforce_parameter_schema=True,
        )


def _run(deployment: Any, parameters: dict[str, Any]) -> Any:
    """A run of the deployment, executed here as a worker executes it: its final state."""
    from prefect.flow_engine import run_flow

    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(deployment, parameters=parameters)
    return run_flow(rollback_champion, flow_run=flow_run, parameters=flow_run.parameters, return_type="state")


def test_a_deployment_run_names_its_deployment_and_may_not_point_elsewhere(tmp_path: Path, prefect_api: None) -> None:
    """The UI's run form of the deployment: the move names the deployment; a run that sets another MLflow store
    than the deployment's is refused before it connects (the worker's credentials would go there)."""
    uri, client, (v1, v2) = registered_versions(tmp_path, "deployed", 2)
    client.set_registered_model_alias("deployed", "champion", v2)
    deployment = _deployed(uri)
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    refused = _run(
        deployment, {"model_name": "deployed", "to_version": 1, "reason": "x", "mlflow_tracking_uri": elsewhere}
    )
    assert refused.is_failed() and "mlflow_tracking_uri other than its deployment's" in str(refused.message)
    assert not (tmp_path / "elsewhere.db").exists() and read_history(client, "deployed")[0].moves == ()

    moved = _run(deployment, {"model_name": "deployed", "to_version": 1, "reason": "v2 drifts"})
    assert moved.is_completed(), moved.message
    (move,) = read_history(client, "deployed")[0].moves
    assert move.version == v1 and move.by.endswith(f"of deployment rollback-champion on {socket.gethostname()}")
