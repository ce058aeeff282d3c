"""The learning curves every run logs (evaluation/learning_curves.png, linked from the Prefect run page): drawn from
whatever the code reported, not only from the names the built-in classifier reports."""

from __future__ import annotations

from pathlib import Path

from raytrain_tasks.reports import curve_panels, plot_learning_curves


def test_the_learning_curves_draw_what_your_code_reported(tmp_path: Path) -> None:
    """A train_func that reports `loss` and `accuracy`, a spec that reports train_/val_/test_ measures of its own:
    each gets a picture (the run page links it for every run); one panel per measure, its splits together,
    losses first, the timing figures left out."""
    seed_shaped = [{"epoch": float(e), "loss": 1.0 / (e + 1), "accuracy": 0.5 + 0.1 * e} for e in range(3)]
    plot_learning_curves(seed_shaped, tmp_path / "seed.png")
    assert (tmp_path / "seed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(curve_panels(seed_shaped)) == ["loss", "accuracy"]

    spec = [
        {"epoch": float(e), "val_mae": 0.3, "train_loss": 1.0, "val_loss": 1.1, "test_mae": 0.4, "epoch_seconds": 2.0}
        for e in range(4)
    ]
    spec += [{"epoch": 4.0, "val_mae": 0.2, "train_loss": 0.5, "val_loss": 0.6, "samples_per_second": 900.0}]
    panels = curve_panels(spec)
    assert panels == {
        "loss": {"train_loss": "train", "val_loss": "validation"},
        "mae": {"val_mae": "validation", "test_mae": "test"},
    }, panels
    plot_learning_curves(spec, tmp_path / "spec.png")  # a key missing from an epoch is a gap in its curve
    assert (tmp_path / "spec.png").stat().st_size > 1000
