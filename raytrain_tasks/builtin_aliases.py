"""The built-in classifier's settings, given to the table classifier (a TrainSpec) under its own names.

The table classifier (``TABLE_CLASSIFIER``) trains what the built-in classifier trains, as a plain user of the
public API: its data, model and gate settings live in ``train_config``. A run of it may still say them the way the
built-in classifier's users do (``--dataset customers.csv --promotion-metric val_loss``): each such setting, set
away from its default, is carried into ``train_config`` under the classifier's name for it, and put back to its
default, so that the run, its MLflow params and its resume know one value in one place.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from raytrain_tasks.config import BUILTIN_CLASSIFIER_ONLY, TrainingConfig
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.settings import TABLE_CLASSIFIER

# Built-in setting -> the table classifier's train_config key, where the names differ. `model` has no key: 'mlp',
# its one value, is the table classifier's model. s3_endpoint_url / s3_region are the run's own (its storage's), not
# carried: the classifier reads an s3:// table through its train_config's, else the environment's (AWS_ENDPOINT_URL).
_RENAMED = {"promotion_metric": "metric"}
_NO_KEY = frozenset({"model"})


def _default(name: str) -> Any:
    return TrainingConfig.model_fields[name].get_default(call_default_factory=True)


def _as_table_classifier_value(name: str, value: Any) -> Any:
    if name == "promotion_metric":
        return str(value).removeprefix("val_")  # val_accuracy -> accuracy: it picks on val_, the gate on test_
    return list(value) if isinstance(value, tuple) else value


def with_builtin_settings_carried(config: TrainingConfig) -> TrainingConfig:
    """``config`` for the table classifier with the built-in classifier's settings it sets carried into
    ``train_config`` (and back at their defaults); any other config as it is. Refused (SettingsError) where a
    setting and ``train_config`` give the same key different values: which one was meant cannot be told."""
    if config.train_code != TABLE_CLASSIFIER:
        return config
    carried: dict[str, tuple[str, Any]] = {}  # key -> (the setting that gave it, its value)
    for name in BUILTIN_CLASSIFIER_ONLY:
        value = getattr(config, name)
        if name in _NO_KEY or value == _default(name):
            continue
        carried[_RENAMED.get(name, name)] = (name, _as_table_classifier_value(name, value))
    clashes = [  # named, not quoted: a value may hold credentials
        f"{name} and train_config.{key}"
        for key, (name, value) in carried.items()
        if key in config.train_config and config.train_config[key] != value
    ]
    if clashes:
        raise SettingsError(
            f"{'; '.join(clashes)} both set the table classifier's setting, to different values: give it once "
            "(in train_config, or as the built-in classifier's setting)"
        )
    if not carried:
        return config
    reset = {name: _default(name) for name, _ in carried.values()}
    train_config = {**config.train_config, **{key: value for key, (_, value) in carried.items()}}
    try:
        return TrainingConfig.model_validate({**config.model_dump(), **reset, "train_config": train_config})
    except ValidationError as exc:  # e.g. train_config grown past its length: name what was carried into it
        names = ", ".join(name for name, _ in carried.values())
        raise SettingsError(
            f"{names}: carried into train_config for the table classifier, they make it invalid "
            f"({exc.errors()[0]['msg']}); give the table classifier's settings in train_config instead"
        ) from None
