"""A TrainSpec's metric is checked against what its loss and metrics give, on the first batch, before training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from raytrain_tasks.api import Metric, Splits, TrainSpec
from raytrain_tasks.errors import UserCodeError
from raytrain_tasks.trainspec.data import slice_batches
from raytrain_tasks.trainspec.metric_names import batch_metric_names, check_metric_named


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


def test_before_training_only_a_typo_is_refused() -> None:
    """One batch may lack a key that the whole split has (a metric of one class's rows): before training, only a
    name close to one the batch gives is refused; the rest waits for the first epoch's validation."""
    spec = _spec(Metric("f1", higher_is_better=True))
    check_metric_named(spec, {}, ["loss", "mae"], typos_only=True)  # not close to anything: judged later
    with pytest.raises(UserCodeError, match="did you mean 'mae'"):
        check_metric_named(_spec(Metric("MAE", higher_is_better=False)), {}, ["loss", "mae"], typos_only=True)


def test_the_batch_check_trains_nothing_and_draws_no_random_number() -> None:
    """The names come from the model as built, in eval mode, without a gradient or a step, and the random state
    is what it was: a run with the check follows the trajectory of one without it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    seen: list[bool] = []

    def loss(outputs: Any, targets: Any) -> Any:
        seen.append(outputs.requires_grad)
        return torch.nn.functional.mse_loss(outputs, targets)

    spec = TrainSpec(
        data=lambda config: None,  # type: ignore[arg-type,return-value]
        model=lambda config, example: model,
        loss=loss,
        metrics=lambda outputs, targets: {"mae": (outputs - targets).abs().mean()},
        metric=Metric("mae", higher_is_better=False),
    )
    rows = TensorDataset(torch.ones(5, 1), torch.zeros(5, 1))
    assert batch_metric_names(spec, model, slice_batches(rows, 0, 2, 2), torch.device("cpu")) == ["loss", "mae"]
    one_row = TensorDataset(torch.ones(1, 1), torch.ones(1, 1))
    assert batch_metric_names(spec, model, slice_batches(one_row, 1, 2, 2), "cpu") is None  # rank 1 has none
    assert seen == [False] and model.training, "no gradient; the model back in train mode"
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
