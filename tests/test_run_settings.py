"""A deployment run with some settings changed keeps every other setting of its deployment.

Deployments and flow runs are created in the test Prefect API, as `prefect deploy` and `prefect deployment run
--params` / `-p` / `run_deployment` create them (the server merges a run's parameters into its deployment's at
the top level only). The end-to-end run of the nightly deployment with one override, by a process worker on
`prefect server`, is in test_prefect_server.py.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.flow_engine import run_flow
from prefect.states import Crashed

from raytrain_tasks.config import TrainingConfig
from tasks.continuation import continuation_of
from tasks.run_settings import DeploymentSettingsError, settings_for_run

pytestmark = pytest.mark.usefixtures("prefect_api")

NIGHTLY = {"dataset": "digits", "num_workers": 2, "epochs": 10, "model_name": "nightly-model", "min_improvement": 0.002}


@flow(name="run-settings-probe")
def probe(config: TrainingConfig = TrainingConfig(), continue_flow_run: str | None = None) -> TrainingConfig:  # noqa: B008
    """Returns what the training flow would train with, by the same function the training flow calls."""
    from flows.training import _with_deployment_settings

    return _with_deployment_settings(config)


def _deployment(parameters: dict[str, Any]) -> UUID:
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(probe)
        return client.create_deployment(flow_id=flow_id, name="nightly", parameters=parameters)


def _trigger(deployment_id: UUID, parameters: dict[str, Any], state: Any = None) -> Any:
    with get_client(sync_client=True) as client:
        return client.create_flow_run_from_deployment(deployment_id, parameters=parameters, state=state)


def test_a_run_with_one_override_keeps_the_deployments_other_settings() -> None:
    deployment = _deployment({"config": NIGHTLY})
    flow_run = _trigger(deployment, {"config": {"epochs": 3}})  # --params '{"config": {"epochs": 3}}'
    assert flow_run.parameters == {"config": {"epochs": 3}}  # what Prefect stores: the deployment's are gone

    trained_with = run_flow(probe, flow_run=flow_run, parameters=flow_run.parameters)
    assert trained_with.epochs == 3
    assert trained_with.min_improvement == 0.002 and trained_with.model_name == "nightly-model"
    assert trained_with.dataset == "digits" and trained_with.num_workers == 2


def test_a_run_that_sets_nothing_trains_with_the_deployments_settings_and_the_whole_config_wins() -> None:
    deployment = _deployment({"config": NIGHTLY})
    with get_client(sync_client=True) as client:
        scheduled = _trigger(deployment, {})
        config, changed = settings_for_run(client, scheduled)
        assert config == TrainingConfig.model_validate(NIGHTLY) and changed == []

        # The UI's custom-run form sends every field: the run gets exactly what it sent.
        whole = TrainingConfig.model_validate({**NIGHTLY, "min_improvement": 0.0}).model_dump(mode="json")
        config, changed = settings_for_run(client, _trigger(deployment, {"config": whole}))
        assert config.min_improvement == 0.0 and config.epochs == 10
        assert "min_improvement" in changed and "epochs" not in changed

        # Invalid values are still refused, merged or not.
        with pytest.raises(ValueError, match="num_workers"):
            settings_for_run(client, _trigger(deployment, {"config": {"num_workers": 0}}))


def test_a_run_whose_deployment_is_gone_trains_nothing() -> None:
    deployment = _deployment({"config": NIGHTLY})
    flow_run = _trigger(deployment, {"config": {"epochs": 3}})
    with get_client(sync_client=True) as client:
        client.delete_deployment(deployment)
        with pytest.raises(DeploymentSettingsError, match="no longer exists.*nothing was trained"):
            settings_for_run(client, flow_run)


def test_a_crashed_run_with_an_override_is_continued_with_the_deployments_other_settings() -> None:
    deployment = _deployment({"config": NIGHTLY})
    crashed = _trigger(deployment, {"config": {"epochs": 4}}, state=Crashed())
    with get_client(sync_client=True) as client:
        client.update_flow_run(crashed.id, tags=["run-key:20261123-120000-abcdef"])
    continuation = continuation_of(f"prefect.flow-run.{crashed.id}")
    assert continuation.config.epochs == 4
    assert continuation.config.min_improvement == 0.002 and continuation.config.model_name == "nightly-model"
    assert continuation.config.resume == "20261123-120000-abcdef"
