"""The settings of a training run, declared once, by section; ``raytrain_tasks.config.TrainingConfig`` is all of
them together (with the checks that span sections), and the flow's parameters, the CLI's flags, the Prefect form
and docs/configuration.md follow from these declarations, in this order.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

DEFAULT_STATE_DIR = ".pipeline"


# A registered model's name goes into MLflow search filters: no quotes, no backslashes.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$"
MODEL_NAME_MAX = 200


def _object_from_text(value: Any) -> Any:
    """A JSON object, or its text (the command line's ``--train-config``; a Prefect run stored while
    ``train_config`` was text); None (a cleared form field) is {}."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg} at character {exc.pos}): give an object") from None
    if not isinstance(value, dict):
        raise ValueError(f'must be a JSON object like {{"hidden": 64}}, got a {type(value).__name__}')
    return value


# In the type, not in a validator of the config: the flow's signature (flows/parameters.py) carries it, so Prefect's
# own check of a run's parameters takes the text form too.
JsonObject = Annotated[dict[str, Any], BeforeValidator(_object_from_text)]


# On the settings that decide where this process's credentials are sent (MLflow's, the AWS keys, Ray's token): a
# run of a deployment that sets another value than its deployment's is refused
# (flows.run_settings.check_deployment_pins), so whoever may only trigger runs cannot point them at a server of
# their own.
PINNED_BY_DEPLOYMENT: dict[str, Any] = {"pinned_by_deployment": True}
# On the settings that steer a run rather than decide what it trains (retries, windows, registration): a resume may
# give them other values; any other setting changed on resume is refused (raytrain_tasks.tracking.runs), or the
# checkpoints and metrics of one MLflow run would not add up.
MAY_CHANGE_ON_RESUME: dict[str, Any] = {"may_change_on_resume": True}
# The default `train_code`: the table classifier, a TrainSpec like any user's (raytrain_tasks/table_classifier/).
TABLE_CLASSIFIER = "raytrain_tasks.table_classifier:classifier"


class _Section(BaseModel):
    # A refused value is not echoed (it may be a `user:password@host`): messages name the setting, and quote the
    # value only through redact().
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)


class ComputeSettings(_Section):
    """The Ray Train worker group."""

    num_workers: int = Field(
        default=2, ge=1, le=1024, title="Workers", description="Ray Train DDP workers (one process each)."
    )
    max_workers: int = Field(
        default=0,
        ge=0,
        le=1024,
        title="Max workers (elastic)",
        description=(
            "0: exactly num_workers. Above num_workers: elastic, Ray Train starts with whatever fits between "
            "num_workers and max_workers and resizes the group (restarting from the last checkpoint) as "
            "nodes join or leave."
        ),
    )
    use_gpu: bool = Field(
        default=False,
        title="Use GPU",
        description="One GPU per worker and the NCCL backend; gloo on CPUs otherwise.",
    )
    cpus_per_worker: float = Field(
        default=0.0,
        ge=0.0,
        le=256,
        title="CPUs per worker",
        description=(
            "CPU cores reserved per worker (and its torch threads). 0: sized to the cluster when the fit starts, "
            "its CPUs shared among the most workers the run can have (one node each), less what a streamed "
            "Ray Data pipeline needs beside them; the value used is logged, and kept by the run's retries and "
            "resumes while `num_workers` fit at it."
        ),
    )


