"""The settings of a scoring run (the `score` flow and `prefect-raytrain score`): one frozen model, validated once.
Where a setting means what the training run's does (Ray, S3, MLflow), its declaration is the training one's."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from raytrain_tasks.settings import DEFAULT_STATE_DIR, ServiceSettings
from raytrain_tasks.storage.filesystem import StorageOptions, is_s3, s3_endpoint_and_region


def _as_for_training(name: str) -> Any:
    """The training settings' declaration of ``name``: its type's bounds, title, description and default."""
    return ServiceSettings.model_fields[name]


MODEL_URI_PREFIX = "models:/"


class ScoringConfig(BaseModel):
    """What to score with which model, and where the predictions go."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        min_length=len(MODEL_URI_PREFIX) + 1,
        title="Model",
        description="The registered model, as MLflow names it: 'models:/NAME@ALIAS' (e.g. models:/digits-classifier"
        "@champion), resolved once when the run starts, or 'models:/NAME/VERSION'.",
    )
    input_path: str = Field(
        min_length=1,
        title="Input",
        description="The table to score: a CSV or Parquet file, or a folder of them; a local path or s3://bucket/key.",
    )
    output_path: str = Field(
        min_length=1,
        title="Output",
        description="The predictions: one Parquet file (a path ending in .parquet), local or s3://. It appears whole, "
        "once every row is scored.",
    )
    key_column: str = Field(
        default="id", min_length=1, title="Key column", description="The input's column copied beside each prediction."
    )
    concurrency: int = Field(
        default=2, ge=1, le=256, title="Actors", description="How many model replicas predict at once (Ray actors)."
    )
    batch_size: int = Field(default=4096, ge=1, le=1_000_000, title="Batch size", description="Rows per prediction.")
    use_gpu: bool = Field(default=False, title="Use GPUs", description="One GPU per actor.")
    overwrite: bool = Field(
        default=False,
        title="Overwrite",
        description="Replace an output that holds other predictions (another model version or input). Off: such a "
        "run is refused; one of the same version and input finds its output already written.",
    )
    mlflow_tracking_uri: str = _as_for_training("mlflow_tracking_uri")
    experiment_name: str = Field(
        default="prefect-raytrain-scoring",
        min_length=1,
        title="MLflow experiment",
        description="Where each scoring run is recorded: the model version, the input's content hash, the rows.",
    )
    ray_address: str = _as_for_training("ray_address")
    ray_connect_timeout_s: float = _as_for_training("ray_connect_timeout_s")
    forward_credentials_to_cluster: bool = _as_for_training("forward_credentials_to_cluster")
    s3_endpoint_url: str = _as_for_training("s3_endpoint_url")
    s3_region: str = _as_for_training("s3_region")
    s3_max_attempts: int = _as_for_training("s3_max_attempts")

    @property
    def train_code(self) -> str:
        """No code of the user's ships to a cluster: the model is all it runs (raytrain_driver.cluster)."""
        return ""

    @property
    def storage_options(self) -> StorageOptions:
        return StorageOptions(
            endpoint_url=self.s3_endpoint_url, region=self.s3_region, max_attempts=self.s3_max_attempts
        )

    @field_validator("model")
    @classmethod
    def _model_uri(cls, value: str) -> str:
        name = value.removeprefix(MODEL_URI_PREFIX)
        if not value.startswith(MODEL_URI_PREFIX) or not name or name.startswith("/"):
            raise ValueError(
                f"{value!r} is not a registered model's URI: give models:/NAME@ALIAS or models:/NAME/VERSION"
            )
        return value

    @field_validator("output_path")
    @classmethod
    def _parquet_file(cls, value: str) -> str:
        if not value.endswith(".parquet"):
            raise ValueError(f"{value!r} does not end in .parquet: the predictions are written as one Parquet file")
        return value

    @field_validator("s3_endpoint_url")
    @classmethod
    def _endpoint_is_url(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("not an http(s) URL, e.g. http://127.0.0.1:8333")
        return value.rstrip("/")

    def resolved(self, base_dir: Path, environ: Mapping[str, str] = os.environ) -> ScoringConfig:
        """A copy with absolute local paths and a concrete tracking URI, as the training run resolves them."""

        def absolute(path: str) -> str:
            path = path.removeprefix("file://")
            return path if is_s3(path) or Path(path).is_absolute() else str((base_dir / path).resolve())

        tracking = self.mlflow_tracking_uri or environ.get("MLFLOW_TRACKING_URI", "")
        if not tracking:
            tracking = f"sqlite:///{(base_dir / DEFAULT_STATE_DIR / 'mlflow.db').resolve()}"
        endpoint, region = s3_endpoint_and_region(self.s3_endpoint_url, self.s3_region, environ)
        return self.model_copy(
            update={
                "input_path": absolute(self.input_path),
                "output_path": absolute(self.output_path),
                "mlflow_tracking_uri": tracking,
                "s3_endpoint_url": endpoint.rstrip("/"),
                "s3_region": region,
            }
        )
