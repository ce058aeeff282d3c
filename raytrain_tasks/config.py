"""The one typed configuration of a training run.

It is the flow's parameter set (Prefect renders it as a form), the CLI's flag set, and it crosses into Ray
as ``train_loop_config`` where each worker validates it again before doing anything.
"""

from __future__ import annotations

import json
import re
import secrets
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raytrain_tasks.api import Metric
from raytrain_tasks.datasets import BUILTIN_DATASETS, SUPPORTED_FILE_SUFFIXES
from raytrain_tasks.fs import StorageOptions, is_s3
from raytrain_tasks.models import MODELS

DEFAULT_STATE_DIR = ".pipeline"


# `register` is the public flag name (--register/--no-register); it only shadows ABCMeta.register.
warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)


def _dataset_stem(dataset: str) -> str:
    """A registered-model name part from ``dataset``: 'synthetic', or its file's name without the extension."""
    stem = PurePosixPath(dataset.rstrip("/").split("://", 1)[-1]).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._") or "dataset"


# On the settings that decide where this process's credentials are sent (MLflow's, the AWS keys, Ray's token): a
# run of a deployment that sets another value than its deployment's is refused
# (tasks.run_settings.check_deployment_pins), so whoever may only trigger runs cannot point them at a server of
# their own.
PINNED_BY_DEPLOYMENT: dict[str, Any] = {"pinned_by_deployment": True}
# On the settings that steer a run rather than decide what it trains (retries, windows, registration): a resume may
# give them other values; any other setting changed on resume is refused (driver.tracking), or the checkpoints and
# metrics of one MLflow run would not add up.
MAY_CHANGE_ON_RESUME: dict[str, Any] = {"may_change_on_resume": True}


