"""The folder each checkpoint of a TrainSpec's loop is committed under in a run's storage."""

from __future__ import annotations

from raytrain_tasks.tracking.names import CHECKPOINT_PREFIX, STEP_MARK, epoch_number


def checkpoint_dir_name(epoch: int, taken: frozenset[str] = frozenset(), global_step: int | None = None) -> str:
    """``epoch-NNNN-step-SSSSSSSS`` for a checkpoint within the epoch, at global step ``global_step``; else
    ``epoch-NNNN`` for the epoch of index ``epoch`` (NNNN is its number: ``epoch-0001`` is the first), or
    ``epoch-NNNN-rK`` when an earlier attempt left a folder of that name.

    An epoch re-trained after a fallback to an older checkpoint must not reuse the folder of the checkpoint it
    replaces: Ray Train would later evict the old entry and delete the folder, taking the new one with it.
    """
    base = f"{CHECKPOINT_PREFIX}{epoch_number(epoch):04d}"
    if global_step is not None:
        base += f"{STEP_MARK}{global_step:08d}"
    if base not in taken:
        return base
    attempt = 1
    while f"{base}-r{attempt}" in taken:
        attempt += 1
    return f"{base}-r{attempt}"