class TrainingSettings(_Section):
    """What is trained, and how: `train_code` (the table classifier unless it names your own) and its config."""

    train_code: str = Field(
        default=TABLE_CLASSIFIER,
        max_length=300,
        title="Training code",
        description=(
            "Your own training code, 'package.module:attribute' naming a raytrain_tasks.api.TrainFunc (Ray Train's "
            "train_func with its metric and model loader) or TrainSpec (model, data, loss, metrics), imported from "
            "the directory the command runs in or from the installed packages (docs/own-model.md). The default is "
            "the table classifier: its own settings (`dataset`, `label_column`, `hidden_sizes`, ...) go in "
            "train_config."
        ),
    )
    train_config: JsonObject = Field(
        default={},
        title="Training code config (JSON)",
        description=(
            'A JSON object of hyperparameters for `train_code`, e.g. {"hidden": 64} (on the command line, its text): '
            "added to the config its train_func receives (beside the pipeline's epochs, batch_size, lr, seed, "
            "num_workers and use_gpu, which it may not set), logged as MLflow params train_config.<key>, and kept "
            "by a resume."
        ),
    )
    epochs: int = Field(default=3, ge=1, le=10_000, title="Epochs", description="Passes over the training split.")
    batch_size: int = Field(default=32, ge=1, le=65_536, title="Batch size", description="Per worker, per step.")
    learning_rate: float = Field(default=3e-3, gt=0.0, le=10.0, title="Learning rate", description="Adam step size.")
    seed: int = Field(default=42, ge=0, title="Seed", description="Seeds weight init and shuffling.")


class ServiceSettings(_Section):
    """Where state goes and what the run talks to: storage, Ray, MLflow."""

    storage_path: str = Field(
        default=f"{DEFAULT_STATE_DIR}/storage",
        min_length=1,
        title="Storage path",
        description=(
            "Shared storage for datasets and checkpoints: a local directory every Ray node sees, or "
            "s3://bucket/prefix (credentials from the AWS chain: AWS_ACCESS_KEY_ID/..., AWS_PROFILE, roles)."
        ),
    )
    s3_endpoint_url: str = Field(
        json_schema_extra=PINNED_BY_DEPLOYMENT,
        default="",
        title="S3 endpoint URL",
        description="For S3-compatible stores, e.g. 'http://127.0.0.1:8333'. Empty: AWS_ENDPOINT_URL_S3, "
        "AWS_ENDPOINT_URL, or AWS itself.",
    )
    s3_region: str = Field(
        default="", title="S3 region", description="Empty: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1."
    )
    s3_max_attempts: int = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=8,
        ge=1,
        le=15,
        title="S3 attempts per request",
        description=(
            "How often a checkpoint or data request to S3 is tried, with AWS's standard backoff, before the epoch "
            "fails: 8 rides out about a minute of outage, 3 (AWS's default) about 2 s."
        ),
    )
    create_bucket: bool = Field(
        default=False, title="Create bucket", description="Create the storage bucket if it does not exist."
    )
    ray_address: str = Field(
        json_schema_extra=PINNED_BY_DEPLOYMENT,
        default="",
        title="Ray address",
        description="Empty: start a local Ray. Otherwise a cluster address, e.g. '127.0.0.1:6379' or 'ray://h:10001'.",
    )
    ray_connect_timeout_s: float = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=60.0,
        ge=1,
        le=3600,
        title="Ray connect timeout (s)",
        description="How long connecting to the cluster at `ray_address` may take before the run fails.",
    )
    launch_mode: Literal["driver", "ray_job"] = Field(
        default="driver",
        title="Launch mode",
        description=(
            "driver: the fit's Ray driver runs in the flow-run process. ray_job (a cluster by `ray_address`): it "
            "runs on the cluster as a Ray Job, which keeps training if the flow-run process dies; the next run "
            "with the same run key re-attaches to it."
        ),
    )
    ray_dashboard_url: str = Field(
        json_schema_extra=PINNED_BY_DEPLOYMENT,
        default="",
        title="Ray dashboard URL",
        description=(
            "Where launch_mode=ray_job submits the fit (what `ray job submit --address` takes). Empty: the host "
            "of `ray_address`, port 8265."
        ),
    )
    forward_credentials_to_cluster: bool = Field(
        json_schema_extra={**PINNED_BY_DEPLOYMENT, **MAY_CHANGE_ON_RESUME},
        default=False,
        title="Forward credentials to the cluster",
        description=(
            "Copy this process's AWS keys and MLflow credentials into the Ray job's runtime_env. Ray keeps them in "
            "its job table, readable by anyone who reaches the cluster's dashboard. Off: nodes use their own."
        ),
    )
    mlflow_tracking_uri: str = Field(
        json_schema_extra=PINNED_BY_DEPLOYMENT,
        default="",
        title="MLflow tracking URI",
        description=f"Empty: a SQLite store under ./{DEFAULT_STATE_DIR}/. Or e.g. 'http://127.0.0.1:5000'.",
    )
    experiment_name: str = Field(
        default="prefect-raytrain", min_length=1, title="MLflow experiment", description="Created if missing."
    )
    system_metrics: bool = Field(
        default=False,
        title="Log system metrics",
        description="Sample CPU, memory (and GPU when present) of the driver's node into the MLflow run every 5 s.",
    )
    model_name: str = Field(
        default="digits-classifier",
        min_length=1,
        max_length=MODEL_NAME_MAX,
        # It goes into MLflow search filters: no quotes, no backslashes.
        pattern=MODEL_NAME_PATTERN,
        title="Registered model name",
        description=(
            "MLflow registered model that receives a new version per run (letters, digits, space, . _ -). At this "
            "default, the name the code gives (its `model_name=`; the table classifier's: 'flowers-classifier' for "
            "flowers.csv) or else its module (e.g. 'my_model.train') is the name instead."
        ),
    )


