"""Which failures of distributed-fit Prefect retries: a table of errors against `is_retryable`, no fit.

A real killed worker retried from its newest verified checkpoint, and retries running out, are shown end to end
in the chaos tier (tests/raytrain_driver/test_recovery.py).
"""

from __future__ import annotations

import pytest
from prefect.states import Failed

from raytrain_tasks.errors import (
    CheckpointError,
    ClusterError,
    DataRefusedError,
    NodeStorageError,
    RepeatedFailureError,
    RunLeaseLostError,
    TrackingError,
    TrainingError,
    UnsafeCheckpointError,
    UnverifiedCheckpointError,
    UserCodeError,
)
from tasks.fit import is_retryable


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (TrainingError("a worker died: ActorDiedError"), True),  # what a killed worker ends the fit with
        (UnverifiedCheckpointError("checkpoint could not be read to verify it"), True),  # a retry reads it again
        (RuntimeError("anything the pipeline did not name"), True),
        (RepeatedFailureError("the same exception on two attempts in a row"), False),
        (UserCodeError("train_code failed on worker rank 0: TypeError"), False),
        (DataRefusedError("the data changed since this run's last checkpoint"), False),
        (CheckpointError("its files no longer hash to the digest"), False),
        (UnsafeCheckpointError("not a folder of this run"), False),
        (ClusterError("more workers than CPUs"), False),
        (TrackingError("MLflow refused the credentials"), False),
        (RunLeaseLostError("another driver holds the run"), False),
        (NodeStorageError("a node cannot write the bucket"), False),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else str(value),
)
def test_training_failures_are_retried_and_failures_another_attempt_cannot_fix_are_not(
    error: Exception, retried: bool
) -> None:
    assert is_retryable(None, None, Failed(data=error)) is retried
