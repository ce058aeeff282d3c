"""The one typed configuration of a training run (its settings declared by section in raytrain_tasks/settings.py).

It is the flow's parameter set (Prefect renders it as a form), the CLI's flag set, and it crosses into Ray
as ``train_loop_config`` where each worker validates it again before doing anything.
"""

from __future__ import annotations

import json
import re
import secrets
import warnings
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from raytrain_tasks.code_rules import pipeline_keys_refused, train_config_param_problem
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.moved_settings import carried_into_train_config
from raytrain_tasks.settings import (
    DEFAULT_STATE_DIR,
    MAY_CHANGE_ON_RESUME,
    PINNED_BY_DEPLOYMENT,
    TABLE_CLASSIFIER,
    ComputeSettings,
    FaultToleranceSettings,
    ServiceSettings,
    TrainingSettings,
)
from raytrain_tasks.storage.filesystem import StorageOptions, is_s3, s3_endpoint_and_region

# train_config's JSON text at most: it is an MLflow param (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
TRAIN_CONFIG_MAX_CHARS = 6000

# `register` is the public flag name (--register/--no-register); it only shadows ABCMeta.register.
warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)


class TrainingConfig(FaultToleranceSettings, ServiceSettings, TrainingSettings, ComputeSettings):
    """Everything that defines one training pipeline run. No secret belongs here: credentials come from the
    environment (a password put into `mlflow_tracking_uri` anyway is masked wherever this project writes it)."""

    # A refused value is not echoed (it may be a `user:password@host`): messages name the setting, and quote the
    # value only through redact().
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    # The sections' fields come first, compute first (pydantic collects inherited fields from the last base on): the
    # order of the Prefect form, the CLI's --help and docs/configuration.md. The registry's own come last, declared
    # here: a `register` field inherited from a base would resolve to ABCMeta.register.
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
    min_improvement: float = Field(
        json_schema_extra=MAY_CHANGE_ON_RESUME,
        default=0.0,
        ge=0.0,
        allow_inf_nan=False,
        title="Minimum improvement",
        description=(
            "How much a candidate must beat the champion by on the gate's metric to take 'champion', in that "
            "metric's units (0.01 of accuracy, 5.0 of RMSE)."
        ),
    )
    replace_incomparable_champion: bool = Field(
        default=False,
        title="Replace incomparable champion",
        description=(
            "A champion that cannot be compared with this run's model (another input schema: feature names or order, "
            "class labels; another train_code; or, for your code, another gate metric or direction, or another MLflow "
            "signature: inputs or outputs of another type or shape) keeps 'champion' while this is off, and the "
            "reason is recorded. On: the new version replaces it, unscored."
        ),
    )

    @field_validator("train_code")
    @classmethod
    def _code_path(cls, value: str) -> str:
        if not value:  # what runs of releases up to 0.2 said for the built-in classifier (CHANGELOG.md)
            raise ValueError(
                "train_code '' (the built-in classifier of releases up to 0.2) is gone: the table classifier, "
                f"train_code {TABLE_CLASSIFIER!r} (the default), trains the same model on the same table; runs "
                "started with train_code '' cannot be resumed: start a new run"
            )
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", value):
            raise ValueError(
                f"train_code {value!r} must be 'package.module:attribute', e.g. 'my_project.train:training'"
            )
        return value

    @field_validator("train_config")
    @classmethod
    def _json_object(cls, value: dict[str, Any]) -> dict[str, Any]:
        """JSON values only, within MLflow's limits for params (its text is one, each key another); its keys
        sorted, so that the same settings are the same MLflow param whatever their order."""
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"must hold JSON values only (numbers, text, lists, dicts): {exc}") from exc
        if len(text) > TRAIN_CONFIG_MAX_CHARS:
            raise ValueError(
                f"is {len(text)} characters as JSON, more than the {TRAIN_CONFIG_MAX_CHARS} of an MLflow param"
            )
        for key in value:
            if problem := train_config_param_problem(key):
                raise ValueError(f"key {problem}")
        if refused := pipeline_keys_refused(value, "train_config"):
            raise ValueError(refused)
        parsed: dict[str, Any] = json.loads(text)
        return parsed

    def train_config_text(self) -> str:
        """``train_config`` as one canonical JSON text (keys sorted, no spaces): what the code is given."""
        return json.dumps(self.train_config, sort_keys=True, separators=(",", ":"))

    def train_config_shown(self, secret_keys: Collection[str]) -> str:
        """``train_config_text`` with credentials and the code's ``secret_keys`` masked
        (``raytrain_tasks.code_settings.secret_keys``): its MLflow param, version tag and description."""
        from raytrain_tasks.redact import masked_strings

        return json.dumps(masked_strings(self.train_config_masked(secret_keys)), sort_keys=True, separators=(",", ":"))

    def train_config_masked(self, secret_keys: Collection[str]) -> dict[str, Any]:
        """``train_config`` with the values of ``secret_keys`` replaced by a mask."""
        from raytrain_tasks.code_settings import SECRET_MASK

        return {key: SECRET_MASK if key in secret_keys else value for key, value in self.train_config.items()}

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
        from raytrain_tasks.redact import masked_param, strings_in

        settings = self.model_dump(exclude={"train_config"}).items()
        own = ((f"train_config.{key}", text) for key, value in self.train_config.items() for text in strings_in(value))
        for name, value in (*settings, *own):
            if isinstance(value, str) and masked_param(value) != value:  # a password, a token, a secret's value
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

    @field_validator("hang_timeout_s")
    @classmethod
    def _hang_timeout_tells_a_hang(cls, value: float) -> float:
        from raytrain_tasks.long_runs import hang_timeout_refusal

        if why := hang_timeout_refusal(value):
            raise ValueError(why)
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

    def resolved(self, base_dir: Path, environ: Mapping[str, str], code_model_name: str = "") -> TrainingConfig:
        """A copy with an absolute storage path, a concrete tracking URI, as every Ray process needs, and the
        registered model's name: ``model_name``, unless it is the default; then ``code_model_name`` (what the code's
        ``model_name(config)`` gives, raytrain_driver.preflight.code_model_name) or the code's module."""
        storage = self.storage_path.removeprefix("file://")
        if not is_s3(storage) and not Path(storage).is_absolute():
            storage = str((base_dir / storage).resolve())
        tracking = self.mlflow_tracking_uri or environ.get("MLFLOW_TRACKING_URI", "")
        if not tracking:
            tracking = f"sqlite:///{(base_dir / DEFAULT_STATE_DIR / 'mlflow.db').resolve()}"
        endpoint, region = s3_endpoint_and_region(self.s3_endpoint_url, self.s3_region, environ)
        model_name = self.model_name
        if model_name == type(self).model_fields["model_name"].default:
            # One default name for every code would put each code's versions behind another's champion, whose
            # scores are not comparable: they would stay `challenger`.
            model_name = code_model_name or self.train_code.partition(":")[0]
        return self.model_copy(
            update={
                "model_name": model_name,
                "storage_path": storage,
                "mlflow_tracking_uri": tracking,
                "s3_endpoint_url": endpoint.rstrip("/"),
                "s3_region": region,
            }
        )

    def public_params(
        self, code_values: Mapping[str, Any] | None = None, *, secret_keys: Collection[str]
    ) -> dict[str, Any]:
        """The config as flat MLflow params: credentials in URIs and ``secret_keys`` masked, and
        ``train_config.<key>`` for each of ``code_values``, the code's own settings as it gets them
        (``raytrain_tasks.code_settings.shown_values``: ``train_config`` over its defaults)."""
        from raytrain_tasks.code_settings import SECRET_MASK
        from raytrain_tasks.redact import masked_param

        params: dict[str, Any] = {}
        for key, value in self.model_dump().items():
            if key == "train_config":
                value = self.train_config_shown(secret_keys)
            params[key] = masked_param(value) if isinstance(value, str) else value
        shown = self.train_config if code_values is None else code_values
        for key, value in shown.items():
            params[f"train_config.{key}"] = masked_param(
                SECRET_MASK if key in secret_keys else value, TRAIN_CONFIG_MAX_CHARS
            )
        return params


