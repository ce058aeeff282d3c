"""A user's TrainSpec for the long-run tests (tests/raytrain_tasks/test_long_runs_fit.py): a small MLP with dropout,
so that a resume that did not restore the RNG would end elsewhere, on synthetic rows. Its model fails once, at the
training step `fail_at_step` of rank 0 (counted in the worker process: after a restart it starts again from 0),
as a worker that dies within an epoch would; `marker` is the file that says it has failed. With `pause_at_step`
instead, rank 0 writes `marker` in that step and waits until the test removes it: a signal sent meanwhile arrives
within a known step. `hold_at_step` pauses rank 0 once more, in that step, until the test removes `marker` with the
suffix ".held": what happened in between stays the run's newest state."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Subset, TensorDataset

from raytrain_tasks.api import Metric, Splits, TrainSpec

ROWS = 1200


def data(config: dict[str, Any]) -> Splits:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(ROWS, 8, generator=generator)
    targets = (inputs @ torch.randn(8, 3, generator=generator)).argmax(dim=1)
    rows = TensorDataset(inputs, targets)
    return Splits(Subset(rows, range(800)), Subset(rows, range(800, 1000)), Subset(rows, range(1000, ROWS)))


class Net(nn.Module):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
        self.fail_at_step, self.pause_at_step = int(config["fail_at_step"]), int(config["pause_at_step"])
        self.hold_at_step = int(config["hold_at_step"])
        self.marker, self.steps = Path(str(config["marker"])), 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training and (self.fail_at_step or self.pause_at_step or self.hold_at_step):
            self.steps += 1
            if self.steps == self.fail_at_step and _rank() == 0 and not self.marker.exists():
                self.marker.write_text(str(self.steps))
                raise RuntimeError(f"failed at training step {self.steps}, as a worker that dies would")
            if self.steps == self.pause_at_step and _rank() == 0:
                _pause(self.steps, self.marker)
            if self.steps == self.hold_at_step and _rank() == 0:
                _pause(self.steps, self.marker.with_suffix(".held"))
        return self.layers(inputs)


def _pause(step: int, marker: Path) -> None:
    """Write ``marker`` and wait until the test removes it (at most 120 s); once in the run, not again after a
    restart of its worker group."""
    if marker.with_suffix(marker.suffix + ".done").exists():
        return
    marker.with_suffix(marker.suffix + ".done").write_text(str(step))
    marker.write_text(str(step))
    deadline = time.monotonic() + 120
    while marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _rank() -> int:
    import ray.train

    return ray.train.get_context().get_world_rank()


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (outputs.argmax(dim=1) == targets).float().mean()}


training = TrainSpec(
    data=data,
    model=lambda config, example: Net(config),
    loss=nn.functional.cross_entropy,
    metrics=accuracy,
    metric=Metric("accuracy", higher_is_better=True),
    defaults={"fail_at_step": 0, "pause_at_step": 0, "hold_at_step": 0, "marker": ""},
)
