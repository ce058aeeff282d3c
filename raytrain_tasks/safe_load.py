"""Loading a registered model without unpickling anything: MLflow 3.17 unpickles ``data/model.pth`` whenever it is
there (MLFLOW_ALLOW_PICKLE_DESERIALIZATION defaults to true), even beside a ``pt2`` archive. The driver checks a
model's files first (raytrain_driver.champion.check_model_layout); every load of them, on the driver or in a
scoring actor, runs with pickles off."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def pickle_deserialization_off() -> Iterator[None]:
    """MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false for the block (MLflow reads it at each load), restored after."""
    from mlflow.environment_variables import MLFLOW_ALLOW_PICKLE_DESERIALIZATION

    name = MLFLOW_ALLOW_PICKLE_DESERIALIZATION.name
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
