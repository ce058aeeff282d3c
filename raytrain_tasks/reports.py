"""What a person looks at in the MLflow UI for every run: its learning curves."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_tasks.tracking.names import epoch_number

if TYPE_CHECKING:
    from mlflow import MlflowClient

EVALUATION_ARTIFACT_DIR = "evaluation"  # the MLflow run's folder of plots and reports (tasks/run_page links it)
LEARNING_CURVES_FILE = "learning_curves.png"


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
    figure, axes = figure_of(ncols=len(panels), size=(5 * len(panels), 4))
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
    save_figure(figure, path)


def figure_of(ncols: int, size: tuple[float, float]) -> tuple[Any, list[Any]]:
    """A headless matplotlib figure of ``ncols`` panels side by side."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on workers, CI or Prefect agents
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, ncols, figsize=size, squeeze=False)
    return figure, list(axes[0])


def save_figure(figure: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
