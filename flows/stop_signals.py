"""A stop signal is not lost when its handler runs inside a finalizer."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect.exceptions import TerminationSignal

if TYPE_CHECKING:
    from raytrain_tasks.config import TrainingConfig


def send_again_a_stop_that_a_finalizer_swallowed() -> Callable[[Any], object]:
    """Python runs a signal's handler in whatever the main thread is executing. When that is an object's
    ``__del__`` (asyncio's transports have one), the exception the handler raises (Prefect's TerminationSignal,
    the CLI's, KeyboardInterrupt) is printed as "Exception ignored in" and dropped: the run went on as if no signal
    had come, and the CLI's stop deadline then exited it with its MLflow run left RUNNING (seen in CI). A stop
    dropped so is sent again from another thread, a moment later, so that its handler runs outside the finalizer.

    Installed by the CLI and by the flow (a served run's process is stopped with SIGTERM when it is cancelled);
    once per process. Returns the hook it replaced (the one in place if it was already installed).
    """
    previous = sys.unraisablehook
    if getattr(previous, "sends_stops_again", False):
        return previous

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        signum = (
            error.signal
            if isinstance(error, TerminationSignal)
            else signal.SIGINT
            if isinstance(error, KeyboardInterrupt)
            else None
        )
        # Signal handlers run in the main thread only: a stop dropped in another thread, or while the interpreter
        # shuts down, is not a signal this process still has to act on.
        if signum is None or threading.current_thread() is not threading.main_thread() or sys.is_finalizing():
            previous(unraisable)
            return

        def send_again() -> None:
            if sys.unraisablehook is hook:  # not once the CLI has returned (it puts back the hook it replaced)
                os.kill(os.getpid(), signum)

        timer = threading.Timer(0.05, send_again)
        timer.daemon = True  # never holds up the process's exit
        timer.start()

    hook.sends_stops_again = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    return previous


_RUN_KEY: list[str] = []  # at most one: the run key of the run this process trains now


def note_run_key(run_key: str | None) -> None:
    """Remember the run key of the run this process trains (the flow calls it as soon as the key is known; the
    CLI with None as it starts): the command's stop message then names the command that continues that run."""
    _RUN_KEY[:] = [run_key] if run_key else []


def noted_run_key() -> str | None:
    """The run key of the run this process trains; None before it has one."""
    return _RUN_KEY[0] if _RUN_KEY else None


# How long the stop deadline waits for MLflow to take the run's KILLED mark: an unreachable server would
# otherwise hold the exit for MLflow's minutes of retries (the next run of the experiment then marks it).
MARK_KILLED_WITHIN_S = 3.0


def mark_run_killed(config: TrainingConfig, signal_name: str, deadline_s: float) -> None:
    """At the stop deadline: the run this process drives is marked KILLED, not left RUNNING in the MLflow UI
    until its next run. Whatever goes wrong is only printed: the process exits next, either way."""
    from raytrain_tasks.redact import redact
    from raytrain_tasks.tracking.runs import connect, stop_own_run

    run_key = config.resume or noted_run_key()
    if not run_key:
        return
    reason = (
        f"stopped by {signal_name}: still stopping after {deadline_s:g} s, the command exited; its "
        f"checkpoints are kept: continue it with resume={run_key}"
    )
    try:
        client = connect(config.mlflow_tracking_uri, config.s3_endpoint_url)
        stop_own_run(client, config.experiment_name, run_key, reason)
    except Exception as exc:  # noqa: BLE001 - any failure here must not stop the exit (tests/flows/test_cli.py)
        print(f"could not mark MLflow run of {run_key} KILLED: {redact(str(exc))}", file=sys.stderr, flush=True)
