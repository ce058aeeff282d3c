"""Which checkpoint a restarted worker group resumes from: the newest one that is intact.

Ray Train hands workers its latest registered checkpoint. If that one fails verification (a truncated or
corrupted file in storage), older checkpoints of the same run are tried, newest first. Nothing is deleted:
the bad checkpoint stays where it is for Ray Train's own bookkeeping and for inspection.

A checkpoint that existed before this fit started must also still be the one that was committed: its
manifest must hash to the digest MLflow recorded when the epoch was reported. A folder with no recorded
digest (written by someone else, or while MLflow was down) is passed over like a corrupted one; a folder
whose digest differs was replaced, and the resume stops (UnsafeCheckpointError).
"""

from __future__ import annotations

import logging
import posixpath
from dataclasses import dataclass, field

import pyarrow.fs as pafs
from ray.train import Checkpoint

from raytrain_tasks.checkpoint import LoadedCheckpoint, load_checkpoint, manifest_digest
from raytrain_tasks.errors import CheckpointError, UnsafeCheckpointError
from raytrain_tasks.tracking.controller import CHECKPOINT_PREFIX, EPOCH_FOLDER, checkpoint_order, epoch_number

logger = logging.getLogger(__name__)


def checkpoint_dir_name(epoch: int, taken: frozenset[str] = frozenset()) -> str:
    """``epoch-NNNN`` for the epoch of index ``epoch`` (NNNN is its number: ``epoch-0001`` is the first), or
    ``epoch-NNNN-rK`` when an earlier attempt left a folder of that name.

    An epoch re-trained after a fallback to an older checkpoint must not reuse the folder of the checkpoint it
    replaces: Ray Train would later evict the old entry and delete the folder, taking the new one with it.
    """
    base = f"{CHECKPOINT_PREFIX}{epoch_number(epoch):04d}"
    if base not in taken:
        return base
    attempt = 1
    while f"{base}-r{attempt}" in taken:
        attempt += 1
    return f"{base}-r{attempt}"


def existing_checkpoint_names(latest: Checkpoint) -> frozenset[str]:
    """The checkpoint folders in ``latest``'s run folder."""
    filesystem = latest.filesystem
    assert filesystem is not None
    run_dir = posixpath.dirname(latest.path.rstrip("/"))
    return frozenset(
        info.base_name
        for info in filesystem.get_file_info(pafs.FileSelector(run_dir))
        if info.type == pafs.FileType.Directory and info.base_name.startswith(CHECKPOINT_PREFIX)
    )


def resume_order(latest: str, siblings: list[str]) -> list[str]:
    """``latest`` first, then the run's older checkpoint folders, newest first (compared as numbers). A ``latest``
    this project did not name (Ray Train's snapshot pointed elsewhere) has no place among them: every one follows
    it, each checked against its recorded digest like any other."""
    ours = [n for n in siblings if EPOCH_FOLDER.fullmatch(n) and n != latest]
    if EPOCH_FOLDER.fullmatch(latest):
        ours = [n for n in ours if checkpoint_order(n) < checkpoint_order(latest)]
    return [latest, *sorted(ours, key=checkpoint_order, reverse=True)]


@dataclass(frozen=True)
class CheckpointPins:
    """What the driver knew when the fit started: the run's checkpoint folders then, and their recorded digests."""

    preexisting: frozenset[str] = frozenset()
    pinned: dict[str, str] = field(default_factory=dict)

    def check(self, name: str, directory: str) -> None:
        """Raise unless folder ``name`` (downloaded to ``directory``) is the checkpoint that was committed."""
        if name not in self.preexisting:
            return  # committed by this fit's own workers since it started
        expected = self.pinned.get(name)
        if expected is None:
            raise CheckpointError(
                f"checkpoint {name} has no manifest digest recorded in the MLflow run (written by an earlier version "
                "of prefect-raytrain, by someone else, or while MLflow was unreachable), so it cannot be trusted"
            )
        actual = manifest_digest(directory)
        if actual != expected:
            raise UnsafeCheckpointError(
                f"checkpoint {name} is not the one this run committed: its manifest hashes to {actual[:12]}..., the "
                f"MLflow run recorded {expected[:12]}.... Someone or something replaced it in storage; check who can "
                "write `storage_path`, then start a new run (without `resume`) or restore the checkpoint from a backup"
            )


def load_newest_intact(
    latest: Checkpoint, *, announce: bool, pins: CheckpointPins | None = None
) -> tuple[LoadedCheckpoint, Checkpoint]:
    """Load ``latest``, or the newest older checkpoint of its run that verifies; CheckpointError if none."""
    pins = pins or CheckpointPins()
    filesystem = latest.filesystem
    assert filesystem is not None  # Ray Train attaches the run's storage filesystem to every checkpoint
    run_dir, latest_name = posixpath.split(latest.path.rstrip("/"))
    siblings = [
        info.base_name
        for info in filesystem.get_file_info(pafs.FileSelector(run_dir))
        if info.type == pafs.FileType.Directory
    ]
    problems = []
    for name in resume_order(latest_name, siblings):
        candidate = latest if name == latest_name else Checkpoint(posixpath.join(run_dir, name), filesystem)
        try:
            with candidate.as_directory() as directory:
                pins.check(name, directory)
                loaded = load_checkpoint(directory)
        except UnsafeCheckpointError:
            raise  # tampered storage: falling back to an older checkpoint of the same storage is not safe
        except CheckpointError as exc:
            problems.append(str(exc))
            if announce:
                logger.warning("not resuming from %s: %s", name, exc)
            continue
        if announce and name != latest_name:
            logger.warning(
                "falling back to the last intact checkpoint %s (epoch %d)", name, epoch_number(loaded.state.epoch)
            )
        return loaded, candidate
    raise CheckpointError(
        f"no intact checkpoint left in {run_dir}: {'; '.join(problems)}. Start a new run (without `resume`), "
        "or restore the checkpoint files from a backup"
    )
