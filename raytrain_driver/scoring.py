"""Batch scoring with a registered model (the `score` flow, tasks/score.py): resolve the model once, check the input
against it and the output path, then predict with an actor pool on Ray and commit one Parquet file.

Everything that can be refused is refused in ``plan_scoring``, before Ray starts: a model or alias that does not
exist, an unreachable registry, a model this project would not load, input columns or types that do not fit the
model, an output that holds other predictions. ``score`` then reads the input with Ray Data, predicts in
``concurrency`` actors (raytrain_tasks.scoring.predictor), stages the parts beside the output and commits them
(raytrain_driver.scoring_output), and records in MLflow which version scored which input, and how many rows.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_driver.champion import check_model_layout, download_model
from raytrain_driver.scoring_input import InputTable, check_no_missing_values, read_input
from raytrain_driver.scoring_output import OutputAction, Provenance, output_action, read_provenance
from raytrain_tasks.errors import ScoringInputError, TrackingError
from raytrain_tasks.redact import redact, redact_uri
from raytrain_tasks.scoring.columns import FeaturePlan, ModelInputs, plan_features
from raytrain_tasks.scoring.config import MODEL_URI_PREFIX, ScoringConfig
from raytrain_tasks.storage.locations import locate
from raytrain_tasks.tracking import runs as tracking

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelVersion:
    """The registered version a run scores with, resolved once, and a checked local copy of its files."""

    name: str
    version: str
    alias: str  # "" when the URI named the version
    run_id: str
    folder: str  # the local copy whose files were checked; actors load these bytes
    files_sha256: dict[str, str] = field(default_factory=dict)
    inputs: ModelInputs = ModelInputs(width=None)

    @property
    def uri(self) -> str:
        return f"{MODEL_URI_PREFIX}{self.name}/{self.version}"


@dataclass(frozen=True)
class ScoringPlan:
    """What ``score`` carries out: the resolved version, the input, which columns feed the model, what the output
    holds now and what to do about it."""

    model: ModelVersion
    table: InputTable
    features: FeaturePlan
    action: OutputAction
    why: str

    @property
    def provenance(self) -> Provenance:
        return Provenance(self.model.name, self.model.version, self.table.sha256)


def plan_scoring(config: ScoringConfig, scratch: Path) -> ScoringPlan:
    """Resolve the model once, read the input's columns and hash, look at the output: a ScoringInputError or
    TrackingError naming the setting for anything that would fail, before any row is scored."""
    client = tracking.connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
    model = resolve_model(client, config, scratch)
    table = read_input(config)
    features = plan_features(list(table.columns), set(table.numeric), config.key_column, model.inputs)
    check_no_missing_values(config, table, features.features)
    output = locate(config.output_path, config.storage_options)
    planned = Provenance(model.name, model.version, table.sha256)
    action, why = output_action(read_provenance(output), planned, config.overwrite)
    if action is OutputAction.REFUSE:
        raise ScoringInputError(f"output_path {redact_uri(config.output_path)}: {why}")
    return ScoringPlan(model, table, features, action, why)


def resolve_model(client: MlflowClient, config: ScoringConfig, scratch: Path) -> ModelVersion:
    """The version ``config.model`` names now, its files downloaded once and checked (this project's pt2 layout,
    nothing else), and what its signature and metadata say it takes."""
    from mlflow.exceptions import MlflowException

    name, alias, version = _parse_model_uri(config.model)
    try:
        found = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    except MlflowException as exc:
        if getattr(exc, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise ScoringInputError(
                f"model {config.model}: no such registered model version in the registry at "
                f"{redact_uri(config.mlflow_tracking_uri)} ({redact(str(exc))[:300]}); check `model`"
            ) from None
        raise TrackingError(
            f"cannot read {config.model} from the registry at {redact_uri(config.mlflow_tracking_uri)}: "
            f"{redact(str(exc))[:300]}; check `mlflow_tracking_uri`"
        ) from None
    resolved = f"{MODEL_URI_PREFIX}{name}/{found.version}"
    with tracking.using_tracking_uri(config.mlflow_tracking_uri):
        folder = download_model(resolved, scratch)
    layout = check_model_layout(folder)
    if layout.foreign or layout.tampered:
        raise ScoringInputError(f"model {config.model} (version {found.version}): {layout.foreign or layout.tampered}")
    hashes = {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    return ModelVersion(name, str(found.version), alias, found.run_id or "", str(folder), hashes, _inputs_of(folder))


def _parse_model_uri(uri: str) -> tuple[str, str, str]:
    """(name, alias, version) of ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``; one of alias and version."""
    rest = uri.removeprefix(MODEL_URI_PREFIX)
    if "@" in rest:
        name, _, alias = rest.rpartition("@")
        if name and alias:
            return name, alias, ""
    name, _, version = rest.rpartition("/")
    if name and version.isdigit():
        return name, "", version
    raise ScoringInputError(f"model {uri!r}: give models:/NAME@ALIAS (e.g. @champion) or models:/NAME/VERSION")


def _inputs_of(folder: Path) -> ModelInputs:
    """What the model takes: its signature's width and type, and its metadata's column and class names."""
    from mlflow.models import Model

    model = Model.load(str(folder))
    metadata = model.metadata or {}
    width, dtype = None, "float32"
    specs = model.signature.inputs.inputs if model.signature is not None else []
    if len(specs) == 1 and hasattr(specs[0], "shape"):  # one tensor, as this project's pt2 models take
        shape = specs[0].shape
        width = shape[-1] if len(shape) == 2 and shape[-1] > 0 else None
        dtype = str(specs[0].type)
    names = tuple(str(name) for name in metadata.get("feature_names") or ())
    labels = tuple(str(label) for label in metadata.get("class_labels") or ())
    return ModelInputs(width, dtype, names, labels)


def scratch_folder() -> Any:
    """Where the model's checked copy lives while the run scores (removed after)."""
    return tempfile.TemporaryDirectory(prefix="prt-score-")
