"""The table classifier's settings that were once the run's own, and where they live now: its ``train_config``.

A flow run stored before they moved still names them as parameters, and a resume or crash continuation rebuilds
its config from those. The CLI's ``--dataset`` and ``--label-column`` are shorthand for them. Both come through
here, so that the run, its MLflow params and its resume know each value in one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from raytrain_tasks.errors import SettingsError
from raytrain_tasks.settings import TABLE_CLASSIFIER

# The old setting -> (its key in the table classifier's train_config, its old default). `model` has no key: 'mlp',
# its one value, is the table classifier's model.
MOVED: dict[str, tuple[str, Any]] = {
    "dataset": ("dataset", "digits"),
    "label_column": ("label_column", "label"),
    "synthetic_samples": ("synthetic_samples", 4000),
    "synthetic_features": ("synthetic_features", 20),
    "val_fraction": ("val_fraction", 0.2),
    "test_fraction": ("test_fraction", 0.1),
    "split_key_column": ("split_key_column", ""),
    "data_loader": ("data_loader", "torch"),
    "model": ("", "mlp"),
    "hidden_sizes": ("hidden_sizes", [128, 64]),
    "input_example": ("input_example", "synthetic"),
    "promotion_metric": ("metric", "val_accuracy"),
}


def _as_key_value(name: str, value: Any) -> Any:
    if name == "promotion_metric":
        return str(value).removeprefix("val_")  # val_accuracy -> accuracy: it picks on val_, the gate on test_
    return list(value) if isinstance(value, tuple) else value


def carried_into_train_config(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """``parameters`` without the moved settings. For the table classifier, each one away from its old default is
    in ``train_config`` instead; other code never used them, so they are dropped.

    SettingsError where a moved setting and ``train_config`` give one key different values: which was meant
    cannot be told."""
    moved = {name: value for name, value in parameters.items() if name in MOVED}
    rest = {name: value for name, value in parameters.items() if name not in MOVED}
    if rest.get("train_code", TABLE_CLASSIFIER) != TABLE_CLASSIFIER:
        return rest
    carried = {
        MOVED[name][0]: (name, _as_key_value(name, value))
        for name, value in moved.items()
        if MOVED[name][0] and _as_key_value(name, value) != _as_key_value(name, MOVED[name][1])
    }
    return with_keys_carried(rest, carried)


def with_keys_carried(parameters: Mapping[str, Any], carried: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """``parameters`` with ``carried`` (train_config key -> (the setting or flag that gave it, its value)) added to
    their ``train_config``, an object or its JSON text. Left as they are where ``train_config`` is no JSON object:
    the config's own validation names that. SettingsError where a key is given two different values."""
    rest = dict(parameters)
    if not carried:
        return rest
    train_config = rest.get("train_config") or {}
    if isinstance(train_config, str):  # the command line's text, or a run stored while it was text
        try:
            train_config = json.loads(train_config or "{}")
        except json.JSONDecodeError:
            return rest
    if not isinstance(train_config, dict):
        return rest
    clashes = [  # named, not quoted: a value may hold credentials
        f"{name} and train_config.{key}"
        for key, (name, value) in carried.items()
        if key in train_config and train_config[key] != value
    ]
    if clashes:
        raise SettingsError(
            f"{'; '.join(clashes)} both set the table classifier's setting, to different values: give it once, in "
            "train_config"
        )
    return {**rest, "train_config": {**train_config, **{key: value for key, (_, value) in carried.items()}}}
