"""A user's code as register-model meets it (test_registry, test_security): a plain user of the public API whose
model's first output bias is its own score, so that a test says what each fit scored and the gate, which loads the
champion and the candidate back from the registry and scores both with ``evaluate``, compares those numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from raytrain_tasks.api import Metric, TrainFunc

MODEL_FILE = "model.pt"


def _model(features: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(features, 2)


def write_checkpoint(folder: Path, features: int, score: float) -> Path:
    """A checkpoint as a fit of this code commits it: the model, whose first output bias is ``score``."""
    model = _model(features)
    with torch.no_grad():
        model.bias[0] = score
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / MODEL_FILE)
    return folder


def load_model(folder: Path, config: dict[str, Any]) -> nn.Module:
    model = _model(int(config["features"]))
    model.load_state_dict(torch.load(folder / MODEL_FILE, weights_only=True))
    return model


def evaluate(model: Any, config: dict[str, Any]) -> dict[str, float]:
    return {"test_accuracy": float(model.state_dict()["bias"][0])}


def _never_trains(config: dict[str, Any]) -> None:
    raise AssertionError("this code only registers what a test wrote")


training = TrainFunc(
    _never_trains,
    metric=Metric("val_accuracy", higher_is_better=True),
    gate_metric="test_accuracy",
    load_model=load_model,
    input_example=lambda config: torch.zeros(2, int(config["features"])),
    evaluate=evaluate,
    defaults={"features": 4},
    schema=lambda config: {"features": [f"f{i}" for i in range(int(config["features"]))]},
)
