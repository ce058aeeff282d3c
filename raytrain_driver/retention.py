"""Which checkpoints a fit deletes: Ray Train's rule, except the one the fit resumed from.

Ray Train keeps the best ``checkpoints_to_keep`` by the code's metric, the newest, and any awaiting validation. A
fit may resume from another one: a checkpoint within an epoch (it ranks last), or an older one than Ray's newest
(a newer one failed verification). That one stays for as long as the fit runs, so the fit can always go back to it.

This module is the one door to what it changes of Ray Train 2.60.0 (read from
ray/train/v2/_internal/execution/controller/controller.py and checkpoint/checkpoint_manager.py): the
TrainController builds its CheckpointManager inline, and deletes in ``_save_state_and_delete_old_checkpoints``.
Ray Train has no public alternative yet (``CheckpointConfig`` takes only a count and a score): switch to one when
it lets a run keep a checkpoint of its choosing. tests/raytrain_driver/test_retention.py fails if the shape changes.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import Any, TypeVar, cast

from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.storage import delete_fs_path

from raytrain_tasks.tracking.names import checkpoint_name

T = TypeVar("T", bound=Hashable)

# The key of the fit's train_loop_config that names the checkpoint its workers start from
# (fit_steps.trainer_function): what the workers are handed is what retention keeps.
START_KEY = "start"


def checkpoints_to_delete(
    ranked: Sequence[T], num_to_keep: int | None, latest: T | None, pending: Collection[T], protected: Collection[T]
) -> frozenset[T]:
    """Of Ray Train's kept checkpoints (``ranked``: worst first), those beyond the best ``num_to_keep`` (None: keep
    all), except the latest, those awaiting validation and the ``protected`` ones."""
    if num_to_keep is None:
        return frozenset()
    spared = {*pending, *protected, *([latest] if latest is not None else [])}
    return frozenset(result for result in ranked[:-num_to_keep] if result not in spared)


class _KeepsResumedCheckpoint(CheckpointManager):  # type: ignore[misc]  # Ray's private class
    """Ray Train's CheckpointManager, deleting as ``checkpoints_to_delete`` says."""

    resumed_from: str | None = None

    def _save_state_and_delete_old_checkpoints(self) -> None:
        # Ray's own method, with its choice made by checkpoints_to_delete: the bookkeeping is the same, and the
        # record is written before anything is deleted.
        doomed = checkpoints_to_delete(
            self._checkpoint_results,
            self._checkpoint_config.num_to_keep,
            self._latest_checkpoint_result,
            [result for result, _ in self._pending_training_results.values()],
            [
                result
                for result in self._checkpoint_results
                if result.checkpoint is not None and checkpoint_name(result.checkpoint.path) == self.resumed_from
            ],
        )
        self._checkpoint_results = [result for result in self._checkpoint_results if result not in doomed]
        for result in doomed:
            del self._checkpoint_to_report_index[result.checkpoint]
            for statuses in (
                self._validated_checkpoints,
                self._timed_out_validation_checkpoints,
                self._failed_validation_checkpoints,
            ):
                statuses.discard(result.checkpoint)
        self._write_state_to_storage()
        for checkpoint in (result.checkpoint for result in doomed):
            if checkpoint is not None:  # every result Ray Train keeps holds one
                delete_fs_path(fs=checkpoint.filesystem, fs_path=checkpoint.path)


def keep_resumed_checkpoint(manager: Any, resumed_from: str | None) -> None:
    """Make Ray Train's ``manager`` never delete checkpoint folder ``resumed_from``; everything else as before.

    The controller has handed ``manager`` to its report handler and worker group callbacks already, so its class
    changes in place; the subclass adds no state of its own beyond ``resumed_from``."""
    if type(manager) is not CheckpointManager:
        raise TypeError(
            f"Ray Train's controller built a {type(manager).__qualname__}, not the CheckpointManager of Ray 2.60.0 "
            "that raytrain_driver.retention was written against; re-read it and update the module"
        )
    manager.__class__ = _KeepsResumedCheckpoint
    cast(_KeepsResumedCheckpoint, manager).resumed_from = resumed_from


class KeepResumedController(TrainController):  # type: ignore[misc]  # Ray's private class
    """Ray Train's TrainController, whose retention keeps the checkpoint the fit's workers start from."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        loop_config = self._train_run_context.train_loop_config or {}
        keep_resumed_checkpoint(self._checkpoint_manager, loop_config.get(START_KEY))
