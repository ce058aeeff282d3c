"""Named datasets: the one place to plug in your own source.

A loader returns the raw table (feature columns plus the label column). Splitting, standardising and
versioning happen in ``tables.py`` beside it; files (``.csv``/``.parquet``) need no loader here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

SUPPORTED_FILE_SUFFIXES = (".csv", ".parquet", ".pq")


def dataset_stem(dataset: str) -> str:
    """A registered-model name part from ``dataset``: 'synthetic', or its file's name without the extension."""
    stem = PurePosixPath(dataset.rstrip("/").split("://", 1)[-1]).name.split(".")[0]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._") or "dataset"


@dataclass(frozen=True)
class DatasetRequest:
    """What a loader may use from the config."""

    label_column: str
    samples: int
    features: int
    seed: int


def load_digits(request: DatasetRequest) -> pd.DataFrame:
    """scikit-learn's bundled 8x8 digits: 1797 rows, 64 pixel features, 10 classes; no download."""
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits(as_frame=True)
    frame = bunch.frame.rename(columns={"target": request.label_column})
    return frame


def make_synthetic(request: DatasetRequest) -> pd.DataFrame:
    """A reproducible 4-class problem of any size, for scaling and benchmark runs."""
    import pandas as pd
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=request.samples,
        n_features=request.features,
        n_informative=max(2, request.features // 2),
        n_redundant=0,
        n_classes=4,
        n_clusters_per_class=1,
        class_sep=1.5,
        random_state=request.seed,
    )
    frame = pd.DataFrame(x.astype("float32"), columns=[f"x{i}" for i in range(request.features)])
    frame[request.label_column] = y
    return frame


BUILTIN_DATASETS: dict[str, Callable[[DatasetRequest], pd.DataFrame]] = {
    "digits": load_digits,
    "synthetic": make_synthetic,
}


def checked_dataset(value: str) -> str:
    """``value`` if it names a bundled dataset or a table file; ValueError saying what is accepted otherwise."""
    if value in BUILTIN_DATASETS or value.lower().endswith(SUPPORTED_FILE_SUFFIXES):
        return value
    from raytrain_tasks.redact import redact

    raise ValueError(
        f"unknown dataset {redact(value)!r}: use one of {sorted(BUILTIN_DATASETS)} "
        f"or a path/URI ending in {', '.join(SUPPORTED_FILE_SUFFIXES)}"
    )


def check_held_out_share(val_fraction: float, test_fraction: float) -> None:
    """ValueError unless the validation and test splits leave at least 10% of the rows for training."""
    if val_fraction + test_fraction >= 0.9:
        raise ValueError(
            f"val_fraction ({val_fraction}) + test_fraction ({test_fraction}) must leave at least 10% "
            "of the rows for training"
        )
