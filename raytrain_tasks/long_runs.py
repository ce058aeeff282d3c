"""What long runs decide: when a TrainSpec checkpoints within an epoch, how long a collective may wait for a silent
rank, and which of these settings a run's code and data cannot honour. Plain functions of plain values: no Ray, no
torch, so each rule is tested as a table (tests/raytrain_tasks/test_long_runs.py)."""

from __future__ import annotations

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
        f"checkpoint_every_steps={checkpoints.every_steps}"
        if checkpoints.every_steps
        else f"checkpoint_every_minutes={checkpoints.every_minutes:g}"
    )
    if not spec_loop:
        return (
            f"{asked} applies to a TrainSpec, whose loop the pipeline runs. A TrainFunc's train_func checkpoints "
            "where it calls ray.train.report(..., checkpoint=...): report within the epoch there, with each rank's "
            "loader position in the checkpoint (docs/long-runs.md), and set the setting back to 0"
        )
    if ray_data:
        return (
            f"{asked}: this TrainSpec's data are Ray Datasets, and Ray Data's iterator cannot start again where it "
            "stopped (ray-project/ray#37633), so a resume could not continue from that step exactly. Give torch "
            "Datasets, or set the setting back to 0 (checkpoints at epoch ends)"
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
