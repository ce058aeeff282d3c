"""The names a run's epochs and checkpoints go by in MLflow and in storage: plain values and functions, free of
Ray, so that the flow's modules read them without importing Ray Train (``raytrain_tasks.tracking.controller``,
which logs them from the Ray Train controller, imports them from here)."""

from __future__ import annotations

import re

# What every epoch of the table classifier reports (a TrainSpec's loop, with metric accuracy). ``workers``: how many
# trained the epoch (an elastic run's count changes with the cluster).
EPOCH_METRICS = ("train_loss", "val_loss", "val_accuracy", "epoch_seconds", "samples_per_second", "workers")
STEP_KEY = "val_accuracy"
LAST_CHECKPOINT_TAG = "prefect_raytrain.last_checkpoint"
# The digest of a committed checkpoint's files, as the controller hands it to log_epoch with the epoch's metrics;
# it is recorded in MLflow as PIN_TAG_PREFIX + folder name. A checkpoint is later trusted only if its files still
# hash to what was recorded: storage alone cannot vouch for itself.
MANIFEST_METRIC = "checkpoint_manifest_sha256"
PIN_TAG_PREFIX = "prefect_raytrain.checkpoint_sha256."
DATASET_DIGEST_KEY = "dataset_sha256"
DATASET_HASH_TAG = "prefect_raytrain.dataset_hash"
# A checkpoint taken within an epoch reports these (and no ``epoch``, which names a finished epoch): the epoch in
# progress (0-based, as ``epoch``), the global step, and the epoch's train loss so far, over every rank.
IN_EPOCH_KEY = "in_epoch"
GLOBAL_STEP_KEY = "global_step"
STEP_LOSS_KEY = "step_train_loss"
# In MLflow, the epoch's train loss so far by global step (its x-axis): a point at each checkpoint, within an
# epoch or at its end (the epoch's train_loss). Apart from the per-epoch metrics, whose step is the epoch number.
STEP_SERIES = "steps/train_loss"
# The step the run's newest committed checkpoint holds, "<global step>, epoch <number>": what `runs` shows.
LAST_STEP_TAG = "prefect_raytrain.last_step"
# What Ray Train keeps a run's checkpoints by, added to each checkpointed report on the worker
# (raytrain_tasks.checked_reports.ranking_score): the code's metric, higher is better, always finite.
RANK_SCORE_KEY = "checkpoint_rank_score"


def epoch_number(index: int | float) -> int:
    """The epoch as people and MLflow count it, 1 to ``epochs``, from its 0-based index.

    Checkpoints and Ray Train's reports keep the index (``TrainingState.epoch``, ``history[i]["epoch"]``).
    Everything a person reads uses the number: the console and Prefect logs, the run summary and artifacts,
    MLflow's ``step`` and tags, and the checkpoint folders (``epoch-0001`` holds the first epoch).
    """
    return int(index) + 1


CHECKPOINT_PREFIX = "epoch-"  # the TrainSpec loop's checkpoint folders: epoch-0001, epoch-0002, ...
# The whole name of such a folder: the epoch, a step within it for a checkpoint taken before the epoch ended
# (epoch-0002-step-00000150: global step 150, in the second epoch), and after a retraining the attempt
# (epoch-0002-r1). Anything else that starts with the prefix (epoch-0002.tmp, epoch-planted) is not one this
# project wrote.
EPOCH_FOLDER = re.compile(r"epoch-(\d{4,})(?:-step-(\d{8,}))?(?:-r(\d+))?")
STEP_MARK = "-step-"


def checkpoint_order(name: str) -> tuple[int, ...]:
    """Sort key of a run's checkpoint folders, oldest first: by time for Ray Train's checkpoint_<timestamp>; by
    epoch, then step within it (an epoch's own checkpoint after its steps'), then retraining, for the TrainSpec
    loop's, as numbers (epoch-0002-r10 after -r9, epoch-10000 after 9999)."""
    found = EPOCH_FOLDER.fullmatch(name)
    if not found:
        return (0, *map(int, re.findall(r"\d+", name)))
    epoch, step, retrained = found.groups()
    within = (0, int(step)) if step is not None else (1, 0)
    return (1, int(epoch), *within, int(retrained or 0))


def within_epoch(name: str) -> bool:
    """Whether checkpoint folder `name` was taken within an epoch (no epoch scores: never the registered one)."""
    found = EPOCH_FOLDER.fullmatch(name)
    return found is not None and found.group(2) is not None


def checkpoint_name(path: str) -> str:
    """The folder name of the checkpoint at ``path`` (a local path or a URI, with or without a trailing slash):
    the key of its pin tag, its LoggedModel and its place in Ray Train's run folder."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def pin_tag(checkpoint_name: str) -> str:
    return f"{PIN_TAG_PREFIX}{checkpoint_name}"


def pinned_digests(tags: dict[str, str]) -> dict[str, str]:
    """checkpoint folder name -> recorded manifest digest, from an MLflow run's tags."""
    return {key.removeprefix(PIN_TAG_PREFIX): value for key, value in tags.items() if key.startswith(PIN_TAG_PREFIX)}
