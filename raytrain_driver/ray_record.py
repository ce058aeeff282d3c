"""Ray Train's record of a run's checkpoints (``checkpoint_manager_snapshot.json``, beside them in the run's folder),
checked before Ray Train reads it: a writer of storage alone must not make Ray Train load or delete a folder outside
the run."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from raytrain_driver.fit_steps import CHECKPOINT_NAMES, RAY_CHECKPOINT_RECORD, is_checkpoint_folder
from raytrain_tasks.errors import CheckpointError, UnsafeCheckpointError
from raytrain_tasks.storage.locations import StorageLocation

# The fields of Ray Train's record of a run (checkpoint_manager_snapshot.json) that name checkpoint folders, as Ray
# Train 2.60 writes it (ray/train/v2/_internal/execution/checkpoint/checkpoint_manager.py, _CheckpointManagerState):
# entries holding a checkpoint_dir_name, and lists of names. test_ray_record fails when Ray adds another.
RECORD_ENTRY_FIELDS = ("checkpoint_results", "latest_checkpoint_result", "pending_training_results")
RECORD_NAME_FIELDS = (
    "validated_checkpoint_dir_names",
    "timed_out_validation_checkpoint_dir_names",
    "failed_validation_checkpoint_dir_names",
)


def refuse_unsafe_record(run_key: str, run_dir: StorageLocation) -> None:
    """UnsafeCheckpointError unless every folder Ray Train's record of the run names is one of the run's checkpoint
    folders, by its plain name, there now; CheckpointError when the record cannot be read. Called before Ray Train
    reads it: Ray joins each name to the run's path as given (an absolute path or `..` leaves the run) and deletes
    what an entry names when it evicts it (test_ray_record)."""
    record = run_dir.child(RAY_CHECKPOINT_RECORD)
    if not record.exists():
        return
    where = f"Ray Train's checkpoint record of run {run_key} ({RAY_CHECKPOINT_RECORD} in {run_dir.uri})"
    try:
        names = _named_folders(json.loads(record.read_text()))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}): cut short by a crash while Ray Train wrote it, "
            "or changed since. No worker was started; check who can write `storage_path`, then start a new run "
            "(without `resume`)"
        ) from exc
    present = set(run_dir.list_names())
    refused = [
        f"{name!r} ({why})" for name in dict.fromkeys(names) if (why := _not_ours(name, present, is_checkpoint_folder))
    ]
    if refused:
        raise UnsafeCheckpointError(
            f"{where} names {'; '.join(refused)}. This pipeline's checkpoints are {CHECKPOINT_NAMES}, each a folder "
            "directly inside the run's: someone or something changed the run's storage, and Ray Train would load "
            "or delete what such an entry names. No worker was started; check who can write `storage_path`, then "
            "start a new run (without `resume`)"
        )


def recorded_folders(run_dir: StorageLocation) -> frozenset[str]:
    """The folder names Ray Train's record of the run names (none without a record); OSError, ValueError,
    TypeError, KeyError or AttributeError when it cannot be read."""
    record = run_dir.child(RAY_CHECKPOINT_RECORD)
    if not record.exists():
        return frozenset()
    return frozenset(name for name in _named_folders(json.loads(record.read_text())) if isinstance(name, str))


def _named_folders(state: dict[str, Any]) -> list[Any]:
    """Every folder name in Ray Train's record ``state``, as written (each field may be absent: older Rays)."""
    entries: list[Any] = []
    for field in RECORD_ENTRY_FIELDS:
        value = state.get(field)
        entries += value if isinstance(value, list) else [] if value is None else [value]
    names = [entry["checkpoint_dir_name"] for entry in entries]
    for field in RECORD_NAME_FIELDS:
        names += state.get(field) or []
    return names


def _not_ours(name: Any, present: set[str], ours: Callable[[str], bool]) -> str:
    """Why ``name`` is not one of the run's checkpoint folders ("" when it is)."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        return "not a folder name inside the run"
    if not ours(name):
        return "a name this pipeline never writes"
    return "" if name in present else "not in the run's folder (deleted since Ray Train committed it?)"
