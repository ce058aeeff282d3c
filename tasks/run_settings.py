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

SETTINGS = tuple(TrainingConfig.model_fields)  # every training setting, in the config's order (the form's)


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
