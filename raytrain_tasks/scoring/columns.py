"""Which input columns feed the model, and what the output holds: pure functions of names, types and arrays, so
each rule is a table test (tests/raytrain_tasks/test_scoring_columns.py)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raytrain_tasks.errors import ScoringInputError

PREDICTION, OUTPUT = "prediction", "output"


@dataclass(frozen=True)
class ModelInputs:
    """What a registered model takes, from its MLflow signature and metadata."""

    width: int | None  # features per row: the signature's last dimension (None: not fixed)
    dtype: str = "float32"
    feature_names: tuple[str, ...] = ()  # the input columns in order, where the model's metadata names them
    class_labels: tuple[str, ...] = ()  # what each output stands for, where the metadata names them


@dataclass(frozen=True)
class FeaturePlan:
    """The input's key column, and its columns that feed the model, in the model's order."""

    key: str
    features: tuple[str, ...]


def plan_features(columns: Sequence[str], numeric: Collection[str], key: str, inputs: ModelInputs) -> FeaturePlan:
    """The columns of an input (``numeric``: those of a number type) that feed ``inputs``; ScoringInputError, naming
    the setting to change, when they cannot: no key column, a named feature missing, another count of columns than
    the model takes, a column that is not a number."""
    shown = ", ".join(columns[:20]) + (" ..." if len(columns) > 20 else "")
    if key not in columns:
        raise ScoringInputError(f"the input has no column {key!r} (key_column); its columns: {shown}")
    if inputs.feature_names:
        missing = [name for name in inputs.feature_names if name not in columns]
        if missing:
            raise ScoringInputError(
                f"the input lacks the model's feature columns {', '.join(missing[:10])} (its metadata names "
                f"{len(inputs.feature_names)}, in order); its columns: {shown}. Check input_path and model"
            )
        features = tuple(inputs.feature_names)
    else:
        features = tuple(name for name in columns if name != key)
        if inputs.width is not None and len(features) != inputs.width:
            raise ScoringInputError(
                f"the model takes {inputs.width} features a row (its signature), and the input has {len(features)} "
                f"columns besides {key!r} (key_column): {shown}. Check input_path and model"
            )
    text = [name for name in features if name not in numeric]
    if text:
        raise ScoringInputError(
            f"the input's columns {', '.join(text[:10])} are not numbers, and the model takes {inputs.dtype} "
            "features. Check input_path"
        )
    return FeaturePlan(key, features)


def predictions(key: str, keys: Any, outputs: np.ndarray, class_labels: Sequence[str]) -> dict[str, Any]:
    """The output's columns for one batch: the key column ``key`` (``keys``); ``prediction``, the model's output
    (a number, or a row of them), or the class label of its largest output where ``class_labels`` names one per
    output, with the outputs themselves as ``output``."""
    rows = len(outputs)
    flat = outputs.reshape(rows, -1) if outputs.ndim > 1 else outputs.reshape(rows, 1)
    if flat.shape[1] == 1:
        return {key: keys, PREDICTION: flat[:, 0]}
    if len(class_labels) == flat.shape[1]:
        labels = np.asarray([str(label) for label in class_labels])
        return {key: keys, PREDICTION: labels[flat.argmax(axis=1)], OUTPUT: flat}
    return {key: keys, PREDICTION: flat}
