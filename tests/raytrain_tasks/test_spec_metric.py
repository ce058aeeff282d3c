"""A TrainSpec's metric is checked against what its loss and metrics give, on the first batch, before training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from raytrain_tasks.api import Metric, Splits, TrainSpec
from raytrain_tasks.errors import UserCodeError
from raytrain_tasks.spec_loop import check_metric_named


def _spec(metric: Any) -> TrainSpec:
    rows = TensorDataset(torch.zeros(4, 1), torch.zeros(4, 1))
    return TrainSpec(
        data=lambda config: Splits(rows, rows, rows),
        model=lambda config, example: torch.nn.Linear(1, 1),
        loss=torch.nn.functional.mse_loss,
        metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
        metric=metric,
    )


@pytest.mark.parametrize(
    ("metric", "says"),
    [
        (
            Metric("MAE", higher_is_better=False),
            r"TrainSpec\(metric='MAE'\) .* \['loss', 'mae'\] \(did you mean 'mae'\?\)",
        ),
        (Metric("maee", higher_is_better=False), r"did you mean 'mae'\?"),
        (lambda config: Metric(config["by"], higher_is_better=True), r"TrainSpec\(metric='f1'\) names no metric"),
        (Metric("mae", higher_is_better=False), ""),
        (Metric("loss", higher_is_better=False), ""),
    ],
)
def test_a_metric_the_spec_does_not_compute_is_named_with_what_it_does(metric: Any, says: str) -> None:
    spec = _spec(metric)
    if not says:
        check_metric_named(spec, {"by": "f1"}, ["loss", "mae"])
        return
    with pytest.raises(UserCodeError, match=says):
        check_metric_named(spec, {"by": "f1"}, ["loss", "mae"])
    check_metric_named(spec, {"by": "f1"}, None)  # a rank with no validation batch has nothing to check
