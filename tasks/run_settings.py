"""The settings a deployment run trains with: its deployment's ``config``, with the keys the run itself set.

Prefect merges a run's parameters into its deployment's at the top level only, and this flow has one
``config`` parameter: a run triggered with ``--params '{"config": {"epochs": 3}}'`` (or ``-p 'config={...}'``,
``run_deployment(parameters=...)``, an automation's run-deployment action) would otherwise train with
``epochs=3`` and the defaults for everything else, dropping the deployment's own settings (a nightly's
``min_improvement``, its model name). So the flow reads its deployment's ``config`` when the run starts and lays
the run's keys over it. A run that sets the whole config (the UI's custom-run form sends every field) gets
exactly what it sent. A run that cannot read its deployment fails before anything starts: it never trains with
settings nobody chose.
"""

from __future__ import annotations

from typing import Any

from raytrain_tasks.config import TrainingConfig
from raytrain_tasks.errors import PipelineError


class DeploymentSettingsError(PipelineError):
    """A deployment run cannot tell which settings its deployment gives it."""


def given_config(parameters: dict[str, Any]) -> dict[str, Any]:
    """The ``config`` keys a flow run was created with (as Prefect stored them, before any default)."""
    given = parameters.get("config") or {}  # JSON as stored: a model passed from Python arrives serialized
    if not isinstance(given, dict):
        raise DeploymentSettingsError(f"the flow run's `config` parameter is not an object: {type(given).__name__}")
    return dict(given)


def deployment_config(client: Any, deployment_id: Any) -> dict[str, Any]:
    """The ``config`` parameter of the deployment ``deployment_id``, as it is now on the Prefect server."""
    from prefect.exceptions import ObjectNotFound

    try:
        deployment = client.read_deployment(deployment_id)
    except ObjectNotFound as exc:
        raise DeploymentSettingsError(
            f"deployment {deployment_id} of this flow run no longer exists, so its settings are unknown: nothing "
            "was trained. Run the flow with the whole `config` instead (python -m flows.training, or a run of an "
            "existing deployment)"
        ) from exc
    return dict((deployment.parameters or {}).get("config") or {})


def settings_for_run(client: Any, flow_run: Any) -> tuple[TrainingConfig, list[str]]:
    """(the config ``flow_run`` trains with, the keys it set over its deployment's config).

    A run of no deployment (called from Python, the CLI) trains with its own config as given."""
    given = given_config(flow_run.parameters or {})
    if flow_run.deployment_id is None:
        return TrainingConfig.model_validate(given), sorted(given)
    base = deployment_config(client, flow_run.deployment_id)
    changed = sorted(key for key, value in given.items() if key not in base or base[key] != value)
    return TrainingConfig.model_validate({**base, **given}), changed