class TrainingConfig(BaseModel):
    """Everything that defines one training pipeline run. No secret belongs here: credentials come from the
    environment (a password put into `mlflow_tracking_uri` anyway is masked wherever this project writes it)."""

    # A refused value is not echoed (it may be a `user:password@host`): messages name the setting, and quote the
    # value only through redact().
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    # --- data ---
    dataset: str = Field(
        default="digits",
        title="Dataset",
        description=(
            "'digits' (scikit-learn's bundled 8x8 handwritten digits), 'synthetic' (a generated "
            "classification problem), or a path/URI to a .csv or .parquet file with a label column."
        ),
    )
    label_column: str = Field(
        default="label",
        min_length=1,
        title="Label column",
        description="Name of the class-label column in a CSV/Parquet dataset.",
    )
    synthetic_samples: int = Field(
        default=4000, ge=100, le=10_000_000, title="Synthetic samples", description="Rows of 'synthetic'."
    )
    synthetic_features: int = Field(
        default=20, ge=2, le=10_000, title="Synthetic features", description="Feature columns of 'synthetic'."
    )
    val_fraction: float = Field(
        default=0.2,
        gt=0.0,
        lt=0.9,
        title="Validation fraction",
        description="Share of rows held out to pick the best checkpoint.",
    )
    test_fraction: float = Field(
        default=0.1,
        gt=0.0,
        lt=0.9,
        title="Test fraction",
        description=(
            "Share of rows held out from training and checkpoint selection; the candidate and the champion are "
            "compared on it."
        ),
    )
    split_key_column: str = Field(
        default="",
        title="Split key column",
        description=(
            "Column whose value identifies a row (not used as a feature); a row's split follows from its hash, so "
            "rows keep their split as data grows. Empty: the hash of the row's values."
        ),
    )

    # --- compute ---
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

    data_loader: Literal["torch", "ray_data"] = Field(
        default="torch",
        title="Data loader",
        description=(
            "'torch': every worker reads the split and a DistributedSampler shards it. 'ray_data': Ray Data "
            "reads the Parquet split and standardises it on CPU tasks, once per run into Ray's object store when "
            "it fits (streamed every epoch beside the workers otherwise), and feeds a disjoint shard to each "
            "worker."
        ),
    )

    # --- training ---
    train_code: str = Field(
        default="",
        max_length=300,
        title="Training code",
        description=(
            "Your own training code, 'package.module:attribute' naming a raytrain_tasks.api.TrainFunc (Ray Train's "
            "train_func with its metric and model loader), imported from the directory the command runs in or "
            "from the installed packages. Empty: the built-in table classifier (`model`, `dataset`, ...)."
        ),
    )
    train_config: str = Field(
        default="{}",
        max_length=20_000,
        title="Training code config (JSON)",
        description=(
            'A JSON object of hyperparameters for `train_code`, e.g. {"hidden": 64}: added to the config its '
            "train_func receives (beside epochs, batch_size, lr, seed), logged as MLflow params train_config.<key>, "
            "and kept by a resume."
        ),
    )
    model: Literal[tuple(MODELS)] = Field(  # type: ignore[valid-type]
        default="mlp", title="Model", description="Model architecture from raytrain_tasks/models.py."
    )
    hidden_sizes: list[int] = Field(
        default=[128, 64],
        min_length=1,
        max_length=16,
        title="Hidden layer sizes",
        description="Widths of the hidden layers, e.g. [128, 64].",
    )
    epochs: int = Field(default=3, ge=1, le=10_000, title="Epochs", description="Passes over the training split.")
    batch_size: int = Field(default=32, ge=1, le=65_536, title="Batch size", description="Per worker, per step.")
    learning_rate: float = Field(default=3e-3, gt=0.0, le=10.0, title="Learning rate", description="Adam step size.")
    seed: int = Field(
        default=42, ge=0, title="Seed", description="Seeds weight init and shuffling (splits follow row hashes)."
    )

    # --- storage and services ---
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
        max_length=200,
        # It goes into MLflow search filters: no quotes, no backslashes.
        pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$",
        title="Registered model name",
        description=(
            "MLflow registered model that receives a new version per run (letters, digits, space, . _ -). With "
            "`train_code` and this default, the module of the code (e.g. 'my_model.train') is the name instead; "
            "with another `dataset`, its file name (e.g. 'flowers-classifier' for flowers.csv, "
            "'synthetic-classifier')."
        ),
    )

    # --- fault tolerance ---
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
        description="Checkpoints kept per run: the best by promotion_metric, plus always the latest.",
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

    # --- registry ---
    register: bool = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=True,
        title="Register model",
        description="Register a model version.",
    )
    promote: bool = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=True,
        title="Promote",
        description="Move 'champion' when the new version is better.",
    )
    input_example: Literal["synthetic", "validation_rows"] = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default="synthetic",
        title="Model input example",
        description=(
            "What the logged model stores as its input example in the artifact store. 'synthetic': rows made from "
            "the training split's per-feature mean and spread, no real record. 'validation_rows': five real rows."
        ),
    )
    promotion_metric: Literal["val_accuracy", "val_loss"] = Field(
        default="val_accuracy",
        title="Promotion metric",
        description=(
            "Picks the best checkpoint on the validation split (higher accuracy or lower loss wins); the candidate "
            "and the champion are then compared on the same measure on the held-out test split."
        ),
    )
    min_improvement: float = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=0.0,
        ge=0.0,
        le=1.0,
        title="Minimum improvement",
        description="How much a candidate must beat the champion by on `promotion_metric` to take 'champion'.",
    )
    replace_incomparable_champion: bool = Field(
        default=False,
        title="Replace incomparable champion",
        description=(
            "A champion with another input schema (feature names or order, class labels) cannot be compared. "
            "Off: it keeps 'champion' and the reason is recorded. On: the new version replaces it."
        ),
    )

    @field_validator("train_code")
    @classmethod
    def _code_path(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", value):
            raise ValueError(
                f"train_code {value!r} must be 'package.module:attribute', e.g. 'my_project.train:training'"
            )
        return value

    @field_validator("train_config")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value or "{}")
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"train_config is not valid JSON ({exc.msg} at character {exc.pos}): give an object"
            ) from None
        if not isinstance(parsed, dict):
            raise ValueError(f'train_config must be a JSON object like {{"hidden": 64}}, got a {type(parsed).__name__}')
        # One canonical text: the same settings are the same MLflow param, whatever the spacing.
        return json.dumps(parsed, sort_keys=True, separators=(",", ":"))

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        if value in BUILTIN_DATASETS:
            return value
        if value.lower().endswith(SUPPORTED_FILE_SUFFIXES):
            return value
        from raytrain_tasks.redact import redact

        raise ValueError(
            f"unknown dataset {redact(value)!r}: use one of {sorted(BUILTIN_DATASETS)} "
            f"or a path/URI ending in {', '.join(SUPPORTED_FILE_SUFFIXES)}"
        )

    @model_validator(mode="after")
    def _held_out_share(self) -> TrainingConfig:
        if self.val_fraction + self.test_fraction >= 0.9:
            raise ValueError(
                f"val_fraction ({self.val_fraction}) + test_fraction ({self.test_fraction}) must leave at least 10% "
                "of the rows for training"
            )
        return self

    @model_validator(mode="after")
    def _elastic_range(self) -> TrainingConfig:
        if self.max_workers and self.max_workers < self.num_workers:
            raise ValueError(
                f"max_workers ({self.max_workers}) must be 0 (fixed size) or at least num_workers ({self.num_workers})"
            )
        return self

    @model_validator(mode="after")
    def _ray_job_needs_a_cluster(self) -> TrainingConfig:
        if self.launch_mode != "ray_job":
            return self
        if not self.ray_address or self.ray_address.startswith("ray://"):
            raise ValueError(
                "launch_mode='ray_job' runs the fit on a cluster reached by address: set `ray_address` to the "
                "cluster's GCS address (e.g. 10.0.0.5:6379; not empty, not ray://), or set `launch_mode` to 'driver'"
            )
        from raytrain_tasks.redact import redact_uri

        for name, value in self.model_dump().items():
            if isinstance(value, str) and "://" in value and redact_uri(value) != value:
                raise ValueError(
                    f"launch_mode='ray_job': `{name}` carries credentials, and a Ray Job's entrypoint (which holds "
                    "the settings) is shown on the cluster's dashboard; give the nodes their own credentials "
                    "(e.g. MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) and remove them from the URI"
                )
        return self

    @property
    def dashboard_url(self) -> str:
        """Where Ray Jobs are submitted: `ray_dashboard_url`, or the host of `ray_address` on port 8265."""
        if self.ray_dashboard_url:
            return self.ray_dashboard_url.rstrip("/")
        host = self.ray_address.rsplit(":", 1)[0] if ":" in self.ray_address else self.ray_address
        return f"http://{host}:8265"

    @property
    def worker_range(self) -> tuple[int, int]:
        """(minimum, maximum) workers: equal unless elastic."""
        return self.num_workers, max(self.num_workers, self.max_workers)

    @field_validator("hidden_sizes")
    @classmethod
    def _positive_sizes(cls, value: list[int]) -> list[int]:
        if any(size < 1 for size in value):
            raise ValueError(f"every hidden layer size must be >= 1, got {value}")
        return value

    @field_validator("storage_path")
    @classmethod
    def _supported_storage(cls, value: str) -> str:
        if "://" in value and not value.startswith(("file://", "s3://")):
            scheme = value.split("://", 1)[0]
            raise ValueError(f"storage scheme {scheme!r} is not supported: use a directory path or s3://bucket/prefix")
        if value.startswith("s3://") and not value.removeprefix("s3://").split("/", 1)[0]:
            from raytrain_tasks.redact import redact

            raise ValueError(f"{redact(value)!r} names no bucket: use s3://bucket/prefix")
        return value

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint_is_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            from raytrain_tasks.redact import redact

            raise ValueError(f"{redact(value)!r} is not an http(s) URL, e.g. http://127.0.0.1:8333")
        return value.rstrip("/")

    @property
    def storage_options(self) -> StorageOptions:
        return StorageOptions(
            endpoint_url=self.s3_endpoint_url, region=self.s3_region, max_attempts=self.s3_max_attempts
        )

    @field_validator("resume")
    @classmethod
    def _resume_is_run_key(cls, value: str) -> str:
        return check_run_key(value) if value else value

    def resolved(self, base_dir: Path, environ: Mapping[str, str]) -> TrainingConfig:
        """A copy with an absolute storage path and a concrete tracking URI, as every Ray process needs."""
        storage = self.storage_path.removeprefix("file://")
        if not is_s3(storage) and not Path(storage).is_absolute():
            storage = str((base_dir / storage).resolve())
        tracking = self.mlflow_tracking_uri or environ.get("MLFLOW_TRACKING_URI", "")
        if not tracking:
            tracking = f"sqlite:///{(base_dir / DEFAULT_STATE_DIR / 'mlflow.db').resolve()}"
        endpoint = self.s3_endpoint_url or environ.get("AWS_ENDPOINT_URL_S3", "") or environ.get("AWS_ENDPOINT_URL", "")
        region = self.s3_region or environ.get("AWS_REGION", "") or environ.get("AWS_DEFAULT_REGION", "")
        model_name = self.model_name
        if model_name == type(self).model_fields["model_name"].default:
            # The digits classifier's name is no name for a user's model or data: it would land behind that
            # champion, whose scores are not comparable, and stay `challenger`.
            if self.train_code:
                model_name = self.train_code.partition(":")[0]
            elif self.dataset != "digits":
                model_name = f"{_dataset_stem(self.dataset)}-classifier"
        return self.model_copy(
            update={
                "model_name": model_name,
                "storage_path": storage,
                "mlflow_tracking_uri": tracking,
                "s3_endpoint_url": endpoint.rstrip("/"),
                "s3_region": region,
            }
        )

    @property
    def selection(self) -> Metric:
        """The built-in classifier's `promotion_metric` with its direction, decided here alone: it picks a run's
        best checkpoint (on the validation split), and its test-split counterpart is what the gate compares."""
        return Metric(self.promotion_metric, higher_is_better=self.promotion_metric != "val_loss")

    @property
    def gate(self) -> Metric:
        """The built-in classifier's gate: the held-out test split's counterpart of `promotion_metric`."""
        selection = self.selection
        return Metric("test_" + selection.name.removeprefix("val_"), selection.higher_is_better)

    def public_params(self) -> dict[str, Any]:
        """The config as flat MLflow params: lists joined, credentials in URIs masked."""
        from raytrain_tasks.redact import redact, redact_uri

        params: dict[str, Any] = {}
        for key, value in self.model_dump().items():
            if isinstance(value, list):
                value = ",".join(map(str, value))
            if isinstance(value, str):  # a URI may carry user:password@ or ?token=
                value = redact_uri(value) if "://" in value else redact(value)
            params[key] = value
        for key, value in json.loads(self.train_config).items():
            params[f"train_config.{key}"] = value if isinstance(value, str | int | float | bool) else json.dumps(value)
        return params


