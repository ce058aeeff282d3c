"""The table classifier's evaluation files: confusion matrix, per-class report, data summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from raytrain_tasks.reports import figure_of, save_figure
from raytrain_tasks.table_classifier.data import DatasetRef


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


def plot_confusion_matrix(matrix: list[list[int]], class_labels: tuple[str, ...], path: Path) -> None:
    size = max(4.0, 0.5 * len(class_labels) + 2)
    figure, (axis,) = figure_of(ncols=1, size=(size, size))
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
    save_figure(figure, path)
