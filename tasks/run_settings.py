"""The settings a flow run trains with, read back from the parameters Prefect stored for it.

Each training setting is a flow parameter of its own (flows/parameters.py), so Prefect's server has already laid a
run's parameters over its deployment's: what a run stores is what it trains with, and a continuation rebuilds the
config of the run it continues from that run's parameters alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from raytrain_tasks.config import TrainingConfig, describe_validation_error
from raytrain_tasks.errors import PipelineError
from raytrain_tasks.redact import redact

SETTINGS = tuple(TrainingConfig.model_fields)  # every training setting, in the config's order (the form's)
# The settings that decide where this process's credentials go (field metadata PINNED_BY_DEPLOYMENT).
PINNED = tuple(
    name
    for name, field in TrainingConfig.model_fields.items()
    if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("pinned_by_deployment")
)


class SettingsError(PipelineError):
    """A flow run's parameters do not make a valid training config."""


def config_from_parameters(parameters: Mapping[str, Any]) -> TrainingConfig:
    """The config a flow run's settings make; SettingsError naming each invalid field otherwise."""
    if isinstance(parameters.get("config"), Mapping):
        raise SettingsError(
            "this flow run was created with the settings in one `config` parameter, the form of prefect-raytrain "
            "before each setting became a parameter of its own: nothing was trained. Give the settings one by one "
            "(`-p epochs=3`, `--params '{\"epochs\": 3}'`), and deploy again (prefect deploy, or python -m "
            "deployments.serve) to update a deployment made before"
        )
    settings = {name: value for name, value in parameters.items() if name in SETTINGS}
    try:
        return TrainingConfig.model_validate(settings)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from exc


def non_default_settings(config: TrainingConfig) -> str:
    """``name=value, ...`` for the settings of ``config`` that differ from the defaults, credentials masked."""
    changed = config.model_dump(exclude_defaults=True)
    return ", ".join(f"{name}={value}" for name, value in config.public_params().items() if name in changed)


def check_deployment_pins(config: TrainingConfig, deployment_id: str | None) -> None:
    """In a run of a deployment, the settings in ``PINNED`` must have the deployment's own values (or the default,
    where the deployment gives none): whoever may trigger runs (the UI's custom run, ``-p``, an automation) must not
    point MLflow, S3 or Ray, and with them the worker's credentials, at a server of their choosing. SettingsError
    naming each changed setting otherwise, and when the deployment cannot be read (fail closed). A run of no
    deployment (the CLI, ``python -m flows.training``) sets what it likes."""
    if not deployment_id:
        return
    from uuid import UUID

    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    try:
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment(UUID(str(deployment_id)))
    except (ObjectNotFound, PrefectHTTPStatusError, httpx.HTTPError, ValueError) as exc:
        raise SettingsError(
            f"cannot read this run's deployment {deployment_id} to check the settings it pins ({', '.join(PINNED)}): "
            f"{redact(str(exc))}. Nothing was started; run again once the Prefect API answers"
        ) from exc
    own = deployment.parameters or {}
    changed = [
        name for name in PINNED if getattr(config, name) != own.get(name, TrainingConfig.model_fields[name].default)
    ]
    if changed:
        raise SettingsError(
            f"this run of deployment {deployment.name!r} sets {', '.join(changed)}, which a run of a deployment may "
            "not change: these settings decide where the worker's credentials are sent, so they are the "
            "deployment's own (docs/security.md). Nothing was started. Change them in the deployment itself "
            "(deployments/prefect.yaml, then `prefect deploy`), or make a deployment for the other servers"
        )
