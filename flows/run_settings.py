"""A deployment's pinned settings: a run of a deployment may not point the worker's credentials elsewhere.

(The settings a flow run trains with are read back from its parameters by
``raytrain_tasks.config.config_from_parameters``.)
"""

from __future__ import annotations

from pydantic import ValidationError

from raytrain_tasks.config import PINNED, TrainingConfig, describe_validation_error
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.redact import redact

# What the pinned settings fall back to when empty (TrainingConfig.resolved, Ray's own address lookup, serve's warm
# Ray): a run's job variables may not set them either.
PINNED_ENVIRONMENT = frozenset(
    {
        "MLFLOW_TRACKING_URI",
        "MLFLOW_S3_ENDPOINT_URL",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "RAY_ADDRESS",
        "PREFECT_RAYTRAIN_WARM_RAY",
    }
)


def check_deployment_pins(config: TrainingConfig, deployment_id: str | None, flow_run_id: str | None = None) -> None:
    """In a run of a deployment, the settings in ``PINNED`` must have the deployment's own values (the default
    where the deployment gives none), and the run's job variables may not set the environment variables they fall
    back to: whoever may only trigger runs (the UI's custom run, ``-p``, ``--job-variable``, an automation) must
    not point MLflow, S3 or Ray, and with them the worker's credentials, at a server of their choosing.
    SettingsError naming what differs otherwise, and when the deployment cannot be read (fail closed). A run of no
    deployment (the CLI, ``python -m flows.training``) sets what it likes."""
    if not deployment_id:
        return
    from uuid import UUID

    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    pinned = ", ".join(PINNED)
    try:
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment(UUID(str(deployment_id)))
            flow_run = client.read_flow_run(UUID(str(flow_run_id))) if flow_run_id else None
    except ObjectNotFound as exc:
        raise SettingsError(
            f"this run's deployment {deployment_id} no longer exists, so the settings it pins ({pinned}) cannot be "
            "checked: nothing was started"
        ) from exc
    except (httpx.HTTPError, ValueError) as exc:
        raise SettingsError(
            f"cannot read this run's deployment {deployment_id} to check the settings it pins ({pinned}): "
            f"{redact(str(exc))}. Nothing was started; run again once the Prefect API answers"
        ) from exc
    parameters = deployment.parameters or {}
    own = {name: value for name, value in parameters.items() if name in PINNED or name == "train_config"}
    try:  # validated as the run's values were (an endpoint's trailing slash, ...), so equal means equal
        expected = TrainingConfig.model_validate(own)
    except ValidationError as exc:  # e.g. a {"__prefect_kind": ...} reference, which Prefect resolves per run
        raise SettingsError(
            f"deployment {deployment.name!r} gives a pinned setting ({pinned}) a value that is not a plain one "
            f"({describe_validation_error(exc)}); give it a literal value in the deployment. Nothing was started"
        ) from exc
    changed = [name for name in PINNED if getattr(config, name) != getattr(expected, name)]
    # Code may read a setting of the same name from train_config (the table classifier's s3_endpoint_url, for an
    # s3:// table): train_config is free-form, so such a key is held to the deployment's train_config alike.
    changed += [
        f"train_config.{name}" for name in PINNED if config.train_config.get(name) != expected.train_config.get(name)
    ]
    if changed:
        raise SettingsError(
            f"this run of deployment {deployment.name!r} has {', '.join(changed)} other than its deployment's, which "
            "a run of a deployment may not change: these settings decide where the worker's credentials are sent, "
            "so they are the deployment's own (docs/security.md). Nothing was started. Change them in the deployment "
            "itself (deployments/prefect.yaml, then `prefect deploy`), or make a deployment for the other servers"
        )
    environment = ((flow_run.job_variables or {}).get("env") or {}) if flow_run is not None else {}
    redirected = sorted(PINNED_ENVIRONMENT & set(environment))
    if redirected:
        raise SettingsError(
            f"this run of deployment {deployment.name!r} sets {', '.join(redirected)} in its job variables: they "
            f"stand in for the settings a deployment pins ({pinned}), so a run may not set them. Nothing was started. "
            "Set them in the deployment's own job variables (deployments/prefect.yaml) instead"
        )
