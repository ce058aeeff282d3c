"""The built-in classifier's settings, given to the table classifier (a TrainSpec) under its own names.

The table classifier (``TABLE_CLASSIFIER``) trains what the built-in classifier trains, as a plain user of the
public API: its data, model and gate settings live in ``train_config``. A run of it may still say them the way the
built-in classifier's users do (``--dataset customers.csv --promotion-metric val_loss``): each such setting, set
away from its default, is carried into ``train_config`` under the classifier's name for it, and put back to its
default, so that the run, its MLflow params and its resume know one value in one place.
"""

from __future__ import annotations

from typing import Any

from raytrain_tasks.config import BUILTIN_CLASSIFIER_ONLY, TrainingConfig
from raytrain_tasks.errors import SettingsError
from raytrain_tasks.storage.filesystem import is_s3

TABLE_CLASSIFIER = "raytrain_tasks.table_classifier:classifier"

# Built-in setting -> the table classifier's train_config key, where the names differ. `model` has no key: 'mlp',
# its one value, is the table classifier's model.
_RENAMED = {"promotion_metric": "metric"}
_NO_KEY = frozenset({"model"})
_S3_SETTINGS = ("s3_endpoint_url", "s3_region")  # the run's own S3 settings, also where an s3:// table is read


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
    dataset = carried.get("dataset", ("", config.train_config.get("dataset", "")))[1]
    if isinstance(dataset, str) and is_s3(dataset):
        for name in _S3_SETTINGS:  # how the built-in classifier reads an s3:// table; they stay set for storage
            if getattr(config, name) and name not in config.train_config:
                carried[name] = (name, getattr(config, name))
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
    reset = {name: _default(name) for name, _ in carried.values() if name not in _S3_SETTINGS}
    train_config = {**config.train_config, **{key: value for key, (_, value) in carried.items()}}
    return TrainingConfig.model_validate({**config.model_dump(), **reset, "train_config": train_config})
