"""What long runs decide: when a TrainSpec checkpoints within an epoch, how long a collective may wait for a silent
rank, and which of these settings a run's code, data or recorded steps cannot honour. Plain functions of plain
values: no Ray, no torch, so each rule is tested as a table (tests/raytrain_tasks/test_long_runs.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# How long a gradient all-reduce or barrier waits for a rank that makes no progress, when `hang_timeout_s` is 0.
# torch's own default is 30 minutes on every backend. On CPUs a step rarely takes a minute; on GPUs the first step
# may compile kernels or load a large model for many minutes, so the bound is wider there.
HANG_TIMEOUT_DEFAULT_S = {"cpu": 600.0, "gpu": 1800.0}
# Below this, a slow storage call or a garbage collection pause would look like a hang.
MIN_HANG_TIMEOUT_S = 30.0


def hang_timeout_s(setting: float, use_gpu: bool) -> float:
    """The seconds a collective waits before it fails: the setting, or the default for the device when it is 0."""
    if setting:
        return float(setting)
    return HANG_TIMEOUT_DEFAULT_S["gpu" if use_gpu else "cpu"]


def hang_timeout_refusal(setting: float) -> str | None:
    """Why `hang_timeout_s` cannot be used; None when it can."""
    if setting and setting < MIN_HANG_TIMEOUT_S:
        return (
            f"hang_timeout_s={setting:g} is shorter than {MIN_HANG_TIMEOUT_S:g} s: a storage call or a pause of the "
            "garbage collector would then count as a hang. Give at least 30, or 0 for the default (600 s on CPUs, "
            "1800 s on GPUs)"
        )
    return None


# A collective fails a rank that waits there longer than the hang timeout for its peers. A rank may arrive a whole
# step after them (a slower batch, rank 0 saving a checkpoint, a busier node), and steps vary with the data and the
# machine: the timeout must hold that lagging step and as much again of noise, on top of the step itself.
STEP_TIME_MARGIN = 3.0


@dataclass(frozen=True)
class RecordedEpoch:
    """An epoch a run logged: its number (from 1), its seconds, and the training steps it took (None: unknown)."""

    number: int
    seconds: float
    steps: int | None = None

    @property
    def step_seconds(self) -> float | None:
        """Its seconds per step. Scoring and the epoch's figures count in its seconds: a step's time errs long."""
        return self.seconds / self.steps if self.steps else None


def recorded_epochs(logged: Sequence[tuple[int, float, int | None]]) -> list[RecordedEpoch]:
    """The epochs of a run's history, from what each epoch's report logged, oldest first: (its number, its seconds,
    the global step at its end or None). Its steps are that global step less the previous epoch's (0 before the
    first); unknown where either is, or where the count did not grow (code that counts each epoch from 0)."""
    ends = {number: end for number, _, end in logged if end is not None}  # a retrained epoch: its latest end
    epochs = []
    for number, seconds, end in logged:
        before = 0 if number == 1 else ends.get(number - 1)
        steps = end - before if end is not None and before is not None and end > before else None
        epochs.append(RecordedEpoch(number, seconds, steps))
    return epochs


def step_time_refusal(setting: float, use_gpu: bool, epochs: Sequence[RecordedEpoch], run: str) -> str | None:
    """Why `hang_timeout_s` (``setting``; 0: the device's default) is too short for the steps that ``run`` took in
    its recorded ``epochs``: under STEP_TIME_MARGIN times the slowest. None when it is not, or when no epoch says
    how many steps it took."""
    # An epoch without a step count says nothing: one collective's wait cannot be set against a whole epoch. Passing
    # it fails open only to the setting's own floor (MIN_HANG_TIMEOUT_S), which the config holds to already.
    timed = [(step_s, epoch) for epoch in epochs if (step_s := epoch.step_seconds) is not None]
    if not timed:
        return None
    step_s, slowest = max(timed, key=lambda pair: pair[0])
    timeout, needed = hang_timeout_s(setting, use_gpu), STEP_TIME_MARGIN * step_s
    if timeout >= needed:
        return None
    device = "GPUs" if use_gpu else "CPUs"
    given = f"hang_timeout_s={setting:g}" if setting else f"hang_timeout_s=0 (the default, {timeout:g} s on {device})"
    return (
        f"{given} is shorter than {STEP_TIME_MARGIN:g} steps of this run: {run} took {step_s:.1f} s per step in "
        f"epoch {slowest.number} ({slowest.seconds:.1f} s over {slowest.steps} steps), and a rank may reach a "
        "collective a whole step after the others, which would then fail as a hang. Give hang_timeout_s "
        f"{math.ceil(needed)} or more"
    )


@dataclass(frozen=True)
class StepCheckpoints:
    """When a TrainSpec's loop checkpoints within an epoch: every `every_steps` training steps, or at the first step
    once `every_minutes` have passed since the last checkpoint (0: that trigger is off)."""

    every_steps: int = 0
    every_minutes: float = 0.0

    @property
    def on(self) -> bool:
        return self.every_steps > 0 or self.every_minutes > 0

    @property
    def timed(self) -> bool:
        """Whether ranks must agree on when: each rank's clock says something else, its step count does not."""
        return self.every_minutes > 0

    def due(self, steps_since: int, seconds_since: float) -> bool:
        """Whether a checkpoint is due, `steps_since` steps and `seconds_since` seconds after the last one."""
        if self.every_steps and steps_since >= self.every_steps:
            return True
        return bool(self.every_minutes) and seconds_since >= self.every_minutes * 60.0


def checkpoint_within_epoch(due: bool, epoch_step: int, steps_in_epoch: int | None) -> bool:
    """Whether step `epoch_step` (from 1) of an epoch of `steps_in_epoch` steps (None: unknown) commits a checkpoint
    of its own. Never its last step: the epoch's own checkpoint follows it at once, with the epoch's scores."""
    return due and (steps_in_epoch is None or epoch_step < steps_in_epoch)


def step_checkpoint_refusal(checkpoints: StepCheckpoints, spec_loop: bool, ray_data: bool) -> str | None:
    """Why the run's code or data cannot checkpoint within an epoch; None when they can, or when it is not asked."""
    if not checkpoints.on:
        return None
    asked = (
        f"checkpoint_every_steps={checkpoints.every_steps} (--checkpoint-every-steps)"
        if checkpoints.every_steps
        else f"checkpoint_every_minutes={checkpoints.every_minutes:g} (--checkpoint-every-minutes)"
    )
    if not spec_loop:
        return (
            f"{asked} applies to a TrainSpec, whose loop the pipeline runs. A TrainFunc's train_func checkpoints "
            "where it calls ray.train.report(..., checkpoint=...): report within the epoch there, with each rank's "
            "loader position in the checkpoint (docs/long-runs.md), and set it back to 0"
        )
    if ray_data:
        return (
            f"{asked}: this TrainSpec's data are Ray Datasets, and Ray Data's iterator cannot start again where it "
            "stopped (ray-project/ray#37633), so a resume could not continue from that step exactly. Give torch "
            "Datasets, or set it back to 0 (checkpoints at epoch ends)"
        )
    return None


# A rank whose answer to Ray Train's poll (every 0.1 s) has been outstanding this long when its group fails was
# silent: frozen, or stuck outside Python. A busy rank answers between steps.
SILENT_AFTER_S = 5.0


def silent_ranks(outstanding: dict[int, float], now: float, quiet_s: float = SILENT_AFTER_S) -> list[tuple[int, float]]:
    """(rank, seconds silent) of the ranks whose poll, outstanding since ``outstanding[rank]``, has had no answer
    for ``quiet_s`` or more at ``now``; the longest silent first."""
    silent = [(rank, now - since) for rank, since in outstanding.items() if now - since >= quiet_s]
    return sorted(silent, key=lambda pair: (-pair[1], pair[0]))