# Every training setting, in the config's order (the Prefect form's): one flow parameter each (flows/parameters.py).
# Prefect's server lays a run's parameters over its deployment's, so what a run stores is what it trains with, and
# a continuation rebuilds the config of the run it continues from that run's parameters alone.
SETTINGS = tuple(TrainingConfig.model_fields)


def parameters_of(config: TrainingConfig) -> dict[str, Any]:
    """The flow parameters that run ``config``: ``training_pipeline(**parameters_of(config))``."""
    return config.model_dump()


def config_from_parameters(parameters: Mapping[str, Any]) -> TrainingConfig:
    """The config a flow run's settings make; SettingsError naming each invalid field otherwise. A run stored
    before the table classifier's settings moved into its ``train_config`` has them carried there."""
    if isinstance(parameters.get("config"), Mapping):
        raise SettingsError(
            "this flow run was created with the settings in one `config` parameter, the form of prefect-raytrain "
            "before each setting became a parameter of its own: nothing was trained. Give the settings one by one "
            "(`-p epochs=3`, `--params '{\"epochs\": 3}'`), and deploy again (prefect deploy, or python -m "
            "deployments.serve) to update a deployment made before"
        )
    settings = {name: value for name, value in carried_into_train_config(parameters).items() if name in SETTINGS}
    try:
        return TrainingConfig.model_validate(settings)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from exc


def non_default_settings(config: TrainingConfig, secret_keys: Collection[str]) -> str:
    """``name=value, ...`` for the settings of ``config`` that differ from the defaults, credentials and the
    code's ``secret_keys`` masked."""
    changed = config.model_dump(exclude_defaults=True)
    shown = config.public_params(secret_keys=secret_keys).items()
    return ", ".join(f"{name}={value}" for name, value in shown if name in changed)


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
        lines.append(f"{field} (--{field.replace('_', '-')}): {err.get('msg')}{_got(err.get('input'))}")
    return "invalid training config:\n  " + "\n  ".join(lines)


def _got(value: Any) -> str:
    """The refused value as the message may show it: a number or a text, credentials masked; nothing of a JSON
    object or list, whose other keys may hold secrets (a password in ``train_config``)."""
    from raytrain_tasks.redact import redact

    if isinstance(value, str):
        return f"; got {redact(value)!r}"
    if value is None or isinstance(value, int | float):
        return f"; got {value!r}"
    return ""


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