class FaultToleranceSettings(_Section):
    """Retries, restarts, windows, and the run a resume continues."""

    max_failures: int = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=2,
        ge=0,
        le=100,
        title="Max worker failures",
        description="Worker-group restarts Ray Train makes, each resuming from the last checkpoint.",
    )
    checkpoints_to_keep: int = Field(
        default=2,
        ge=1,
        le=1000,
        title="Checkpoints to keep",
        description="Checkpoints kept per run: the best by the code's metric, plus always the latest.",
    )
    checkpoint_every_steps: int = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=0,
        ge=0,
        le=100_000_000,
        title="Checkpoint every N steps",
        description=(
            "A TrainSpec also checkpoints within an epoch, every this many training steps; a resume continues from "
            "that step exactly. 0: at epoch ends only."
        ),
    )
    checkpoint_every_minutes: float = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=0.0,
        ge=0,
        le=10_080,
        title="Checkpoint every N minutes",
        description="As `checkpoint_every_steps`, by time: at the first step after this many minutes. 0: off.",
    )
    hang_timeout_s: float = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=0.0,
        ge=0,
        le=86_400,
        title="Hang timeout (s)",
        description=(
            "A collective (gradient all-reduce, barrier) that waits longer than this fails, and Ray Train restarts "
            "the worker group from its last checkpoint (counted in `max_failures`). 0: 600 s on CPUs, 1800 s on "
            "GPUs. At least 30 s."
        ),
    )
    fit_retries: int = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=1,
        ge=0,
        le=20,
        title="Fit retries",
        description="Prefect retries of the distributed-fit task; each resumes from the last checkpoint.",
    )
    retry_delay_seconds: float = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=5.0,
        ge=0,
        le=3600,
        title="Retry delay (s)",
        description="Wait before a distributed-fit retry.",
    )
    max_crash_resumes: int = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=2,
        ge=0,
        le=20,
        title="Max crash continuations",
        description=(
            "How often a deployment run whose process died (Crashed) is continued automatically from its last "
            "checkpoint, per run key; 0 turns it off. A run that crashes more often stays Crashed for a person."
        ),
    )
    run_lease_seconds: float = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=60.0,
        ge=5,
        le=3600,
        title="Driver lease (s)",
        description="How long a run key stays locked to its driver after that driver stops renewing (e.g. dies).",
    )
    resume: str = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default="",
        title="Resume run key",
        description="Run key of an interrupted run to continue (printed at start, tagged in MLflow).",
    )
