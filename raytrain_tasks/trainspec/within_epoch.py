"""Checkpoints a TrainSpec's loop commits within an epoch (``checkpoint_every_steps`` / ``checkpoint_every_minutes``),
and where a resume from one starts.

Such a checkpoint holds what an epoch's own does (model, optimizer, RNG) plus how far the epoch got: its steps, its
train-loss sums over every rank, and its seconds. Every rank's data position follows from the step: each rank's
share of the epoch is a fixed order of the run's seed and the epoch (``data.ResumableSampler``), so a resume
starts each rank's loader after ``step * batch_size`` of its rows, and the run goes on as if it had never stopped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raytrain_tasks.long_runs import StepCheckpoints, checkpoint_within_epoch
from raytrain_tasks.stop_requests import StopRequests, agreed
from raytrain_tasks.tracking.names import GLOBAL_STEP_KEY, IN_EPOCH_KEY, STEP_LOSS_KEY

logger = logging.getLogger(__name__)


@dataclass
class EpochSoFar:
    """How far an epoch got when a checkpoint within it was committed (``state["in_epoch"]``)."""

    steps: int
    loss_total: torch.Tensor  # float64, summed over every rank's rows
    rows: int
    seconds: float
    world: int = 1  # the workers that trained it: each rank's share of the epoch follows from it

    def as_state(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "loss_total": self.loss_total,
            "rows": self.rows,
            "seconds": self.seconds,
            "world": self.world,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochSoFar:
        steps, rows, seconds = int(state["steps"]), int(state["rows"]), float(state["seconds"])
        return cls(steps, state["loss_total"], rows, seconds, int(state.get("world", 1)))


class WithinEpoch:
    """Called after every training step of an epoch (``steps.train_epoch``'s ``after_step``): counts the steps and
    commits a checkpoint when one is due or a stop asks for one (``stop_requests``). Every rank calls it alike; on
    several workers they agree through one all-reduce per step (their clocks and signals differ, their step counts
    do not)."""

    def __init__(
        self,
        checkpoints: StepCheckpoints,
        epoch: int,
        global_step: int,
        steps_in_epoch: int | None,
        commit: Callable[[dict[str, Any], EpochSoFar], None],
        resumed: EpochSoFar | None = None,
        stops: StopRequests | None = None,
        within_ok: bool = True,
    ) -> None:
        self.checkpoints = checkpoints
        self.stops = stops if stops is not None else StopRequests()
        self.pending = StopRequests.NONE
        self.within_ok = within_ok  # whether a checkpoint within the epoch can be resumed from exactly
        self.epoch = epoch
        self.global_step = global_step
        self.steps_in_epoch = steps_in_epoch
        self.commit = commit  # writes the checkpoint (rank 0) and reports it
        self.epoch_step = resumed.steps if resumed is not None else 0
        self.seconds_before = resumed.seconds if resumed is not None else 0.0
        self.started = time.perf_counter()
        self.last_commit = (time.monotonic(), global_step)
        # Rank 0 carries every rank's sums up to a resumed checkpoint (the epoch's figure all-reduces them at its
        # end); the other ranks count from zero.
        self.start: tuple[torch.Tensor, int] = (torch.zeros((), dtype=torch.float64), 0)
        if resumed is not None and _rank() == 0:
            self.start = (resumed.loss_total.clone(), resumed.rows)

    def seconds(self) -> float:
        """The epoch's training seconds so far, across its attempts."""
        return self.seconds_before + time.perf_counter() - self.started

    def __call__(self, total: torch.Tensor, rows: int) -> None:
        self.epoch_step += 1
        self.global_step += 1
        since, steps = self.last_commit
        due = self.checkpoints.due(self.global_step - steps, time.monotonic() - since)
        request = self.stops.local() if self.within_ok else StopRequests.NONE
        if _distributed() and self.within_ok:  # every rank commits at the same step, or none does
            due, request = agreed(due, request)
        if request:
            self.stops.acted(request)
        if self.within_ok and checkpoint_within_epoch(due or bool(request), self.epoch_step, self.steps_in_epoch):
            self._commit(total, rows)
            self.stops.after_commit(request, self.global_step)  # a stop raises here
        elif request:
            self.pending = request  # the epoch's last step: its own checkpoint is the one asked for

    def after_epoch_commit(self, final: bool = False) -> None:
        """After the epoch's own checkpoint: what a stop asked for at its last step (nothing after the last epoch's:
        the run is done)."""
        request, self.pending = self.pending, StopRequests.NONE
        if not final:
            self.stops.after_commit(request, self.global_step)

    def _commit(self, total: torch.Tensor, rows: int) -> None:
        """Sum the epoch's loss so far over every rank, and commit."""
        epoch_total, epoch_rows = self._sums(total, rows)
        total_tensor = torch.tensor(epoch_total, dtype=torch.float64)
        so_far = EpochSoFar(self.epoch_step, total_tensor, int(epoch_rows), self.seconds(), _world())
        loss = epoch_total / epoch_rows if epoch_rows else math.nan
        self.commit({IN_EPOCH_KEY: self.epoch, GLOBAL_STEP_KEY: self.global_step, STEP_LOSS_KEY: loss}, so_far)
        self.last_commit = (time.monotonic(), self.global_step)

    def at_epoch_end(self) -> dict[str, float]:
        """What the epoch's own checkpoint adds to its report: the global step (its train loss is the series' point
        there)."""
        return {GLOBAL_STEP_KEY: self.global_step}

    def _sums(self, total: torch.Tensor, rows: int) -> tuple[float, float]:
        """(the epoch's loss sum so far, its rows), over every rank."""
        sums = _all_reduced(torch.tensor([float(total), float(rows)], dtype=torch.float64))
        epoch_total, epoch_rows = sums.tolist()
        return epoch_total, epoch_rows


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_reduced(sums: torch.Tensor) -> torch.Tensor:
    if not (dist.is_available() and dist.is_initialized()):
        return sums
    import ray.train.torch

    on_device = sums.to(ray.train.torch.get_device())  # NCCL reduces CUDA tensors only
    dist.all_reduce(on_device)
    return on_device.cpu()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
