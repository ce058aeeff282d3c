"""A deployment's pinned settings: a run of a deployment may not point the worker's credentials elsewhere.

(The settings a flow run trains with are read back from its parameters by
``raytrain_tasks.config.config_from_parameters``.)
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from raytrain_tasks.config import PINNED, TrainingConfig, describe_validation_error
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.redact import redact

# What a run's job variables may set in its environment (the process worker merges them over its deployment's):
# thread counts, and what PyTorch, CUDA and NCCL log or how they allocate. They reach the driver and a local Ray it
# starts; a cluster's nodes keep their own. Not on it, so the deployment's alone (docs/security.md): anything that
# says where MLflow (its registry too), S3, Ray or Prefect are, a proxy, CA bundles and TLS switches, credentials
# and profiles, what code or library loads (PYTHONPATH, LD_PRELOAD, NCCL_NET_PLUGIN), files written
# (NCCL_DEBUG_FILE), and which GPUs a local Ray sees (CUDA_VISIBLE_DEVICES: Ray assigns devices to workers).
RUN_ENVIRONMENT = frozenset(
    {
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "PYTORCH_CUDA_ALLOC_CONF",
        "CUBLAS_WORKSPACE_CONFIG",
        "CUDA_LAUNCH_BLOCKING",
        "TORCH_DISTRIBUTED_DEBUG",
        "TORCH_CPP_LOG_LEVEL",
        "TORCH_SHOW_CPP_STACKTRACES",
        "NCCL_DEBUG",
        "NCCL_DEBUG_SUBSYS",
        "PYTHONHASHSEED",
        "PYTHONFAULTHANDLER",
        "PYTHONUNBUFFERED",
    }
)


def refused_environment(run_env: Mapping[str, object], deployment_env: Mapping[str, object]) -> list[str]:
    """The variables a run's job variables set that it may not, sorted: those not in ``RUN_ENVIRONMENT``, unless
    the run gives one its deployment's own value (a form that starts from the deployment's job variables)."""
    return sorted(
        name
        for name, value in run_env.items()
        if name not in RUN_ENVIRONMENT and not (name in deployment_env and str(deployment_env[name]) == str(value))
    )


def check_deployment_pins(config: TrainingConfig, deployment_id: str | None, flow_run_id: str | None = None) -> None:
    """In a run of a deployment, the settings in ``PINNED`` must have the deployment's own values (the default
    where the deployment gives none), and the run's job variables may set no environment variable but those of
    ``RUN_ENVIRONMENT``: whoever may only trigger runs (the UI's custom run, ``-p``, ``--job-variable``, an
    automation) must not point MLflow, S3 or Ray, and with them the worker's credentials, at a server of their
    choosing.
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
    if flow_run is not None:
        check_run_environment(deployment.name, deployment.job_variables, flow_run.job_variables)


def check_run_environment(name: str, deployment_variables: dict | None, run_variables: dict | None) -> None:
    """SettingsError naming the environment variables a run's job variables set that ``refused_environment``
    refuses; the deployment's job variables (the operator's) are its baseline."""
    environment = (run_variables or {}).get("env") or {}
    own_environment = (deployment_variables or {}).get("env") or {}
    if not isinstance(environment, Mapping) or not isinstance(own_environment, Mapping):
        raise SettingsError(
            f"this run of deployment {name!r} has job variables whose env is not an object of variable names, so "
            "what it sets cannot be checked. Nothing was started"
        )
    if refused := refused_environment(environment, own_environment):
        raise SettingsError(
            f"this run of deployment {name!r} sets {', '.join(refused)} in its job variables (env), which a run of "
            "a deployment may not: such a variable can send the worker's credentials elsewhere (an MLflow registry, "
            "a proxy), weaken TLS or change what code runs. Nothing was started. A run may set only "
            f"{', '.join(sorted(RUN_ENVIRONMENT))}; set the others in the deployment's own job variables "
            "(deployments/prefect.yaml), as docs/security.md says"
        )
