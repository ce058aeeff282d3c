"""The pipeline's errors: one root, one class per thing a user has to fix.

Each message names what failed, where, the likely cause and the setting to change. They carry only a
message, so they pickle across Ray workers unchanged.
"""

import os
import traceback
from pathlib import Path

# Names Ray Train's guides and most training scripts give the pipeline's own keys. Code that reads
# config["num_epochs"] trains its own count whatever --epochs says (and the run's progress, params and resume say
# otherwise): refused (raytrain_tasks.api) where ``defaults``, ``settings`` or ``train_config`` set them, and
# named where a KeyError on one fails the code.
# Only names that mean nothing else: `max_epochs` may be a scheduler's horizon, `n_epochs` a warm-up's length.
PIPELINE_KEY_ALIASES = {"num_epochs": "epochs", "learning_rate": "lr"}


class PipelineError(Exception):
    """Root of every error the pipeline raises on purpose."""


class DatasetError(PipelineError):
    """The dataset cannot be loaded or does not fit the config (missing file, missing label column)."""


class DataRefusedError(DatasetError):
    """Data a worker refuses the same way on every attempt (it changed since the run's last checkpoint, a split is
    empty): the fit ends at once, neither restarted by Ray Train nor retried by Prefect. A DatasetError from a
    failed read stays retried."""


class StorageError(PipelineError):
    """Shared storage is missing, unreachable or not writable."""


class NodeStorageError(StorageError):
    """A Ray node cannot use the run's storage with its own credentials: that node's setup must change."""


class CheckpointError(PipelineError):
    """A checkpoint is incomplete, corrupted or does not match the model."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holds content that is not plain data (a pickled object), or is not the one the run
    recorded when it committed it. Never loaded, never skipped silently: the storage was tampered with."""


class RunLeaseError(PipelineError):
    """Another live driver holds the run key's lease: this one trains nothing."""


class RunLeaseLostError(RunLeaseError):
    """This driver lost the run key's lease while training (taken over, or not renewed in time): it stopped its
    fit at once and leaves the run, its checkpoints and its MLflow run to the driver that holds the lease now."""


class ContinuationError(PipelineError):
    """A crashed flow run cannot or must not be continued (not crashed, not ours, or its crash budget is spent)."""


class UserCodeError(PipelineError):
    """`train_code` cannot be imported, is not a TrainFunc, or does not do what the pipeline needs of it (report
    the gate's metric, report a checkpoint). Another attempt cannot fix it: the code must change."""


class ClusterError(PipelineError):
    """Ray is unreachable or lacks the resources the config asks for."""


class TrackingError(PipelineError):
    """MLflow is unreachable or refused a write."""


class TrainingError(PipelineError):
    """Training failed beyond what Ray Train's restarts could recover."""


class UnverifiedCheckpointError(TrainingError):
    """A checkpoint could not be verified for lack of a reading (storage unreadable then, not shown changed): another
    attempt resumes from the newest checkpoint that verifies."""


class RepeatedFailureError(TrainingError):
    """The training raised the same exception on two attempts in a row: a bug that another attempt repeats."""


class PromotionError(PipelineError):
    """The champion decision could not be made; no alias moved and the decision is redone by the next attempt."""


class RollbackError(PipelineError):
    """A rollback of the champion was refused (no such model or version, the champion already, an unknown run,
    no reason given); nothing moved."""


class SettingsError(PipelineError):
    """A flow run's parameters do not make a valid training config."""


class ScoringInputError(PipelineError):
    """A scoring run's model or input does not fit: found before any row is scored, nothing written."""


# This project's packages, whose frames are never the user's: under a data error of the table classifier they
# read as if the user's code had failed.
_PIPELINE_DIRS = tuple(
    f"{Path(__file__).resolve().parent.parent / name}{os.sep}" for name in ("raytrain_tasks", "raytrain_driver")
)


def user_frames(exc: BaseException) -> str:
    """The exception with the user's own frames (not this project's or importlib's)."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if "importlib" not in frame.filename and not os.path.realpath(frame.filename).startswith(_PIPELINE_DIRS)
    ]
    where = "".join(traceback.format_list(frames)).rstrip()
    return f"{type(exc).__name__}: {exc}{key_hint(exc)}" + (f"\n{where}" if where else "")


def key_hint(exc: BaseException) -> str:
    """For a KeyError on another name of a key the pipeline puts into ``config`` (``num_epochs``): which one."""
    key = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
    if not isinstance(key, str) or key not in PIPELINE_KEY_ALIASES:
        return ""
    return f" (the pipeline puts this value into config as {PIPELINE_KEY_ALIASES[key]!r}: read that key)"
