"""Where an MLflow run and a registered version come from: their tags and descriptions (the tags that lead back to
the Prefect flow run are taken by the task, tasks/fit.py, and handed in as ``origin``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from raytrain_tasks.config import TrainingConfig, check_run_key
from raytrain_tasks.prepared import RunData
from raytrain_tasks.storage.locations import StorageLocation
from raytrain_tasks.tracking import run_owner
from raytrain_tasks.tracking import runs as tracking

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from raytrain_driver.fit_record import FitResult
    from raytrain_tasks.api import TrainFunc

ENTRY_POINT = "flows/training.py:training_pipeline"  # as deployments/prefect.yaml names it
# On a model version: the run key that registered it, so a resumed registration finds it and makes no second one.
VERSION_RUN_KEY_TAG = "run_key"


def trained_what(config: TrainingConfig) -> str:
    """What a run trains, in Markdown: the code that trains it."""
    return f"`{config.train_code}`"


def data_loader_of(config: TrainingConfig, ray_datasets: bool) -> str:
    """How the run's workers read their data: whether the code trains on Ray Datasets (its ``datasets=``, or a
    TrainSpec's Ray Dataset splits) or not."""
    return "ray_data" if ray_datasets else "torch"


def run_description(
    config: TrainingConfig, run_key: str, run_dir: StorageLocation, origin: Mapping[str, str], data_loader: str
) -> str:
    """The MLflow run's description (``mlflow.note.content``, Markdown): what ran, from where, and how to go on."""
    workers = f"{config.num_workers}" + (f"-{config.max_workers}" if config.max_workers else "")
    what = trained_what(config)
    lines = [
        f"{what}: {config.epochs} epochs, {workers} Ray Train workers "
        f"({'GPU, nccl' if config.use_gpu else 'CPU, gloo'}), data loader `{data_loader}`.",
        "",
        f"- run key `{run_key}`: continue an interrupted run with `resume={run_key}`",
        f"- checkpoints: `{run_dir.uri}`",
    ]
    flow_run = origin.get("prefect.flow_run_url") or origin.get("prefect.flow_run_id")
    if flow_run:
        via = f" of deployment `{origin['prefect.deployment_name']}`" if "prefect.deployment_name" in origin else ""
        lines.append(f"- Prefect flow run{via}: {flow_run} (the latest one that trained this run)")
    lines.append(f"- code: `{ENTRY_POINT}` at commit `{tracking.code_version()}`")
    return "\n".join(lines)


def run_tags(
    config: TrainingConfig,
    dataset: RunData | None,
    run_key: str,
    run_dir: StorageLocation,
    backend: str,
    data_loader: str,
) -> dict[str, str]:
    from raytrain_driver.code_identity import code_identity

    lineage = {"prefect_raytrain.train_code": config.train_code, **code_identity(config.train_code)}
    if dataset is not None:  # what the code's prepare wrote
        lineage |= {"prefect_raytrain.dataset_hash": dataset.content_hash, "prefect_raytrain.dataset_uri": dataset.uri}
    import ray

    tags = {
        run_owner.DRIVER_TAG: run_owner.this_driver(),
        "prefect_raytrain.ray_run_name": run_key,
        "prefect_raytrain.storage": run_dir.uri,
        **lineage,
        "prefect_raytrain.num_workers": str(config.num_workers),
        "prefect_raytrain.use_gpu": str(config.use_gpu).lower(),
        "prefect_raytrain.backend": backend,
        "prefect_raytrain.data_loader": data_loader,
        "prefect_raytrain.ray_cluster": ray.get_runtime_context().gcs_address,
        "mlflow.source.git.commit": tracking.code_version(),
    }
    return tags


# MLflow keeps a version's description in a column of 5000 characters: a longer one fails the registration on
# PostgreSQL and MySQL (SQLite does not check). A train_config is cut in it (whole in the run's params).
DESCRIPTION_LIMIT = 5000
_TRAIN_CONFIG_SHOWN = 1000


def version_description(
    config: TrainingConfig, dataset: RunData | None, fit: FitResult, selected_by: str, secret_keys: Collection[str]
) -> str:
    """The registered version's description: what trained it, on which data, the metric that picked its
    checkpoint (``selected_by``: the validation one, not the gate's), and its scores (the code's ``secret_keys``
    masked); at most DESCRIPTION_LIMIT characters."""
    text = _description(config, dataset, fit, selected_by, secret_keys)
    return text if len(text) <= DESCRIPTION_LIMIT else f"{text[: DESCRIPTION_LIMIT - 40]}... (scores in the tags)"


def _description(
    config: TrainingConfig, dataset: RunData | None, fit: FitResult, selected_by: str, secret_keys: Collection[str]
) -> str:
    scores = ", ".join(f"{key} {value:.4f}" for key, value in sorted(fit.scores.items()))
    data = f" on prepared data {dataset.content_hash}" if dataset is not None else ""
    train_config = config.train_config_shown(secret_keys)
    if len(train_config) > _TRAIN_CONFIG_SHOWN:
        train_config = f"{train_config[:_TRAIN_CONFIG_SHOWN]}... (whole in the run's params)"
    return (
        f"{config.train_code} trained{data} by run {fit.run_key} (train_config {train_config}); "
        f"best checkpoint: epoch {fit.best_epoch} by {selected_by}; {scores}."
    )


def version_tags(
    config: TrainingConfig, dataset: RunData | None, fit: FitResult, spec: TrainFunc, schema: str
) -> dict[str, str]:
    """A new version's tags: its scores, run key, lineage and what makes it comparable (``schema``: the digest of
    your code's ``schema(config)``, raytrain_driver.register_steps.user_schema)."""
    from raytrain_driver import register_steps

    lineage = register_steps.version_tags(config, spec, fit.scores[spec.gate.name], schema) | (
        {"dataset_hash": dataset.content_hash} if dataset is not None else {}
    )
    return {  # the scores first: a metric of your code named like one of the pipeline's tags never replaces it
        **{key: f"{value:.6f}" for key, value in sorted(fit.scores.items())},
        VERSION_RUN_KEY_TAG: fit.run_key,
        **lineage,
        "best_epoch": str(fit.best_epoch),
    }


def registered_version(client: MlflowClient, name: str, run_key: str) -> Any | None:
    """The version ``run_key`` registered in ``name`` (its first, the one register-model goes on with); None when
    it registered none."""
    from mlflow.exceptions import MlflowException

    check_run_key(run_key)  # it goes into a filter string
    try:
        found = client.search_model_versions(f"name = '{name}' and tags.{VERSION_RUN_KEY_TAG} = '{run_key}'")
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return min(found, key=lambda version: int(version.version), default=None)
