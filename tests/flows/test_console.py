"""The console without --verbose: a run's failure is said once, by the command at its end; the rest shows."""

from __future__ import annotations

import logging

from flows.console import _shortened


def _record(name: str, level: int, message: str, failed_with: BaseException | None = None) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, message, (), None)
    if failed_with is not None:
        record.exc_info = (type(failed_with), failed_with, None)
    return record


def test_a_runs_failure_stays_off_the_console_and_the_rest_reaches_it() -> None:
    """Prefect's engine logs a failed run's error three times (the task's, its failed state, the flow's) with its
    own frames; the command prints it once, with the command that continues the run. Other lines stay, short."""
    shown: list[logging.LogRecord] = []
    emit = _shortened(shown.append)
    error = KeyError("hidden")
    emit(
        _record(
            "prefect.task_runs",
            logging.ERROR,
            f"Task run failed with exception: {error!r} - Retries are exhausted\nTraceback",
            error,
        )
    )
    emit(
        _record(
            "prefect.task_runs", logging.ERROR, "Finished in state Failed('Task run encountered an exception KeyError')"
        )
    )
    emit(_record("prefect.flow_runs", logging.ERROR, f"Encountered exception during execution: {error!r}", error))
    emit(_record("prefect.flow_runs", logging.ERROR, "Finished in state Failed('Flow run encountered an exception')"))
    emit(_record("prefect.flow_runs", logging.INFO, "epoch 1/2 committed"))
    retry = "Task run failed with exception: OSError('disk') - Retry 1/2 will start 10 second(s) from now"
    emit(_record("prefect.task_runs", logging.INFO, retry))
    emit(_record("prefect.task_runs", logging.INFO, "a long line\nof two"))
    # An error the command does not print itself: shown.
    job = "Ray Job prt-x-1 did not stop within 30 s; check it on the dashboard"
    emit(_record("prefect.task_runs", logging.ERROR, job))
    emit(_record("prefect", logging.ERROR, "the API went away"))  # not a run's: Prefect's own, shown
    said = [record.getMessage() for record in shown]
    assert said == [
        "epoch 1/2 committed",
        retry,
        "a long line ... (in full: the run's logs and --verbose)",
        job,
        "the API went away",
    ]
    assert all(record.exc_info is None for record in shown)
