"""What a person looks at in the MLflow UI: learning curves, confusion matrix, per-class report, data summary."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raytrain_tasks.data import DatasetRef
from raytrain_tasks.tracking.names import epoch_number

if TYPE_CHECKING:
    from mlflow import MlflowClient

EVALUATION_ARTIFACT_DIR = "evaluation"  # the MLflow run's folder of plots and reports (tasks/run_page links it)
LEARNING_CURVES_FILE = "learning_curves.png"


def evaluation_report(logits: np.ndarray, labels: np.ndarray, class_labels: tuple[str, ...]) -> dict[str, Any]:
    """Accuracy, confusion matrix and per-class precision/recall/F1 on the validation split."""
    from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

    predicted = logits.argmax(axis=1)
    indices = list(range(len(class_labels)))
    matrix = confusion_matrix(labels, predicted, labels=indices)
    precision, recall, f1, support = precision_recall_fscore_support(labels, predicted, labels=indices, zero_division=0)
    return {
        "accuracy": float((predicted == labels).mean()),
        "confusion_matrix": matrix.tolist(),
        "per_class": {
            class_labels[i]: {
                "precision": float(precision[i]),
                "recall": float(recall[i]),
                "f1": float(f1[i]),
                "support": int(support[i]),
            }
            for i in indices
        },
    }


def dataset_summary(dataset: DatasetRef, train_labels: np.ndarray, val_labels: np.ndarray) -> dict[str, Any]:
    def balance(labels: np.ndarray) -> dict[str, int]:
        counts = np.bincount(labels, minlength=dataset.num_classes)
        return {dataset.class_labels[i]: int(c) for i, c in enumerate(counts)}

    return {
        "source": dataset.source,
        "uri": dataset.uri,
        "content_hash": dataset.content_hash,
        "rows": {"train": dataset.train_rows, "val": dataset.val_rows, "test": dataset.test_rows},
        "split_rule": dataset.split_rule,
        "features": len(dataset.feature_names),
        "feature_names": list(dataset.feature_names),
        "label_column": dataset.label_column,
        "class_balance": {"train": balance(train_labels), "val": balance(val_labels)},
    }


NOT_CURVES = frozenset({"epoch", "epoch_seconds", "samples_per_second", "workers"})
SPLIT_PREFIXES = (("train_", "train"), ("val_", "validation"), ("test_", "test"))
MAX_PANELS = 6


def curve_panels(history: list[dict[str, float]]) -> dict[str, dict[str, str]]:
    """The learning curves of a run's history, one panel per measure: ``{measure: {key: label}}``. A measure's
    train_/val_/test_ keys share its panel (``train_loss`` and ``val_loss`` in "loss"); a key without such a prefix
    names its measure (``accuracy``; ``loss`` joins the "loss" panel). Losses first; at most ``MAX_PANELS``."""
    panels: dict[str, dict[str, str]] = {}
    keys = dict.fromkeys(key for entry in history for key in entry if key not in NOT_CURVES)
    for key in keys:
        measure, label = next(
            ((key.removeprefix(prefix), name) for prefix, name in SPLIT_PREFIXES if key.startswith(prefix)), (key, key)
        )
        panels.setdefault(measure, {})[key] = label
    ordered = sorted(panels, key=lambda measure: "loss" not in measure)  # stable: the report's order otherwise
    return {measure: panels[measure] for measure in ordered[:MAX_PANELS]}


def log_learning_curves(client: MlflowClient, run_id: str, history: list[dict[str, float]]) -> None:
    """The run's learning curves as ``evaluation/learning_curves.png`` in its MLflow run (a retry replaces it)."""
    with tempfile.TemporaryDirectory(prefix="prt-curves-") as tmp:
        path = Path(tmp) / LEARNING_CURVES_FILE
        plot_learning_curves(history, path)
        client.log_artifact(run_id, str(path), artifact_path=EVALUATION_ARTIFACT_DIR)


def plot_learning_curves(history: list[dict[str, float]], path: Path) -> None:
    """Every measure the run reported per epoch (``curve_panels``), against the epoch number."""
    from matplotlib.ticker import MaxNLocator

    panels = curve_panels(history) or {"no metric reported": {}}
    figure, axes = _figure(ncols=len(panels), size=(5 * len(panels), 4))
    epochs = [epoch_number(entry["epoch"]) for entry in history]
    for axis, (measure, series) in zip(axes, panels.items(), strict=True):
        for key, label in series.items():
            points = [(epoch, entry[key]) for epoch, entry in zip(epochs, history, strict=True) if key in entry]
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        axis.set(title=measure, xlabel="epoch")
        if len(series) > 1:
            axis.legend()
        axis.grid(alpha=0.3)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs, however many
    _save(figure, path)


def plot_confusion_matrix(matrix: list[list[int]], class_labels: tuple[str, ...], path: Path) -> None:
    size = max(4.0, 0.5 * len(class_labels) + 2)
    figure, (axis,) = _figure(ncols=1, size=(size, size))
    values = np.asarray(matrix)
    axis.imshow(values, cmap="Blues")
    ticks = range(len(class_labels))
    axis.set(xticks=ticks, yticks=ticks, xlabel="predicted", ylabel="true", title="Validation confusion matrix")
    axis.set_xticklabels(class_labels, rotation=45, ha="right")
    axis.set_yticklabels(class_labels)
    if len(class_labels) <= 30:
        threshold = values.max() / 2 if values.size else 0
        for (row, col), count in np.ndenumerate(values):
            axis.text(col, row, str(count), ha="center", va="center", color="white" if count > threshold else "black")
    _save(figure, path)


def _figure(ncols: int, size: tuple[float, float]) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on workers, CI or Prefect agents
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, ncols, figsize=size, squeeze=False)
    return figure, list(axes[0])


def _save(figure: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