def new_run_key(now: datetime | None = None) -> str:
    """A fresh key naming one logical run: its Ray Train run, its checkpoints and its MLflow run."""
    now = now or datetime.now(UTC)
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


RUN_KEY_PATTERN = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")


def _looks_like_run_key(value: str) -> bool:
    return RUN_KEY_PATTERN.fullmatch(value) is not None


def check_run_key(value: str) -> str:
    """``value`` if it has exactly the form ``new_run_key`` makes; a run key names folders and MLflow filters."""
    if not isinstance(value, str) or not _looks_like_run_key(value):
        raise ValueError(f"{value!r} is not a run key (expected the form 20261122-101500-a1b2c3)")
    return value


def describe_validation_error(exc: Exception) -> str:
    """One line per invalid field, naming it the way the CLI and the Prefect form do."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for err in errors():
        field = ".".join(str(p) for p in err.get("loc", ()))
        if not field:  # a rule across fields: its message names them
            lines.append(str(err.get("msg")).removeprefix("Value error, "))
            continue
        lines.append(f"{field} (--{field.replace('_', '-')}): {err.get('msg')}; got {err.get('input')!r}")
    return "invalid training config:\n  " + "\n  ".join(lines)


def _marked(marker: dict[str, Any]) -> tuple[str, ...]:
    """The settings whose field carries ``marker``, in the config's order."""
    ((key, _),) = marker.items()
    return tuple(
        name
        for name, field in TrainingConfig.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get(key) is True
    )


PINNED = _marked(PINNED_BY_DEPLOYMENT)
RESUME_MAY_CHANGE = frozenset(_marked(MAY_CHANGE_ON_RESUME))
PINNED_NOTE = "Pinned by a deployment: a run of a deployment that sets another value than the deployment's is refused."
