"""A stop signal is not lost when its handler runs inside a finalizer."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from prefect.exceptions import TerminationSignal


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
        if isinstance(error, TerminationSignal):
            signum = error.signal
        elif isinstance(error, KeyboardInterrupt):
            signum = signal.SIGINT
        else:
            previous(unraisable)
            return
        threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()

    hook.sends_stops_again = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    return previous
