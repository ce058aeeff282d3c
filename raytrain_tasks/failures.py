"""Which training failures another attempt cannot fix: one that repeats identically is a bug, not bad luck.

Runs on Ray Train's controller (a callback): after every worker-group failure it compares what the training code
raised with what it raised at the previous failure. The same exception (type, message and the frames it came
from) twice in a row fails the fit at once with RepeatedFailureError, which neither Ray Train's worker-group
restarts (``max_failures``) nor Prefect's retries (``fit_retries``, ``tasks.fit.NOT_RETRYABLE``) repeat. A worker
that was killed or lost (no exception of the training code) never counts as a repeat.
"""

from __future__ import annotations

import re
from typing import Any

from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from raytrain_tasks.errors import RepeatedFailureError, key_hint

# Addresses, pids and object ids differ between attempts of the same bug.
_VOLATILE = re.compile(r"0x[0-9a-f]+|pid=\d+|ip=[\d.]+|\b[0-9a-f]{16,}\b")


def failure_signature(error: BaseException) -> str | None:
    """What identifies an exception raised by the training code across attempts; None for a failure that is not
    one (a killed worker, a lost node, a failed start)."""
    base = getattr(error, "_base_exc", None)  # Ray Train's UserExceptionWithTraceback around the code's exception
    if base is None:
        return None
    frames = [line.strip() for line in str(error).splitlines() if line.strip().startswith("File ")]
    return _VOLATILE.sub("", f"{type(base).__module__}.{type(base).__qualname__}: {base}\n" + "\n".join(frames))


class StopOnRepeatedFailure(WorkerGroupCallback):  # type: ignore[misc]
    """Fail the fit when a worker-group attempt fails with the exception the previous failed attempt raised."""

    def __init__(self, run_key: str) -> None:
        self.run_key = run_key
        self.previous: frozenset[str] = frozenset()
        self.seen_this_attempt = False

    def after_worker_group_start(self, worker_group: Any) -> None:
        self.seen_this_attempt = False

    def after_worker_group_poll_status(self, worker_group_status: Any) -> None:
        # The statuses' errors as the workers sent them (``.errors`` unwraps them, dropping the traceback).
        errors: dict[int, BaseException] = {
            rank: status.error for rank, status in worker_group_status.worker_statuses.items() if status.error
        }
        if not errors or self.seen_this_attempt:
            return
        self.seen_this_attempt = True
        signatures = {rank: failure_signature(error) for rank, error in sorted(errors.items())}
        current = frozenset(s for s in signatures.values() if s is not None)
        repeated = current & self.previous
        self.previous = current
        if not repeated:
            return
        rank, error = next((r, errors[r]) for r, s in signatures.items() if s in repeated)
        base = getattr(error, "_base_exc", error)
        raise RepeatedFailureError(
            f"run {self.run_key}: the training raised the same exception on two attempts in a row "
            f"({type(base).__name__}: {base}{key_hint(base)}, worker rank {rank}). It fails the same way on every "
            "attempt (a bug in the training code, or data or settings it cannot handle), so it is not retried: "
            "neither by Ray Train's worker-group restarts (`max_failures`) nor by Prefect (`fit_retries`). Fix the "
            f"cause, then continue the run with `resume={self.run_key}` (from its last checkpoint; from epoch 1 if "
            "none was committed). The worker's traceback:\n"
            f"{str(error)[-4000:]}"
        )
